// One column of a full block of the CPU int4pack layout as fp32 vectors, at the vector width this build has (AVX-512:
// 64-row blocks, 32 bytes a column; AVX2: 32-row blocks, 16 bytes), for the kernels that read that layout (the
// dequantizer in dequant_ops.cpp, the few-row product in rows_ops.cpp, the tiles of gemm_avx512.h and
// gemm_avx2.h). The layout follows the width ATen dispatches to, and quant/runtime/kernels/native.py caps each build at that width,
// so the two agree.
//
// Split nibbles: byte i holds row i (low) and row HALF + i (high). `codes` returns the four vectors of rows
// [0, L), [L, 2L) (low nibbles), [2L, 3L), [3L, 4L) (high), L the lanes, as exact fp32 0..15; `half` two of them.
// `put` stores a vector to fp32, or rounded to bf16 (to nearest even, NaN to 0x7FC0, as
// qs::Raw<c10::BFloat16>::put).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace qs {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QS_INT4_VEC 1
struct Int4Vec {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int64_t kHalf = 32;  // bytes of one column of a full block

  static void codes(const uint8_t* src, F out[4]) { half(src, 0, out), half(src, 4, out + 2); }
  // The low (shift 0) or high (shift 4) nibbles: rows [0, 2L) or [2L, 4L).
  static void half(const uint8_t* src, int shift, F out[2]) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bytes, shift), _mm256_set1_epi8(15));
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul_add(F a, F b, F c) { return _mm512_add_ps(_mm512_mul_ps(a, b), c); }  // two roundings
  static void put(F v, float* w) { _mm512_storeu_ps(w, v); }
  static void put(F v, uint16_t* w) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i out = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), _mm512_cvtepi32_epi16(out));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define QS_INT4_VEC 1
struct Int4Vec {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int64_t kHalf = 16;

  static void codes(const uint8_t* src, F out[4]) { half(src, 0, out), half(src, 4, out + 2); }
  static void half(const uint8_t* src, int shift, F out[2]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i q = _mm_and_si128(_mm_srli_epi16(bytes, shift), _mm_set1_epi8(15));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul_add(F a, F b, F c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }  // two roundings
  static void put(F v, float* w) { _mm256_storeu_ps(w, v); }
  static void put(F v, uint16_t* w) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // 8 x u16 in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm256_castsi256_si128(packed));
  }
};
#endif

}  // namespace qs
