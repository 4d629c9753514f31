// The tiled many-row products' AVX512-BF16 kernel (gemm_ops.cpp has the driver and the ops): 64-row blocks of W
// expanded into bf16 pair tiles, bf16 x read in place, 6 x 64 register-blocked strips of vdpbf16ps.
//
// A tile: tile[(p * 4 + j) * 16 + l] is the 32-bit lane (w[c][r], w[c + 1][r]) of bf16 weights, c = k0 + 2p, r =
// 16 j + l, w[c][r] = W[64 b + r, c]. An expander fills the pairs of columns [k0, k0 + kc) of block b: expand(b, k0,
// kc, tile); expand.prefetch(b, k0, kc) asks for the bytes it will read into L2.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "elements.h"
#include "gemm_common.h"

namespace qs::gemm {

struct Avx512 {
  static constexpr int64_t kBlock = 64;      // W rows per block: 4 vectors of 16 fp32 sums per x row
  static constexpr int64_t kColBytes = 128;  // a tile's bytes per K column (64 bf16)
  static constexpr int64_t kTileBytes = 32 << 10;  // a K-tile, to stay in L1 (48 KiB) beside x's strip
  static constexpr int64_t kInt4Block = 64;  // the int4pack layout's blocks at this width (split nibbles)
  using Tile = __m512i;
  using X = uint16_t;  // bf16 x, read where it is

  // MR rows of x (row stride ldx, from column k0) times the tile's kt columns, into acc (MR, 64) fp32: overwritten
  // when `first`, else added to.
  template <int MR>
  static void strip(const X* __restrict x, int64_t ldx, int64_t k0, const Tile* __restrict tile, int64_t kt,
                    bool first, float* __restrict acc) {
    __m512 a[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * kBlock + 16 * j);
    const X* xk = x + k0;
    for (int64_t p = 0; p < kt / 2; ++p) {
      const Tile* t = tile + p * 4;
      const __m512bh w0 = (__m512bh)_mm512_load_si512(t), w1 = (__m512bh)_mm512_load_si512(t + 1);
      const __m512bh w2 = (__m512bh)_mm512_load_si512(t + 2), w3 = (__m512bh)_mm512_load_si512(t + 3);
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xk + i * ldx + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        a[i][0] = _mm512_dpbf16_ps(a[i][0], w0, xb);
        a[i][1] = _mm512_dpbf16_ps(a[i][1], w1, xb);
        a[i][2] = _mm512_dpbf16_ps(a[i][2], w2, xb);
        a[i][3] = _mm512_dpbf16_ps(a[i][3], w3, xb);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + i * kBlock + 16 * j, a[i][j]);
  }

  // (rows, 64) fp32 sums -> bf16 columns of out (row stride n), through the epilogue (its vectors at this block).
  static void finish(const float* __restrict acc, int64_t rows, const Epilogue& e, uint16_t* __restrict out,
                     int64_t n) {
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < 4; ++j) {
        __m512 v = _mm512_loadu_ps(acc + r * kBlock + 16 * j);
        if (e.col_scale)  // (row scale * column scale) first, as W8A8Linear._finish
          v = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(e.row_scale[r]), _mm512_loadu_ps(e.col_scale + 16 * j)));
        if (e.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(e.bias + 16 * j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
      }
  }
};

// One block of the AVX-512 int4pack layout: (K, 32) bytes, byte i of column c holding row i (low nibble) and row 32
// + i (high); sz: the (G, N, 2) (scale, zero) table.
template <typename S>
struct Int4Tiles512 {
  const uint8_t* packed;
  const S* sz;
  int64_t n, k, gs;
  static constexpr int64_t kAlign = 2;  // a K-tile starts on an even column (gs is even: a pair shares a group)

  void operator()(int64_t b, int64_t k0, int64_t kc, __m512i* __restrict tile) const {
    // cvtne2ps_pbh(b, a) puts a's 16 bf16 below b's; this interleaves them into pairs (a_l, b_l)
    alignas(64) static constexpr uint16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                         8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512(kPairs);
    const __m256i nib = _mm256_set1_epi8(15);
    const uint8_t* blk = packed + b * 64 * k / 2;
    __m512 s[4], off[4];
    int64_t loaded = -1;
    for (int64_t c = k0; c < k0 + kc; c += 2) {
      const int64_t g = c / gs;
      if (g != loaded) {
        alignas(64) float sv[64], ov[64];
        group_scales(sz, g, n, b * 64, 64, sv, ov);
        for (int j = 0; j < 4; ++j) s[j] = _mm512_load_ps(sv + 16 * j), off[j] = _mm512_load_ps(ov + 16 * j);
        loaded = g;
      }
      __m512 w[2][4];
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (c + h) * 32));
        const __m256i lo = _mm256_and_si256(bytes, nib), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);
        const __m128i q[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                              _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int j = 0; j < 4; ++j)
          w[h][j] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[j])), s[j]), off[j]);
      }
      __m512i* t = tile + (c - k0) / 2 * 4;
      for (int j = 0; j < 4; ++j)
        t[j] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1][j], w[0][j]));
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const {  // the tile's codes: kc * 32 contiguous bytes
    const char* p = reinterpret_cast<const char*>(packed + b * 64 * k / 2 + k0 * 32);
    for (int64_t i = 0; i < kc * 32; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
  }
};

// v[i] lane j -> v[j] lane i, for 16 vectors of 16 32-bit lanes.
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(v[8 * h + i], v[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_i32x4(v[8 * h + i], v[8 * h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    v[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);
  }
}

// A block of the (N, K) int8 weight, rows [64 b, 64 b + 64): (q - z) * s per row (s null: the codes themselves). 16 rows x 32 columns at a time:
// each row's 32 weights become one vector of 16 pairs, and a transpose turns 16 such rows into 16 tile vectors.
struct Int8Tiles512 {
  const int8_t* q;
  const float* scale;   // null: 1
  const int8_t* zero;   // null: symmetric
  int64_t k;
  static constexpr int64_t kAlign = 32;  // a K-tile starts on a 32-column step (the last one may be shorter)

  void operator()(int64_t b, int64_t k0, int64_t kc, __m512i* __restrict tile) const {
    for (int64_t c = k0; c < k0 + kc; c += 32) {
      const int64_t cols = std::min<int64_t>(32, k0 + kc - c);  // even
      const __mmask32 mask = cols == 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
      for (int j = 0; j < 4; ++j) {
        __m512i v[16];
        for (int l = 0; l < 16; ++l) {
          const int64_t r = b * 64 + 16 * j + l;
          const __m256i bytes = _mm256_maskz_loadu_epi8(mask, q + r * k + c);
          const __m512 z = _mm512_set1_ps(zero ? static_cast<float>(zero[r]) : 0.f);
          const __m512 s = _mm512_set1_ps(scale ? scale[r] : 1.f);
          const __m512 lo = _mm512_mul_ps(
              _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))), z), s);
          const __m512 hi = _mm512_mul_ps(
              _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1))), z), s);
          v[l] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // columns c .. c + 31 in order: lane p = pair p
        }
        transpose16(v);  // v[p] lane l: row 16 j + l's pair p
        __m512i* t = tile + (c - k0) / 2 * 4 + j;
        for (int64_t p = 0; p < cols / 2; ++p) t[p * 4] = v[p];
      }
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const {  // the tile's codes: kc bytes of each of 64 rows
    for (int64_t r = b * 64; r < (b + 1) * 64; ++r) {
      const char* p = reinterpret_cast<const char*>(q + r * k + k0);
      for (int64_t i = 0; i < kc; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
      _mm_prefetch(p + kc - 1, _MM_HINT_T1);  // a row's bytes need not start on a line
    }
  }
};

}  // namespace qs::gemm
