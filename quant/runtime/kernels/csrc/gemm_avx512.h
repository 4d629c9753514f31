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
#include "int4_vec.h"

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
        if (e.col_scale) {
          const __m512 cs = _mm512_loadu_ps(e.col_scale + 16 * j);
          v = _mm512_mul_ps(v, e.row_scale ? _mm512_mul_ps(_mm512_set1_ps(e.row_scale[r]), cs) : cs);
        }
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
      __m512 w[2][4];  // columns c and c + 1, as the dequantizer computes them (int4_vec.h)
      for (int h = 0; h < 2; ++h) {
        Int4Vec::codes(blk + (c + h) * 32, w[h]);
        for (int j = 0; j < 4; ++j) w[h][j] = Int4Vec::mul_add(w[h][j], s[j], off[j]);
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

// A block of the (N, K) int8 weight, rows [64 b, 64 b + 64): (q - z) * s per row (s null: the codes themselves).
// 16 rows x 32 columns at a time: each row's 32 weights become one vector of 16 pairs, and a transpose turns 16
// such rows into 16 tile vectors.
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

  void prefetch(int64_t b, int64_t k0, int64_t kc) const { prefetch_rows(q + b * 64 * k, 64, k, k0, kc); }
};

#if defined(__AVX512VNNI__)
// W8A8's product with AVX512-VNNI (gemm_ops.cpp w8a8_gemm): vpdpbusd multiplies 4 unsigned by 4 signed bytes per
// 32-bit lane (64 multiply-adds an instruction, twice vdpbf16ps), so x is staged as xq + 128 and the epilogue takes
// 128 * sum_k q[c, k] back off the exact int32 sums: int_mm's sums, bit for bit. A tile: tile[p * 4 + j] lane l
// holds q[64 b + 16 j + l][k0 + 4 p .. + 3]; the sums (rows, 64) are int32, kept in the driver's float buffer by
// their bits.
struct Avx512Vnni {
  static constexpr int64_t kBlock = 64;
  static constexpr int64_t kColBytes = 64;  // 64 int8 per K column
  static constexpr int64_t kTileBytes = 32 << 10;
  using Tile = __m512i;
  using X = uint8_t;  // xq + 128

  // MR rows of x times the tile's kt columns into acc (MR, 64) int32 sums: overwritten when `first`, else added
  // to. Six rows are written out as named variables: GCC 12 kept an array of 24 integer accumulators in registers
  // but also stored most of them to the stack at every step (vpdpbusd then ran no faster than vdpbf16ps).
  template <int MR>
  static void strip(const X* __restrict x, int64_t ldx, int64_t k0, const Tile* __restrict tile, int64_t kt,
                    bool first, float* __restrict acc) {
    auto* a32 = reinterpret_cast<__m512i*>(acc);  // intrinsic loads and stores may alias
    const auto init = [&](int j) { return first ? _mm512_setzero_si512() : _mm512_loadu_si512(a32 + j); };
    const X* xk = x + k0;
    if constexpr (MR == 6) {
      __m512i a00 = init(0), a01 = init(1), a02 = init(2), a03 = init(3);
      __m512i a10 = init(4), a11 = init(5), a12 = init(6), a13 = init(7);
      __m512i a20 = init(8), a21 = init(9), a22 = init(10), a23 = init(11);
      __m512i a30 = init(12), a31 = init(13), a32v = init(14), a33 = init(15);
      __m512i a40 = init(16), a41 = init(17), a42 = init(18), a43 = init(19);
      __m512i a50 = init(20), a51 = init(21), a52 = init(22), a53 = init(23);
      for (int64_t p = 0; p < kt / 4; ++p) {
        const Tile* t = tile + p * 4;
        const __m512i w0 = _mm512_load_si512(t), w1 = _mm512_load_si512(t + 1);
        const __m512i w2 = _mm512_load_si512(t + 2), w3 = _mm512_load_si512(t + 3);
        const X* xp = xk + 4 * p;
        step(xp, w0, w1, w2, w3, a00, a01, a02, a03);
        step(xp + ldx, w0, w1, w2, w3, a10, a11, a12, a13);
        step(xp + 2 * ldx, w0, w1, w2, w3, a20, a21, a22, a23);
        step(xp + 3 * ldx, w0, w1, w2, w3, a30, a31, a32v, a33);
        step(xp + 4 * ldx, w0, w1, w2, w3, a40, a41, a42, a43);
        step(xp + 5 * ldx, w0, w1, w2, w3, a50, a51, a52, a53);
      }
      const __m512i all[24] = {a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23,
                               a30, a31, a32v, a33, a40, a41, a42, a43, a50, a51, a52, a53};
      for (int j = 0; j < 24; ++j) _mm512_storeu_si512(a32 + j, all[j]);
    } else {  // the last strip of a chunk
      __m512i a[MR][4];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = init(4 * i + j);
      for (int64_t p = 0; p < kt / 4; ++p) {
        const Tile* t = tile + p * 4;
        for (int i = 0; i < MR; ++i)
          step(xk + i * ldx + 4 * p, t[0], t[1], t[2], t[3], a[i][0], a[i][1], a[i][2], a[i][3]);
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) _mm512_storeu_si512(a32 + 4 * i + j, a[i][j]);
    }
  }

  // One quad of K columns of one x row (4 unsigned bytes) into the row's four accumulators.
  static void step(const X* x, __m512i w0, __m512i w1, __m512i w2, __m512i w3, __m512i& a0, __m512i& a1,
                   __m512i& a2, __m512i& a3) {
    int32_t quad;
    std::memcpy(&quad, x, sizeof(quad));
    const __m512i xb = _mm512_set1_epi32(quad);
    a0 = _mm512_dpbusd_epi32(a0, xb, w0);
    a1 = _mm512_dpbusd_epi32(a1, xb, w1);
    a2 = _mm512_dpbusd_epi32(a2, xb, w2);
    a3 = _mm512_dpbusd_epi32(a3, xb, w3);
  }

  // int32 sums less the offsets -> fp32 (as int_mm's .float()), then the epilogue, to bf16 to nearest even.
  static void finish(const float* __restrict acc, int64_t rows, const Epilogue& e, uint16_t* __restrict out,
                     int64_t n) {
    const auto* a32 = reinterpret_cast<const __m512i*>(acc);
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < 4; ++j) {
        const __m512i sums =
            _mm512_sub_epi32(_mm512_loadu_si512(a32 + 4 * r + j), _mm512_loadu_si512(e.col_offset + 16 * j));
        __m512 v = _mm512_cvtepi32_ps(sums);
        v = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(e.row_scale[r]), _mm512_loadu_ps(e.col_scale + 16 * j)));
        if (e.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(e.bias + 16 * j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
      }
  }
};

// A block of the (N, K) int8 weight as Avx512Vnni's tiles: 16 rows x 64 columns at a time, each row's 16 quads of
// bytes one vector, transposed (K a multiple of 4; a last step of fewer columns loads zeros past them).
struct Int8QuadTiles {
  const int8_t* q;
  int64_t k;
  static constexpr int64_t kAlign = 64;

  void operator()(int64_t b, int64_t k0, int64_t kc, __m512i* __restrict tile) const {
    for (int64_t c = k0; c < k0 + kc; c += 64) {
      const int64_t cols = std::min<int64_t>(64, k0 + kc - c);  // a multiple of 4
      const __mmask64 mask = cols == 64 ? ~__mmask64{0} : (__mmask64{1} << cols) - 1;
      for (int j = 0; j < 4; ++j) {
        __m512i v[16];
        for (int l = 0; l < 16; ++l) v[l] = _mm512_maskz_loadu_epi8(mask, q + (b * 64 + 16 * j + l) * k + c);
        transpose16(v);  // v[p] lane l: row 16 j + l's quad p
        for (int64_t p = 0; p < cols / 4; ++p) tile[((c - k0) / 4 + p) * 4 + j] = v[p];
      }
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const { prefetch_rows(q + b * 64 * k, 64, k, k0, kc); }
};
#endif  // __AVX512VNNI__

}  // namespace qs::gemm
