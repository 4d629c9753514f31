// Math of the CPU kernels' vectorised loops (server/csrc): functions written so that GCC vectorises the loops
// around them, where the library's are calls that keep a loop scalar. Built with quant/runtime/kernels/native.py, which puts this
// directory on the include path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace qs {

// exp(x): Cody-Waite range reduction and a degree-6 polynomial, within 2 ulp of std::exp on [-87, 88] (inputs are
// clamped there), branch-free; std::exp is a library call, which kept the activation loop scalar (1.6 ms for a
// 256-row chunk).
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // n = round(x / ln2) by the 1.5 * 2^23 trick (a library rounding call would keep the loop scalar);
  // x = n ln2 + r, |r| <= ln2 / 2
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// cap * tanh(x / cap), the soft-capping of attention scores (Gemma 2), through exp_approx.
inline float softcap(float x, float cap) { return cap * (2.0f / (1.0f + exp_approx(-2.0f * x / cap)) - 1.0f); }

// Eight fp32 lanes for hand-blocked loops (GCC's vector extension: AVX2's width; AVX-512 builds use the same form).
typedef float V8 __attribute__((vector_size(32)));
inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }

// acc (D,) = acc * alpha + sum_j w[j] V[j] over rows [a, z) of V (rows of D), D a multiple of 8, 64 channels held
// in registers at once (the attention kernels' weighted sums of values).
inline void weighted_sum(float* __restrict acc, float alpha, const float* __restrict w, const float* __restrict V,
                         int64_t a, int64_t z, int64_t D) {
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t nv = std::min<int64_t>(8, (D - c) / 8);
    V8 r[8];
    for (int64_t u = 0; u < nv; ++u) r[u] = load8(acc + c + 8 * u) * alpha;
    for (int64_t j = a; j < z; ++j) {
      const V8 x = V8{} + w[j];
      const float* vr = V + j * D + c;
      for (int64_t u = 0; u < nv; ++u) r[u] += x * load8(vr + 8 * u);
    }
    for (int64_t u = 0; u < nv; ++u) store8(acc + c + 8 * u, r[u]);
  }
}

}  // namespace qs
