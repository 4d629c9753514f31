// The tiled many-row products' AVX2 kernel (gemm_ops.cpp has the driver and the ops), for CPUs without AVX512-BF16,
// where a 16-bit GEMM is slower than fp32 (bench/RESULTS.md): x widened to fp32 once per call, 16-row blocks of W
// expanded into fp32 tiles, 6 x 16 register-blocked strips of FMAs (12 accumulators, 2 tile loads and 6 broadcasts
// per 12 FMAs). What the dequantize-to-fp32 + fp32 GEMM paths compute, without W in fp32 through memory.
//
// A tile: tile[2 c + h] holds w[c][8 h .. 8 h + 7] in fp32, w[c][r] = W[16 b + r, k0 + c]. An expander fills the
// columns [k0, k0 + kc) of block b: expand(b, k0, kc, tile); expand.prefetch(b, k0, kc) asks for its bytes into L2.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "elements.h"
#include "gemm_epilogue.h"

namespace qs::gemm {

struct Avx2 {
  static constexpr int64_t kBlock = 16;       // W rows per block: 2 vectors of 8 fp32 sums per x row
  static constexpr int64_t kColBytes = 64;    // a tile's bytes per K column (16 fp32)
  static constexpr int64_t kTileBytes = 16 << 10;  // L1: 32 KiB on most AVX2-only CPUs
  static constexpr int64_t kInt4Block = 32;   // the int4pack layout's blocks at this width (split nibbles)
  using Tile = __m256;
  using X = float;  // x widened once per call

  // MR rows of x (row stride ldx, from column k0) times the tile's kt columns, into acc (MR, 16): overwritten when
  // `first`, else added to.
  template <int MR>
  static void strip(const X* __restrict x, int64_t ldx, int64_t k0, const Tile* __restrict tile, int64_t kt,
                    bool first, float* __restrict acc) {
    if constexpr (MR == 6) {
      strip6(x + k0, ldx, tile, kt, first, acc);
    } else {  // the last strip of a chunk
      __m256 a[MR][2];
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) a[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * kBlock + 8 * h);
      for (int64_t c = 0; c < kt; ++c)
        for (int i = 0; i < MR; ++i) fma2(_mm256_broadcast_ss(x + i * ldx + k0 + c), tile + 2 * c, a[i][0], a[i][1]);
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + i * kBlock + 8 * h, a[i][h]);
    }
  }

  static void fma2(__m256 xb, const Tile* w, __m256& lo, __m256& hi) {
    lo = _mm256_fmadd_ps(xb, w[0], lo);
    hi = _mm256_fmadd_ps(xb, w[1], hi);
  }

  // The 6-row strip with its 12 accumulators as named variables: GCC 12 kept an array of them in registers but
  // also stored every one to the stack at every column (half the FMA rate).
  static void strip6(const X* __restrict x, int64_t ldx, const Tile* __restrict tile, int64_t kt, bool first,
                     float* __restrict acc) {
    const auto init = [&](int j) { return first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * j); };
    __m256 a00 = init(0), a01 = init(1), a10 = init(2), a11 = init(3), a20 = init(4), a21 = init(5);
    __m256 a30 = init(6), a31 = init(7), a40 = init(8), a41 = init(9), a50 = init(10), a51 = init(11);
    for (int64_t c = 0; c < kt; ++c) {
      const Tile* w = tile + 2 * c;
      const X* xc = x + c;
      fma2(_mm256_broadcast_ss(xc), w, a00, a01);
      fma2(_mm256_broadcast_ss(xc + ldx), w, a10, a11);
      fma2(_mm256_broadcast_ss(xc + 2 * ldx), w, a20, a21);
      fma2(_mm256_broadcast_ss(xc + 3 * ldx), w, a30, a31);
      fma2(_mm256_broadcast_ss(xc + 4 * ldx), w, a40, a41);
      fma2(_mm256_broadcast_ss(xc + 5 * ldx), w, a50, a51);
    }
    _mm256_storeu_ps(acc, a00), _mm256_storeu_ps(acc + 8, a01), _mm256_storeu_ps(acc + 16, a10);
    _mm256_storeu_ps(acc + 24, a11), _mm256_storeu_ps(acc + 32, a20), _mm256_storeu_ps(acc + 40, a21);
    _mm256_storeu_ps(acc + 48, a30), _mm256_storeu_ps(acc + 56, a31), _mm256_storeu_ps(acc + 64, a40);
    _mm256_storeu_ps(acc + 72, a41), _mm256_storeu_ps(acc + 80, a50), _mm256_storeu_ps(acc + 88, a51);
  }

  // (rows, 16) fp32 sums -> bf16 columns of out (row stride n) through the epilogue (its vectors at this block), to
  // nearest even as c10 rounds.
  static void finish(const float* __restrict acc, int64_t rows, const Epilogue& e, uint16_t* __restrict out,
                     int64_t n) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kBlock; ++j) {
        float y = acc[r * kBlock + j];
        if (e.col_scale) y = y * (e.row_scale[r] * e.col_scale[j]);  // as W8A8Linear._finish
        if (e.bias) y = y + e.bias[j];
        out[r * n + j] = qs::Raw<c10::BFloat16>::put(y);
      }
  }
};

// One half (16 rows) of a block of the AVX2 int4pack layout: (K, 16) bytes per 32-row block, byte i of column c
// holding row i (low nibble) and row 16 + i (high); sz: the (G, N, 2) (scale, zero) table. code * s + (z - 8 s).
template <typename S>
struct Int4Tiles2 {
  const uint8_t* packed;
  const S* sz;
  int64_t n, k, gs;
  static constexpr int64_t kAlign = 1;

  const uint8_t* block(int64_t b) const { return packed + (b / 2) * 32 * k / 2; }

  void operator()(int64_t b, int64_t k0, int64_t kc, __m256* __restrict tile) const {
    const uint8_t* blk = block(b);
    const int shift = b % 2 == 0 ? 0 : 4;  // rows 16 b .. 16 b + 15: the block's low or high nibbles
    const __m128i nib = _mm_set1_epi8(15);
    __m256 s[2], off[2];
    int64_t loaded = -1;
    for (int64_t c = k0; c < k0 + kc; ++c) {
      const int64_t g = c / gs;
      if (g != loaded) {
        const S* row = sz + (g * n + b * 16) * 2;
        alignas(32) float sv[16], ov[16];
        for (int64_t r = 0; r < 16; ++r) {
          sv[r] = qs::to_f(row[2 * r]);
          ov[r] = qs::to_f(row[2 * r + 1]) - sv[r] * 8.0f;  // as the dequantizer: the product rounds, then the sum
        }
        for (int h = 0; h < 2; ++h) s[h] = _mm256_load_ps(sv + 8 * h), off[h] = _mm256_load_ps(ov + 8 * h);
        loaded = g;
      }
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + c * 16));
      const __m128i q = _mm_and_si128(_mm_srli_epi16(bytes, shift), nib);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
      tile[2 * (c - k0)] = _mm256_add_ps(_mm256_mul_ps(lo, s[0]), off[0]);
      tile[2 * (c - k0) + 1] = _mm256_add_ps(_mm256_mul_ps(hi, s[1]), off[1]);
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const {  // the tile's codes: kc * 16 contiguous bytes
    const char* p = reinterpret_cast<const char*>(block(b) + k0 * 16);
    for (int64_t i = 0; i < kc * 16; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
  }
};

// r[i] lane j -> r[j] lane i, for 8 vectors of 8 floats.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // s[4 i + j]: rows 4 i .. 4 i + 3 of columns j (low half) and 4 + j (high)
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// 16 rows of a row-major (N, K) weight, 8 columns at a time: each row's 8 weights widened to fp32 by Row (int8:
// (q - z) * s; bf16: exact), then 8 x 8 transposes into tile columns. Row: load(r, c, cols) -> 8 floats, columns
// past `cols` zero; elem: the weight's bytes per element.
template <typename Row>
struct RowTiles2 {
  Row row;
  int64_t k, elem;
  static constexpr int64_t kAlign = 8;

  void operator()(int64_t b, int64_t k0, int64_t kc, __m256* __restrict tile) const {
    for (int64_t c = k0; c < k0 + kc; c += 8) {
      const int64_t cols = std::min<int64_t>(8, k0 + kc - c);
      for (int h = 0; h < 2; ++h) {
        __m256 v[8];
        for (int l = 0; l < 8; ++l) v[l] = row.load(16 * b + 8 * h + l, c, cols);
        transpose8(v);  // v[j]: column c + j of rows 16 b + 8 h ..
        for (int64_t j = 0; j < cols; ++j) tile[2 * (c - k0 + j) + h] = v[j];
      }
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const {  // kc elements of each of 16 rows
    const char* base = static_cast<const char*>(row.data());
    for (int64_t r = 16 * b; r < 16 * (b + 1); ++r) {
      const char* p = base + (r * k + k0) * elem;
      for (int64_t i = 0; i < kc * elem; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
      _mm_prefetch(p + kc * elem - 1, _MM_HINT_T1);  // a row's bytes need not start on a line
    }
  }
};

struct Int8Row {  // (q - z) * s, as the int8 dequantizer
  const int8_t* q;
  const float* scale;  // null: 1 (the codes themselves)
  const int8_t* zero;  // null: symmetric
  int64_t k;
  const void* data() const { return q; }
  __m256 load(int64_t r, int64_t c, int64_t cols) const {
    int64_t word = 0;
    if (cols == 8) {
      std::memcpy(&word, q + r * k + c, 8);  // one 8-byte load
    } else {
      std::memcpy(&word, q + r * k + c, cols);
    }
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(word)));
    return _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(zero ? static_cast<float>(zero[r]) : 0.f)),
                         _mm256_set1_ps(scale ? scale[r] : 1.f));
  }
};

struct Bf16Row {  // exact
  const uint16_t* w;
  int64_t k;
  const void* data() const { return w; }
  __m256 load(int64_t r, int64_t c, int64_t cols) const {
    __m128i v;
    if (cols == 8) {
      v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * k + c));
    } else {
      alignas(16) uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(h, w + r * k + c, cols * sizeof(uint16_t));
      v = _mm_load_si128(reinterpret_cast<const __m128i*>(h));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
};

// W8A8's product with AVX2 (gemm_ops.cpp w8a8_gemm): int16 pairs of quantized activations against int16 pairs
// of weight codes, vpmaddwd (16 multiply-adds per instruction, exact) into int32 sums, so the sums are int_mm's.
// A tile: tile[2 p + h] lane l holds (q[r][c], q[r][c + 1]), r = 16 b + 8 h + l, c = k0 + 2 p; the sums (rows, 16)
// are int32, kept in the driver's float buffer by bits.
struct Avx2Int16 {
  static constexpr int64_t kBlock = 16;
  static constexpr int64_t kColBytes = 32;  // 16 int16 per K column
  static constexpr int64_t kTileBytes = 16 << 10;
  using Tile = __m256i;
  using X = int16_t;  // the quantized activations, widened once per call

  static void madd2(__m256i xb, const Tile* w, __m256i& lo, __m256i& hi) {
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(xb, w[0]));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(xb, w[1]));
  }

  static __m256i pair(const X* p) {  // (p[0], p[1]) in every lane
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi32(v);
  }

  template <int MR>
  static void strip(const X* __restrict x, int64_t ldx, int64_t k0, const Tile* __restrict tile, int64_t kt,
                    bool first, float* __restrict acc) {
    auto* a32 = reinterpret_cast<__m256i*>(acc);  // the sums' bits (intrinsic loads and stores may alias)
    if constexpr (MR == 6) {
      strip6(x + k0, ldx, tile, kt, first, a32);
    } else {  // the last strip of a chunk
      __m256i a[MR][2];
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) a[i][h] = first ? _mm256_setzero_si256() : _mm256_loadu_si256(a32 + 2 * i + h);
      for (int64_t p = 0; p < kt / 2; ++p)
        for (int i = 0; i < MR; ++i) madd2(pair(x + i * ldx + k0 + 2 * p), tile + 2 * p, a[i][0], a[i][1]);
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) _mm256_storeu_si256(a32 + 2 * i + h, a[i][h]);
    }
  }

  // As Avx2::strip6: named accumulators, which GCC 12 keeps in registers.
  static void strip6(const X* __restrict x, int64_t ldx, const Tile* __restrict tile, int64_t kt, bool first,
                     __m256i* __restrict acc) {
    const auto init = [&](int j) { return first ? _mm256_setzero_si256() : _mm256_loadu_si256(acc + j); };
    __m256i a00 = init(0), a01 = init(1), a10 = init(2), a11 = init(3), a20 = init(4), a21 = init(5);
    __m256i a30 = init(6), a31 = init(7), a40 = init(8), a41 = init(9), a50 = init(10), a51 = init(11);
    for (int64_t p = 0; p < kt / 2; ++p) {
      const Tile* w = tile + 2 * p;
      const X* xc = x + 2 * p;
      madd2(pair(xc), w, a00, a01);
      madd2(pair(xc + ldx), w, a10, a11);
      madd2(pair(xc + 2 * ldx), w, a20, a21);
      madd2(pair(xc + 3 * ldx), w, a30, a31);
      madd2(pair(xc + 4 * ldx), w, a40, a41);
      madd2(pair(xc + 5 * ldx), w, a50, a51);
    }
    _mm256_storeu_si256(acc, a00), _mm256_storeu_si256(acc + 1, a01), _mm256_storeu_si256(acc + 2, a10);
    _mm256_storeu_si256(acc + 3, a11), _mm256_storeu_si256(acc + 4, a20), _mm256_storeu_si256(acc + 5, a21);
    _mm256_storeu_si256(acc + 6, a30), _mm256_storeu_si256(acc + 7, a31), _mm256_storeu_si256(acc + 8, a40);
    _mm256_storeu_si256(acc + 9, a41), _mm256_storeu_si256(acc + 10, a50), _mm256_storeu_si256(acc + 11, a51);
  }

  // int32 sums -> fp32 (as int_mm's .float()), then the epilogue, to bf16 to nearest even.
  static void finish(const float* __restrict acc, int64_t rows, const Epilogue& e, uint16_t* __restrict out,
                     int64_t n) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kBlock; ++j) {
        int32_t sum;
        std::memcpy(&sum, acc + r * kBlock + j, sizeof(sum));
        float y = static_cast<float>(sum);
        if (e.col_scale) y = y * (e.row_scale[r] * e.col_scale[j]);
        if (e.bias) y = y + e.bias[j];
        out[r * n + j] = qs::Raw<c10::BFloat16>::put(y);
      }
  }
};

// 16 rows of the (N, K) int8 weight as Avx2Int16's tiles: 16 columns (8 pairs) of 8 rows at a time widened to int16,
// then an 8 x 8 transpose of their 32-bit pairs.
struct Int16PairTiles {
  const int8_t* q;
  int64_t k;
  static constexpr int64_t kAlign = 16;

  void operator()(int64_t b, int64_t k0, int64_t kc, __m256i* __restrict tile) const {
    for (int64_t c = k0; c < k0 + kc; c += 16) {
      const int64_t cols = std::min<int64_t>(16, k0 + kc - c);  // even
      for (int h = 0; h < 2; ++h) {
        __m256 v[8];
        for (int l = 0; l < 8; ++l) {
          const int8_t* src = q + (16 * b + 8 * h + l) * k + c;
          __m128i bytes;
          if (cols == 16) {
            bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
          } else {
            alignas(16) int8_t part[16] = {};
            std::memcpy(part, src, cols);
            bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
          }
          v[l] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(bytes));  // lane j: the pair (c + 2 j, c + 2 j + 1)
        }
        transpose8(v);  // v[j] lane l: row 8 h + l's pair j
        for (int64_t j = 0; j < cols / 2; ++j) tile[2 * ((c - k0) / 2 + j) + h] = _mm256_castps_si256(v[j]);
      }
    }
  }

  void prefetch(int64_t b, int64_t k0, int64_t kc) const {  // kc bytes of each of 16 rows
    for (int64_t r = 16 * b; r < 16 * (b + 1); ++r) {
      const char* p = reinterpret_cast<const char*>(q + r * k + k0);
      for (int64_t i = 0; i < kc; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
      _mm_prefetch(p + kc - 1, _MM_HINT_T1);
    }
  }
};

}  // namespace qs::gemm
