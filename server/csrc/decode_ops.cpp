// Fused CPU kernels for the engine's per-layer glue (server/layers and the sdpa attention backend use them;
// server/fastops.py loads them, with the attention kernels of attention_ops.cpp in the same library; each has a
// PyTorch reference there and tests hold one to the other).
//
// Why: at batch 1 on a small model a decode step is ~40 small tensor ops per layer, and on CPU each op costs
// a few microseconds of dispatch whatever its size, as much as the int4 matmuls' arithmetic. These kernels do
// the same arithmetic as the eager ops they replace, rounding to the model dtype at the same points
// (products and sums of 16-bit tensors are computed in fp32 and rounded, as PyTorch's CPU kernels do), so
// results match the eager path up to the order of a sum and the last bit of exp/rsqrt. The norms' and the gated
// activations' row kernels are quant/runtime/kernels/csrc/epilogue.h's, which the rows ops' one-call epilogues share.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elements.h"
#include "epilogue.h"
#include "vec_math.h"

#include <cmath>
#include <cstring>
#include <tuple>

using qs::rnd;
using qs::to_f;

using qs::norm_rows;

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
  qs::check_glue_rows(cos, "cos");
  qs::check_glue_rows(sin, "sin");
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
    at::parallel_for(0, T, qs::glue_grain_rows((H + Hkv) * D), [&](int64_t b, int64_t e) {
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
    at::parallel_for(0, T, qs::glue_grain_rows(2 * row), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        std::copy(kp + t * kst, kp + t * kst + row, kc + sp[t] * row);
        std::copy(vp + t * vst, vp + t * vst + row, vc + sp[t] * row);
      }
    });
  });
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
  m.impl("silu_mul", &qs::act_mul<qs::Silu>);
  m.impl("gelu_tanh_mul", &qs::act_mul<qs::GeluTanh>);
}
