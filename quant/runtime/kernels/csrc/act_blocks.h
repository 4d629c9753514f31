// One activation row quantized in blocks of 32 columns, as the rows passes on quantized activations read it
// (int4_a8_ops.cpp, rows_ops.cpp's int8_weight_rows16): to int8 with a scale per block (quantize_row, llama.cpp's Q8 blocks) or to
// int16 with a power-of-two scale per block (quantize_row16), the same values as their PyTorch references
// (quant.runtime.primitives.quantize_act_blocks, quantize_act_blocks16). AVX2 builds without AVX-512 only
// (QS_ACT_BLOCKS), the width the int4 layout these passes read has.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
#define QS_ACT_BLOCKS 1

namespace qs::act {

constexpr int64_t kBlock = 32;  // activation columns per scale

inline float hmax8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// A block of 32 columns of x into v and its largest magnitude into m; false where an element is not finite.
inline bool load_block(const float* xb, __m256 v[4], float& m) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  m = hmax8(mx);
  return !_mm256_movemask_ps(bad) && std::isfinite(m);
}

// Block b's codes' sum (eight lanes) times its scale s, added to its weight group's sum of the activations as the
// product sees them (the group's first block starts it).
inline void add_group_sum(__m256i sum, float s, int64_t b, int64_t gs, float* gsum) {
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), sum);
  const int32_t total = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  const int64_t g = b * kBlock / gs;
  gsum[g] = (b * kBlock % gs == 0 ? 0.f : gsum[g]) + s * static_cast<float>(total);
}

// One x row quantized as quant.runtime.primitives.quantize_act_blocks does: q (K,) int8, d (K / 32,) fp32 block
// scales (max |x| / qmax, at least `min_scale`), gsum (G,) each weight group's sum of d q (the activations as the
// product sees them). The same IEEE division and round-half-to-even as torch. false where the row is not finite.
inline bool quantize_row(const float* x, int64_t k, int64_t gs, float qmax, float min_scale, int8_t* q, float* d,
                  float* gsum) {
  const __m256 hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    float m;
    if (!load_block(x + b * kBlock, v, m)) return false;
    const float s = std::max(m / qmax, min_scale);
    d[b] = s;
    const __m256 sv = _mm256_set1_ps(s);
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      sum = _mm256_add_epi32(sum, c[i]);
    }
    // packs interleave 128-bit lanes: the permute restores the 32 codes' order
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    add_group_sum(sum, s, b, gs, gsum);
  }
  return true;
}

// One x row as int16 in blocks of 32 columns, each block's scale the power of two d = 2^(e - 15) for its max |x| in
// [2^(e-1), 2^e) (quant.runtime.primitives.quantize_act_blocks16): q = x / d rounded half to even, |q| <= 32767. x / d
// is exact, so an element within 2^7 of its block's max in magnitude (every element of a bf16 block whose range spans
// under 2^7; 2^4 for fp16) is held exactly; the rest lose what lies below d / 2 <= 2^-15 of the block's max. gsum as
// quantize_row's. false where the row is not finite.
inline bool quantize_row16(const float* x, int64_t k, int64_t gs, int16_t* q, float* d, float* gsum) {
  const __m256 hi = _mm256_set1_ps(32767.f), lo = _mm256_set1_ps(-32767.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    float m;
    if (!load_block(x + b * kBlock, v, m)) return false;
    int e = 0;
    std::frexp(m, &e);  // m = f 2^e, f in [0.5, 1) (e = 0 for m = 0)
    e = std::max(e, -100);  // 2^(15 - e) stays finite (the reference clamps e the same)
    const float s = std::ldexp(1.f, e - 15);
    d[b] = s;
    const __m256 inv = _mm256_set1_ps(std::ldexp(1.f, 15 - e));
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      sum = _mm256_add_epi32(sum, c[i]);
    }
    // packs interleave 128-bit lanes: the permute restores the order
    const __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    const __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock + 16), p1);
    add_group_sum(sum, s, b, gs, gsum);
  }
  return true;
}

}  // namespace qs::act

#endif
