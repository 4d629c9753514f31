// The per-row glue a decoder layer runs around its projections, for both C++ libraries: the engine's glue ops
// (server/csrc/decode_ops.cpp: rms_norm, add_rms_norm, silu_mul, gelu_tanh_mul) and the rows ops' one-call
// epilogues (a product that ends in them: rows_ops.cpp, int4_a8_ops.cpp). One code, so an epilogue computes the
// glue op's bits; server/fastops.py has the PyTorch references. Products and sums of 16-bit values are computed in
// fp32 and rounded where the eager ops round (as PyTorch's CPU kernels do).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "elements.h"
#include "vec_math.h"

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

namespace qs {

constexpr int64_t kGlueGrain = 1 << 15;  // below this much work a glue call stays on one thread

inline int64_t glue_grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGlueGrain / std::max<int64_t>(1, row_elems));
}

inline void check_glue_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
}

// o = a + b, n elements, the sum rounded once to the dtype (the residual add).
template <typename T>
inline void add_row(const typename Raw<T>::type* __restrict a, const typename Raw<T>::type* __restrict b,
                    typename Raw<T>::type* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = Raw<T>::put(Raw<T>::get(a[j]) + Raw<T>::get(b[j]));
}

// Llama RMSNorm of one row: normalise in fp32, round to the dtype, then multiply by the weight (rounded).
// With a delta, the row is x + delta (rounded once, written to xo) first.
template <typename T>
__attribute__((noinline)) void rms_row(const typename Raw<T>::type* __restrict x,
                                       const typename Raw<T>::type* __restrict delta, typename Raw<T>::type* xo,
                                       const typename Raw<T>::type* __restrict w, typename Raw<T>::type* __restrict h,
                                       int64_t n, float eps) {
  if (delta != nullptr) add_row<T>(x, delta, xo, n);
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

// h = rms_norm(x + delta) * w, with x + delta written to xo when delta is given (else xo is x).
inline void norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, double eps,
                      const at::Tensor& xo, const at::Tensor& h) {
  check_glue_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "w must be a contiguous (hidden,) tensor of x's dtype");
  if (delta != nullptr) {
    check_glue_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta != nullptr ? delta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* xop = const_cast<scalar_t*>(xo.const_data_ptr<scalar_t>());
    scalar_t* hp = const_cast<scalar_t*>(h.const_data_ptr<scalar_t>());
    at::parallel_for(0, rows, glue_grain_rows(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        rms_row<scalar_t>(raw(xp + r * n), dp != nullptr ? raw(dp + r * n) : nullptr, raw(xop + r * n), raw(wp),
                          raw(hp + r * n), n, static_cast<float>(eps));
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
__attribute__((noinline)) void act_row(const typename Raw<T>::type* __restrict g,
                                       const typename Raw<T>::type* __restrict u, typename Raw<T>::type* __restrict o,
                                       int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float act = Raw<T>::get(Raw<T>::put(Act::apply(Raw<T>::get(g[j]))));
    o[j] = Raw<T>::put(act * Raw<T>::get(u[j]));
  }
}

// act(gate) * up for a fused (T, 2I) gate_up output; the activation is rounded to the dtype before the product,
// as the eager ops do.
template <typename Act>
at::Tensor act_mul(const at::Tensor& gu) {
  check_glue_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "act_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, glue_grain_rows(2 * I), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* g = gp + t * 2 * I;  // (I,) gate then (I,) up
        act_row<scalar_t, Act>(raw(g), raw(g + I), raw(op + t * I), I);
      }
    });
  });
  return out;
}

// The gated epilogue of a [gate | up] product: act_mul by the glue op's name ("silu_mul", "gelu_tanh_mul").
inline at::Tensor act_mul_named(const at::Tensor& gu, const std::string& act) {
  if (act == "silu_mul") return act_mul<Silu>(gu);
  if (act == "gelu_tanh_mul") return act_mul<GeluTanh>(gu);
  TORCH_CHECK(false, "no gated activation ", act, " (there are: gelu_tanh_mul, silu_mul)");
}

// The norm epilogue of a product y (M, N) that a residual add and norms follow (o, down), in the order of
// server/models/base.py's layer and quant.runtime.kernels.triton_ops.AddNorm:
//   1. y = rms_norm(y) * post            the sub-layer's output norm, where post is given (Gemma 2/3, OLMo 2);
//   2. y = y * scale                     the residual multiplier, where it is not 1 (Granite), rounded as the eager
//                                        product of a 16-bit tensor and a Python float (the scalar in fp32);
//   3. x = residual + y                  the residual stream, the first result;
//   4. h = rms_norm(x) * weight          the next input norm, the second; x itself where weight is not given.
// y is the product's own output (a new tensor): the epilogue may write it.
inline std::tuple<at::Tensor, at::Tensor> add_norm(at::Tensor y, const at::Tensor& residual,
                                                   const std::optional<at::Tensor>& weight, double eps,
                                                   const std::optional<at::Tensor>& post, double post_eps,
                                                   double scale) {
  check_glue_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == y.sizes() && residual.scalar_type() == y.scalar_type(), "residual must be (",
              y.size(0), ", ", y.size(1), ") in the product's dtype ", y.scalar_type());
  if (post.has_value()) {
    at::Tensor normed = at::empty_like(y);
    norm_rows(y, nullptr, *post, post_eps, y, normed);
    y = normed;
  }
  if (scale != 1.0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "add_norm_scale", [&] {
      auto* p = raw(y.data_ptr<scalar_t>());
      const float s = static_cast<float>(scale);
      for (int64_t i = 0, n = y.numel(); i < n; ++i) p[i] = Raw<scalar_t>::put(Raw<scalar_t>::get(p[i]) * s);
    });
  }
  at::Tensor x = at::empty_like(residual);
  if (!weight.has_value()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "add_norm_add", [&] {
      add_row<scalar_t>(raw(residual.data_ptr<scalar_t>()), raw(y.data_ptr<scalar_t>()), raw(x.data_ptr<scalar_t>()),
                        y.numel());
    });
    return {x, x};
  }
  at::Tensor h = at::empty_like(residual);
  norm_rows(residual, &y, *weight, eps, x, h);
  return {x, h};
}

// The schema of a product's epilogue variants from the product's own ("name(args) -> Tensor"): name_gated(args,
// str act) -> Tensor, and name_normed(args, the AddNorm arguments) -> (x, h).
inline std::string epilogue_schema(const std::string& product, const std::string& kind) {
  const size_t open = product.find('('), close = product.rfind(") -> Tensor");
  TORCH_CHECK(open != std::string::npos && close != std::string::npos, "not a product's schema: ", product);
  const std::string head = product.substr(0, open) + "_" + kind + product.substr(open, close - open);
  if (kind == "gated") return head + ", str act) -> Tensor";
  TORCH_CHECK(kind == "normed", "no epilogue ", kind);
  return head + ", Tensor residual, Tensor? weight, float eps, Tensor? post, float post_eps, float scale) -> "
                "(Tensor, Tensor)";
}

}  // namespace qs

// NAME_gated and NAME_normed: the product NAME (PARAMS, ARGS: its parameters and their names, in parentheses), then
// the gated or the norm epilogue, in one call: a decode step's MLP and residual glue without ops of their own.
#define QS_UNPAREN(...) __VA_ARGS__
#define QS_EPILOGUES(NAME, PARAMS, ARGS)                                                                            \
  at::Tensor NAME##_gated(QS_UNPAREN PARAMS, const std::string& act) { return qs::act_mul_named(NAME ARGS, act); } \
  std::tuple<at::Tensor, at::Tensor> NAME##_normed(QS_UNPAREN PARAMS, const at::Tensor& residual,                  \
                                                   const std::optional<at::Tensor>& weight, double eps,           \
                                                   const std::optional<at::Tensor>& post, double post_eps,        \
                                                   double scale) {                                                 \
    return qs::add_norm(NAME ARGS, residual, weight, eps, post, post_eps, scale);                                  \
  }
