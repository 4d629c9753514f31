// Fused CPU kernels for the engine's per-layer glue (server/layers and the sdpa attention backend use them;
// server/fastops.py loads them, with the attention kernels of attention_ops.cpp in the same library; each has a
// PyTorch reference there and tests hold one to the other).
//
// Why: at batch 1 on a small model a decode step is ~40 small tensor ops per layer, and on CPU each op costs
// a few microseconds of dispatch whatever its size, as much as the int4 matmuls' arithmetic. These kernels do
// the same arithmetic as the eager ops they replace, rounding to the model dtype at the same points
// (products and sums of 16-bit tensors are computed in fp32 and rounded, as PyTorch's CPU kernels do), so
// results match the eager path up to the order of a sum and the last bit of exp/rsqrt.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elements.h"
#include "vec_math.h"

#include <cmath>
#include <cstring>
#include <tuple>

using qs::Raw;
using qs::raw;
using qs::rnd;
using qs::exp_approx;
using qs::to_f;

namespace {

constexpr int64_t kGrainElems = 1 << 15;  // below this much work a call stays on one thread

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }


// Llama RMSNorm of one row: normalise in fp32, round to the dtype, then multiply by the weight (rounded).
// With a delta, the row is x + delta (rounded once, written to xo) first.
template <typename T>
__attribute__((noinline)) void rms_row(const typename Raw<T>::type* __restrict x,
                                       const typename Raw<T>::type* __restrict delta,
                                       typename Raw<T>::type* xo, const typename Raw<T>::type* __restrict w,
                                       typename Raw<T>::type* __restrict h, int64_t n, float eps) {
  if (delta != nullptr) {
    for (int64_t j = 0; j < n; ++j) xo[j] = Raw<T>::put(Raw<T>::get(x[j]) + Raw<T>::get(delta[j]));
  }
  const typename Raw<T>::type* src = delta != nullptr ? xo : x;
  float ss = 0.f;
  _Pragma("omp simd reduction(+ : ss)")
  for (int64_t j = 0; j < n; ++j) {
    const float v = Raw<T>::get(src[j]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    const float normed = Raw<T>::get(Raw<T>::put(Raw<T>::get(src[j]) * r));
    h[j] = Raw<T>::put(Raw<T>::get(w[j]) * normed);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
}

}  // namespace

namespace {

// h = rms_norm(x + delta) * w, with x + delta written to xo when delta is given (else xo is x).
void norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, double eps, const at::Tensor& xo,
               const at::Tensor& h) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "w must be a contiguous (hidden,) tensor of x's dtype");
  if (delta != nullptr) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta != nullptr ? delta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* xop = const_cast<scalar_t*>(xo.const_data_ptr<scalar_t>());
    scalar_t* hp = const_cast<scalar_t*>(h.const_data_ptr<scalar_t>());
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        rms_row<scalar_t>(raw(xp + r * n), dp != nullptr ? raw(dp + r * n) : nullptr, raw(xop + r * n), raw(wp),
                          raw(hp + r * n), n, static_cast<float>(eps));
      }
    });
  });
}

}  // namespace

// rms_norm(x) * w.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = at::empty_like(x);
  norm_rows(x, nullptr, w, eps, x, h);
  return h;
}

// (x + delta, rms_norm(x + delta) * w): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  at::Tensor xo = at::empty_like(x);
  at::Tensor h = at::empty_like(x);
  norm_rows(x, &delta, w, eps, xo, h);
  return {xo, h};
}

// Rotary embedding (rotate-half convention), in place, on q (T, H, D) and k (T, Hkv, D): views whose heads and
// head dims are contiguous (a row may be strided, as when q and k are slices of a fused qkv output). cos, sin:
// (T, R) with R <= D; the first R dims of each head are rotated, the rest left as they are (partial rotary).
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q and k must be (T, heads, D) with contiguous heads");
    TORCH_CHECK(t->scalar_type() == cos.scalar_type(), "q, k, cos and sin must share a dtype");
  }
  const int64_t T = q.size(0), D = q.size(2), R = cos.size(1), half = R / 2;
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "k must be (T, Hkv, D) like q");
  TORCH_CHECK(R % 2 == 0 && R <= D && cos.size(0) == T && sin.sizes() == cos.sizes(),
              "cos and sin must be (T, R) with an even R <= D");
  const int64_t H = q.size(1), Hkv = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* snp = sin.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, T, grain_rows((H + Hkv) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* c = cp + t * R;
        const scalar_t* s = snp + t * R;
        for (int64_t h = 0; h < H + Hkv; ++h) {
          scalar_t* x = h < H ? qp + t * qs + h * D : kp + t * ks + (h - H) * D;
          // x * cos + rotate_half(x) * sin, each product and the sum rounded like the eager ops.
          for (int64_t j = 0; j < half; ++j) {
            const float a = to_f(x[j]), bb = to_f(x[j + half]);
            const float lo = to_f(rnd<scalar_t>(a * to_f(c[j]))) +
                             to_f(rnd<scalar_t>(-bb * to_f(s[j])));
            const float hi = to_f(rnd<scalar_t>(bb * to_f(c[j + half]))) +
                             to_f(rnd<scalar_t>(a * to_f(s[j + half])));
            x[j] = rnd<scalar_t>(lo);
            x[j + half] = rnd<scalar_t>(hi);
          }
        }
      }
    });
  });
}

// k and v (T, Hkv, D), rows possibly strided, copied to their slots of one layer's paged cache
// kv (2, slots, Hkv, D). Slots are checked before anything is written.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv, const at::Tensor& slots) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous (2, slots, Hkv, D) tensor");
  const int64_t T = k.size(0), Hkv = kv.size(2), D = kv.size(3), nslots = kv.size(1);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                t->stride(1) == D && t->scalar_type() == kv.scalar_type(),
                "k and v must be (T, Hkv, D) with contiguous heads, in the cache's dtype");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous (T,) int64 tensor");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "slot ", sp[t], " is outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "store_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = kv.data_ptr<scalar_t>();
    scalar_t* vc = kc + nslots * Hkv * D;
    const int64_t kst = k.stride(0), vst = v.stride(0), row = Hkv * D;
    at::parallel_for(0, T, grain_rows(2 * row), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        std::copy(kp + t * kst, kp + t * kst + row, kc + sp[t] * row);
        std::copy(vp + t * vst, vp + t * vst + row, vc + sp[t] * row);
      }
    });
  });
}

// Activations of a gated MLP, computed in float.
struct Silu {
  static float apply(float x) { return x / (1.0f + exp_approx(-x)); }
};
struct GeluTanh {  // Gemma's MLP
  static float apply(float x) {
    constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
    // std::tanh, not exp_approx: the eager op's tanh saturates to -1 (a result of exactly 0) far sooner than
    // an exp-based form, and where it does not, 1 + tanh cancels; matching it bit for bit keeps Gemma's
    // outputs those of the eager path.
    return 0.5f * x * (1.0f + std::tanh(kAlpha * (x + 0.044715f * x * x * x)));
  }
};

// One row: o = act(g) * u. A function of its own (not inlined into the dispatch lambda, where GCC gives up on
// it), with unaliased raw pointers, so that the loop vectorises.
template <typename T, typename Act>
__attribute__((noinline)) void act_row(const typename Raw<T>::type* __restrict g, const typename Raw<T>::type* __restrict u,
             typename Raw<T>::type* __restrict o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float act = Raw<T>::get(Raw<T>::put(Act::apply(Raw<T>::get(g[j]))));
    o[j] = Raw<T>::put(act * Raw<T>::get(u[j]));
  }
}

// act(gate) * up for a fused (T, 2I) gate_up output; the activation is rounded to the dtype before the product,
// as the eager ops do.
template <typename Act>
at::Tensor act_mul(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "act_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* g = gp + t * 2 * I;  // (I,) gate then (I,) up
        act_row<scalar_t, Act>(raw(g), raw(g + I), raw(op + t * I), I);
      }
    });
  });
  return out;
}

TORCH_LIBRARY(quantserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) kv, Tensor slots) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("store_kv", &store_kv);
  m.impl("silu_mul", &act_mul<Silu>);
  m.impl("gelu_tanh_mul", &act_mul<GeluTanh>);
}
