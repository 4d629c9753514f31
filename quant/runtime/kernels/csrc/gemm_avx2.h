// The tiled many-row products' AVX2 kernel (gemm_ops.cpp has the driver and the ops), for CPUs without AVX512-BF16,
// where a 16-bit GEMM is slower than fp32 (bench/RESULTS.md#cpu-kernels-per-linear-benchkernelspy): x widened to fp32 once per call, 16-row blocks of W
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
#include <type_traits>

#include "elements.h"
#include "gemm_common.h"
#include "int4_vec.h"

namespace qs::gemm {

// MR rows of x (row stride ldx, at the tile's first column) times a tile of kt columns, two accumulator vectors
// per row (a row's 16 sums) kept in acc (MR, 16): overwritten when `first`, else added to. K (the kernel) gives the
// vector type V, zero / load / store of acc's vector j, and step: kStep columns of one x row against the tile's two
// vectors there. Six rows are written out as named variables: GCC 12 kept an array of 12 accumulators in registers
// but also stored every one to the stack at every step (half the FMA rate); fewer rows (a chunk's last strip) take
// the array.
template <typename K, int MR>
void strips(const typename K::X* __restrict x, int64_t ldx, const typename K::Tile* __restrict tile, int64_t kt,
            bool first, float* __restrict acc) {
  using V = typename K::V;
  const auto init = [&](int j) { return first ? K::zero() : K::load(acc, j); };
  const int64_t steps = kt / K::kStep;
  if constexpr (MR == 6) {
    V a00 = init(0), a01 = init(1), a10 = init(2), a11 = init(3), a20 = init(4), a21 = init(5);
    V a30 = init(6), a31 = init(7), a40 = init(8), a41 = init(9), a50 = init(10), a51 = init(11);
    for (int64_t s = 0; s < steps; ++s) {
      const auto* w = tile + 2 * s;
      const auto* xs = x + K::kStep * s;
      K::step(xs, w, a00, a01), K::step(xs + ldx, w, a10, a11), K::step(xs + 2 * ldx, w, a20, a21);
      K::step(xs + 3 * ldx, w, a30, a31), K::step(xs + 4 * ldx, w, a40, a41), K::step(xs + 5 * ldx, w, a50, a51);
    }
    K::store(acc, 0, a00), K::store(acc, 1, a01), K::store(acc, 2, a10), K::store(acc, 3, a11);
    K::store(acc, 4, a20), K::store(acc, 5, a21), K::store(acc, 6, a30), K::store(acc, 7, a31);
    K::store(acc, 8, a40), K::store(acc, 9, a41), K::store(acc, 10, a50), K::store(acc, 11, a51);
  } else {
    V a[MR][2];
    for (int i = 0; i < MR; ++i) a[i][0] = init(2 * i), a[i][1] = init(2 * i + 1);
    for (int64_t s = 0; s < steps; ++s)
      for (int i = 0; i < MR; ++i) K::step(x + i * ldx + K::kStep * s, tile + 2 * s, a[i][0], a[i][1]);
    for (int i = 0; i < MR; ++i) K::store(acc, 2 * i, a[i][0]), K::store(acc, 2 * i + 1, a[i][1]);
  }
}

// 8 fp32 -> 8 bf16 bits (the low halves of the lanes), to nearest even and NaN as 0x7FC0, as c10 rounds.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// o[0 .. count) = y (+ bias) in T (count a multiple of 16): bf16 rounded as bf16_bits8, fp32 as it is, other types
// one at a time.
template <typename T>
inline void store_rows(T* __restrict o, const float* __restrict y, const float* __restrict bias, int64_t count) {
  for (int64_t h = 0; h < count; h += 16) {
    __m256 v[2];
    for (int j = 0; j < 2; ++j) {
      v[j] = _mm256_loadu_ps(y + h + 8 * j);
      if (bias) v[j] = _mm256_add_ps(v[j], _mm256_loadu_ps(bias + h + 8 * j));
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i packed = _mm256_packus_epi32(bf16_bits8(v[0]), bf16_bits8(v[1]));  // as finish16 orders them
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + h), _mm256_permute4x64_epi64(packed, 0xD8));
    } else if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(o + h, v[0]), _mm256_storeu_ps(o + h + 8, v[1]);
    } else {
      alignas(32) float t[16];
      _mm256_store_ps(t, v[0]), _mm256_store_ps(t + 8, v[1]);
      for (int i = 0; i < 16; ++i) o[h + i] = static_cast<T>(t[i]);
    }
  }
}

// (rows, 16) sums (fp32, or int32 by their bits: converted as int_mm's .float()) -> bf16 (Out uint16_t) or fp32
// (Out float) columns of out (row stride n) through the epilogue (its vectors at this block), two vectors a row.
template <bool kInt32, typename Out>
void finish16(const float* __restrict acc, int64_t rows, const Epilogue& e, Out* __restrict out, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    __m256 y[2];
    for (int h = 0; h < 2; ++h) {
      const float* a = acc + r * 16 + 8 * h;
      if constexpr (kInt32) {
        y[h] = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
      } else {
        y[h] = _mm256_loadu_ps(a);
      }
      if (e.col_scale) {
        const __m256 cs = _mm256_loadu_ps(e.col_scale + 8 * h);
        y[h] = _mm256_mul_ps(y[h], e.row_scale ? _mm256_mul_ps(_mm256_set1_ps(e.row_scale[r]), cs) : cs);
      }
      if (e.bias) y[h] = _mm256_add_ps(y[h], _mm256_loadu_ps(e.bias + 8 * h));
    }
    if constexpr (std::is_same_v<Out, float>) {
      _mm256_storeu_ps(out + r * n, y[0]), _mm256_storeu_ps(out + r * n + 8, y[1]);
      continue;
    }
    // packus: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7] (the bits are < 2^16); the permute puts the 64-bit quarters in order
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(y[0]), bf16_bits8(y[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n), _mm256_permute4x64_epi64(packed, 0xD8));
  }
}

struct Avx2 {
  static constexpr int64_t kBlock = 16;       // W rows per block: 2 vectors of 8 fp32 sums per x row
  static constexpr int64_t kColBytes = 64;    // a tile's bytes per K column (16 fp32)
  static constexpr int64_t kTileBytes = 16 << 10;  // L1: 32 KiB on most AVX2-only CPUs
  static constexpr int64_t kInt4Block = 32;   // the int4pack layout's blocks at this width (split nibbles)
  using Tile = __m256;
  using X = float;  // x widened once per call

  // One K step (a column) of one x row into a row's two accumulators.
  using V = __m256;
  static constexpr int64_t kStep = 1;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* acc, int j) { return _mm256_loadu_ps(acc + 8 * j); }
  static void store(float* acc, int j, V v) { _mm256_storeu_ps(acc + 8 * j, v); }
  static void step(const X* x, const Tile* w, V& lo, V& hi) {
    const V xb = _mm256_broadcast_ss(x);
    lo = _mm256_fmadd_ps(xb, w[0], lo);
    hi = _mm256_fmadd_ps(xb, w[1], hi);
  }

  template <int MR>
  static void strip(const X* x, int64_t ldx, int64_t k0, const Tile* tile, int64_t kt, bool first, float* acc) {
    strips<Avx2, MR>(x + k0, ldx, tile, kt, first, acc);
  }

  static void finish(const float* acc, int64_t rows, const Epilogue& e, uint16_t* out, int64_t n) {
    finish16<false>(acc, rows, e, out, n);
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
    __m256 s[2], off[2];
    int64_t loaded = -1;
    for (int64_t c = k0; c < k0 + kc; ++c) {
      const int64_t g = c / gs;
      if (g != loaded) {
        alignas(32) float sv[16], ov[16];
        group_scales(sz, g, n, b * 16, 16, sv, ov);
        for (int h = 0; h < 2; ++h) s[h] = _mm256_load_ps(sv + 8 * h), off[h] = _mm256_load_ps(ov + 8 * h);
        loaded = g;
      }
      __m256 q[2];  // as the dequantizer computes them (int4_vec.h)
      Int4Vec::half(blk + c * 16, shift, q);
      for (int h = 0; h < 2; ++h) tile[2 * (c - k0) + h] = Int4Vec::mul_add(q[h], s[h], off[h]);
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
    prefetch_rows(static_cast<const char*>(row.data()) + 16 * b * k * elem, 16, k * elem, k0 * elem, kc * elem);
  }
};

struct Int8Row {  // q - z, exact in fp32: the rows' scales multiply the sums instead (Epilogue::col_scale), so a
  // tile costs what the bf16 weights' widening does
  const int8_t* q;
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
    return zero ? _mm256_sub_ps(v, _mm256_set1_ps(static_cast<float>(zero[r]))) : v;
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

  // One K step (a pair of columns) of one x row into a row's two accumulators; the int32 sums are kept in the
  // driver's float buffer by their bits (intrinsic loads and stores may alias).
  using V = __m256i;
  static constexpr int64_t kStep = 2;
  static V zero() { return _mm256_setzero_si256(); }
  static V load(const float* acc, int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + j); }
  static void store(float* acc, int j, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + j, v); }
  static void step(const X* x, const Tile* w, V& lo, V& hi) {
    int32_t pair;  // (x[0], x[1]) in every lane
    std::memcpy(&pair, x, sizeof(pair));
    const V xb = _mm256_set1_epi32(pair);
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(xb, w[0]));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(xb, w[1]));
  }

  template <int MR>
  static void strip(const X* x, int64_t ldx, int64_t k0, const Tile* tile, int64_t kt, bool first, float* acc) {
    strips<Avx2Int16, MR>(x + k0, ldx, tile, kt, first, acc);
  }

  template <typename Out>  // bf16 bits (w8a8_gemm) or fp32 (int8_sums)
  static void finish(const float* acc, int64_t rows, const Epilogue& e, Out* out, int64_t n) {
    finish16<true>(acc, rows, e, out, n);
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

  void prefetch(int64_t b, int64_t k0, int64_t kc) const { prefetch_rows(q + 16 * b * k, 16, k, k0, kc); }
};

}  // namespace qs::gemm
