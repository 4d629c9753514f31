// int4 weights times int8 activations, for a few rows (batch-1 decode) on AVX2: llama.cpp's Q4 x Q8 trade, opt-in
// (quant/runtime/int4.py; loaded with the rows ops by quant/runtime/kernels/rows.py, held to its PyTorch reference in
// tests/test_rows.py). And the same pass on int16 activations with power-of-two block scales (int4_rows_a16, the
// `rows16` path of 16-bit rows: within 2^-14 of the exact product, see act_blocks.h).
//
// Why: the exact path (rows_ops.cpp int4_rows) turns every 4-bit code into an fp32 number and multiplies it by an
// fp32 activation, 8 products an instruction plus one byte shuffle for every 8 codes; that is its floor on AVX2. Here
// each x row is quantized first, symmetrically in blocks of 32 columns (d = max |x| / 127, q = x / d rounded half to
// even), and a byte multiply-add (vpmaddubsw: unsigned codes times signed activations, pairs summed into 16 bits)
// makes 32 products an instruction. The sums are exact integers; what changes the output is the activations'
// rounding, whose cost is measured and stated (bench/RESULTS.md).
//
// Layout: the AVX2 int4pack blocks (32 rows, split nibbles: byte i of column c holds row i low and row 16 + i high,
// 16 bytes a column). Two columns' 32 bytes become (column c, column c + 1) byte pairs per row by one cross-lane
// permute and one byte shuffle; the nibbles then pair with (x[c], x[c + 1]). A pair's product sum is at most
// 2 * 15 * 127 = 3810, so eight pairs (16 columns) add up in 16 bits without saturating before they are widened.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_blocks.h"
#include "balanced.h"
#include "elements.h"
#include "epilogue.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "gemm_avx2.h"  // qs::gemm::store_rows
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // activation columns per scale; weight rows per layout block

#if defined(QS_ACT_BLOCKS)
#define QS_INT4_A8 1
using qs::act::quantize_row;
using qs::act::quantize_row16;

// Eight consecutive rows' (scale, zero) pairs from the (N, 2) table at p, in fp32.
template <typename S>
inline void scales8(const S* p, __m256& s, __m256& z) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {  // a pair is one 32-bit lane: scale low, zero high
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<S, float>) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);  // s0 z0 .. s3 z3, s4 z4 .. s7 z7
    // shuffle: s0 s1 s4 s5 | s2 s3 s6 s7; the permute puts the 64-bit quarters in row order
    s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  } else {
    alignas(32) float a[8], b[8];
    for (int i = 0; i < 8; ++i) a[i] = qs::to_f(p[2 * i]), b[i] = qs::to_f(p[2 * i + 1]);
    s = _mm256_load_ps(a), z = _mm256_load_ps(b);
  }
}

// Bytes ahead of the codes being read that the passes prefetch, a line per 64 bytes read: a thread walks its blocks
// in one run of memory, and between decode steps every layer's codes have left the cache (~50 MB of them for the
// default model against a 32 MB L3). Measured with cold weights (2026-12-07, Zen 3, 2 threads, the four projection
// shapes of the default model, 30 layers' distinct weights in turn): 5-10% less time a call at 2-4 KiB, none past
// 16 KiB.
constexpr int64_t kPrefetch = 2048;

// Four consecutive rows' (scale, zero) pairs from the (N, 2) table at p, in fp32.
template <typename S>
inline void scales4(const S* p, __m128& s, __m128& z) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    s = _mm_castsi128_ps(_mm_slli_epi32(v, 16));
    z = _mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<S, float>) {
    const __m128 a = _mm_loadu_ps(p), b = _mm_loadu_ps(p + 4);  // s0 z0 s1 z1, s2 z2 s3 z3
    s = _mm_shuffle_ps(a, b, 0x88), z = _mm_shuffle_ps(a, b, 0xDD);
  } else {
    alignas(16) float a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = qs::to_f(p[2 * i]), b[i] = qs::to_f(p[2 * i + 1]);
    s = _mm_load_ps(a), z = _mm_load_ps(b);
  }
}

// y (MR, 32) = one layout block (32 rows) times MR quantized rows (xq, d, gsum: each row's, as quantize_row gives
// them): per group s sum_b d_b (q . xq) + (z - 8 s) gsum. The rows share each decoded pair of columns.
template <int MR, typename S>
void int4_block_a8(const int8_t* const* xq, const float* const* d, const float* const* gsum,
                   const uint8_t* __restrict blk, int64_t k, int64_t gs, const S* __restrict sz, int64_t n,
                   float* __restrict y) {
  const __m256i m0f = _mm256_set1_epi8(0x0F);
  const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  __m256 acc[MR][4], off[MR][4];  // row r's rows 8 i .. 8 i + 7
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = off[r][i] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < k; g0 += gs) {
    __m256 part[MR][4];  // the group's sum_b d_b (q . xq)
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < 4; ++i) part[r][i] = _mm256_setzero_ps();
    for (int64_t b0 = g0; b0 < g0 + gs; b0 += kBlock) {
      __m256i whole[MR][4];  // the block's int32 sums
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < 4; ++i) whole[r][i] = _mm256_setzero_si256();
      for (int64_t c0 = b0; c0 < b0 + kBlock; c0 += 16) {
        __m256i lo[MR], hi[MR];  // rows 0-15, 16-31: 16-bit sums
        for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int64_t c = c0; c < c0 + 16; c += 2) {
          if ((c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + c * 16 + kPrefetch), _MM_HINT_T0);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 16));
          const __m256i t = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(w, 0xD8), pairs);  // (c, c + 1) per row
          const __m256i wl = _mm256_and_si256(t, m0f), wh = _mm256_and_si256(_mm256_srli_epi16(t, 4), m0f);
          for (int r = 0; r < MR; ++r) {
            int16_t pair;
            std::memcpy(&pair, xq[r] + c, sizeof(pair));
            const __m256i xp = _mm256_set1_epi16(pair);
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, xp));
            hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, xp));
          }
        }
        for (int r = 0; r < MR; ++r) {
          whole[r][0] = _mm256_add_epi32(whole[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[r])));
          whole[r][1] = _mm256_add_epi32(whole[r][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[r], 1)));
          whole[r][2] = _mm256_add_epi32(whole[r][2], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[r])));
          whole[r][3] = _mm256_add_epi32(whole[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[r], 1)));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 db = _mm256_set1_ps(d[r][b0 / kBlock]);
        for (int i = 0; i < 4; ++i) part[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole[r][i]), db, part[r][i]);
      }
    }
    const S* zg = sz + (g0 / gs) * n * 2;
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) {
      __m256 s, z;
      scales8(zg + 16 * i, s, z);
      const __m256 o = _mm256_fnmadd_ps(s, eight, z);
      for (int r = 0; r < MR; ++r) {
        acc[r][i] = _mm256_fmadd_ps(part[r][i], s, acc[r][i]);
        off[r][i] = _mm256_fmadd_ps(o, _mm256_set1_ps(gsum[r][g0 / gs]), off[r][i]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 32 * r + 8 * i, _mm256_add_ps(acc[r][i], off[r][i]));
}

// The layout rows in int4_block_a16's accumulator i: lanes 0-3 rows kLanes16[i][0].., lanes 4-7 rows kLanes16[i][1]..
constexpr int kLanes16[4][2] = {{0, 8}, {4, 12}, {16, 24}, {20, 28}};

// int4_block_a8 on int16 activations (quantize_row16): each column pair's 32 rows of codes widened to 16-bit pairs
// (row i, then row 16 + i from the high nibbles), times the (x[c], x[c + 1]) pair by vpmaddwd into exact 32-bit sums
// (a block's at most 32 * 15 * 32767 < 2^24, so its conversion to fp32 is exact too, and d_b a power of two).
template <int MR, typename S>
void int4_block_a16(const int16_t* const* xq, const float* const* d, const float* const* gsum,
                    const uint8_t* __restrict blk, int64_t k, int64_t gs, const S* __restrict sz, int64_t n,
                    float* __restrict y) {
  const __m256i m0f = _mm256_set1_epi32(0x000F000F);
  // per 32-bit lane (column c's byte, 0, column c + 1's byte, 0) of one row: lane 0 rows 0-3, lane 1 rows 8-11 (a),
  // rows 4-7 and 12-15 (b) of the permuted pair of columns
  const __m256i ia = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,
                                      0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1);
  const __m256i ib = _mm256_setr_epi8(4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1,
                                      4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
  __m256 acc[MR][4], off[MR][4];  // row r's rows (0-3, 8-11), (4-7, 12-15), (16-19, 24-27), (20-23, 28-31)
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = off[r][i] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < k; g0 += gs) {
    __m256 part[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < 4; ++i) part[r][i] = _mm256_setzero_ps();
    for (int64_t b0 = g0; b0 < g0 + gs; b0 += kBlock) {
      __m256i whole[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < 4; ++i) whole[r][i] = _mm256_setzero_si256();
      for (int64_t c = b0; c < b0 + kBlock; c += 2) {
        if ((c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + c * 16 + kPrefetch), _MM_HINT_T0);
        const __m256i w = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 16)),
                                                   0xD8);
        const __m256i ta = _mm256_shuffle_epi8(w, ia), tb = _mm256_shuffle_epi8(w, ib);
        // a 16-bit lane holds one code byte over a zero byte: its high nibble needs only the shift
        const __m256i q0 = _mm256_and_si256(ta, m0f), q1 = _mm256_and_si256(tb, m0f);
        const __m256i q2 = _mm256_srli_epi16(ta, 4), q3 = _mm256_srli_epi16(tb, 4);
        for (int r = 0; r < MR; ++r) {
          int32_t pair;
          std::memcpy(&pair, xq[r] + c, sizeof(pair));
          const __m256i xp = _mm256_set1_epi32(pair);
          whole[r][0] = _mm256_add_epi32(whole[r][0], _mm256_madd_epi16(q0, xp));
          whole[r][1] = _mm256_add_epi32(whole[r][1], _mm256_madd_epi16(q1, xp));
          whole[r][2] = _mm256_add_epi32(whole[r][2], _mm256_madd_epi16(q2, xp));
          whole[r][3] = _mm256_add_epi32(whole[r][3], _mm256_madd_epi16(q3, xp));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 db = _mm256_set1_ps(d[r][b0 / kBlock]);
        for (int i = 0; i < 4; ++i) part[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole[r][i]), db, part[r][i]);
      }
    }
    const S* zg = sz + (g0 / gs) * n * 2;
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) {  // the rows of accumulator i, in the table's order
      __m128 s0, z0, s1, z1;
      scales4(zg + 2 * kLanes16[i][0], s0, z0);
      scales4(zg + 2 * kLanes16[i][1], s1, z1);
      const __m256 s = _mm256_set_m128(s1, s0), z = _mm256_set_m128(z1, z0);
      const __m256 o = _mm256_fnmadd_ps(s, eight, z);
      for (int r = 0; r < MR; ++r) {
        acc[r][i] = _mm256_fmadd_ps(part[r][i], s, acc[r][i]);
        off[r][i] = _mm256_fmadd_ps(o, _mm256_set1_ps(gsum[r][g0 / gs]), off[r][i]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_add_ps(acc[r][i], off[r][i]);
      _mm_storeu_ps(y + 32 * r + kLanes16[i][0], _mm256_castps256_ps128(v));
      _mm_storeu_ps(y + 32 * r + kLanes16[i][1], _mm256_extractf128_ps(v, 1));
    }
}
#endif

// out (M, N) = x (M, K, the kernel's column order), quantized per row in blocks of 32 columns (A16: to int16 by
// quantize_row16, else to int8 by quantize_row with qmax and min_scale), @ W^T (+ bias), W the AVX2 int4pack layout
// (32-row blocks, split nibbles; N a multiple of 32) and its (G, N, 2) scale/zero table; in fp32, rounded once to x's
// dtype. A row that is not finite gives NaN, as the reference does.
template <bool A16>
at::Tensor int4_rows_q(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
                       int64_t group_size, const at::Tensor& bias, double qmax, double min_scale) {
#if defined(QS_INT4_A8)
  TORCH_CHECK(A16 || (qmax > 0 && qmax <= 127),
              "qmax must be in (0, 127]: a pair's sum must fit 16 bits eight times over");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == k,
              "x must be a contiguous CPU (M, K) tensor");
  TORCH_CHECK(n % kBlock == 0 && k % kBlock == 0, "N and K must be multiples of 32");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == n * k / 2,
              "packed must be a contiguous CPU uint8 tensor of N * K / 2 bytes");
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 dividing K");
  const int64_t G = k / group_size, m = x.size(0);
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == G && sz.size(1) == n && sz.size(2) == 2 && sz.is_contiguous(),
              "scales_zeros must be a contiguous (K / group_size, N, 2) tensor");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n && bias.is_contiguous()),
              "bias must be empty or a contiguous (N,) fp32 tensor");
  using Q = std::conditional_t<A16, int16_t, int8_t>;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  std::vector<Q> xq(m * k);
  std::vector<float> d(m * (k / kBlock)), gsum(m * G), xf(k);
  std::vector<char> finite(m);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_rows_q", [&] {
    using T = scalar_t;
    const T* xr = x.data_ptr<T>();
    const float qm = static_cast<float>(qmax), floor_ = static_cast<float>(min_scale);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) xf[c] = static_cast<float>(xr[r * k + c]);
      Q* qr = xq.data() + r * k;
      float *dr = d.data() + r * (k / kBlock), *gr = gsum.data() + r * G;
      if constexpr (A16)
        finite[r] = quantize_row16(xf.data(), k, group_size, qr, dr, gr);
      else
        finite[r] = quantize_row(xf.data(), k, group_size, qm, floor_, qr, dr, gr);
    }
    T* o = out.data_ptr<T>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4_rows_q_table", [&] {
      const scalar_t* zp = sz.data_ptr<scalar_t>();
      const uint8_t* pp = packed.data_ptr<uint8_t>();
      const int64_t blocks = n / kBlock;
      qs::balanced_for(blocks, std::max<int64_t>(1, (1 << 16) / (kBlock * k * m)), [&](int64_t b, int64_t e) {
        float y[4 * kBlock];
        for (int64_t i = b; i < e; ++i) {
          const int64_t r0 = i * kBlock;
          const uint8_t* blk = pp + r0 * k / 2;
          for (int64_t r = 0; r < m; r += 4) {  // up to four rows share each decoded pair of columns
            const int64_t mr = std::min<int64_t>(4, m - r);
            const Q* xs[4];
            const float *ds[4], *gss[4];
            for (int64_t j = 0; j < mr; ++j)
              xs[j] = xq.data() + (r + j) * k, ds[j] = d.data() + (r + j) * (k / kBlock), gss[j] = gsum.data() + (r + j) * G;
            const scalar_t* zr = zp + r0 * 2;
            if constexpr (A16) {
              switch (mr) {
                case 4: int4_block_a16<4>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                case 3: int4_block_a16<3>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                case 2: int4_block_a16<2>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                default: int4_block_a16<1>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
              }
            } else {
              switch (mr) {
                case 4: int4_block_a8<4>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                case 3: int4_block_a8<3>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                case 2: int4_block_a8<2>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
                default: int4_block_a8<1>(xs, ds, gss, blk, k, group_size, zr, n, y); break;
              }
            }
            for (int64_t j = 0; j < mr; ++j) {
              float* yr = y + j * kBlock;
              if (!finite[r + j]) std::fill(yr, yr + kBlock, std::numeric_limits<float>::quiet_NaN());
              qs::gemm::store_rows(o + (r + j) * n + r0, yr, bp ? bp + r0 : nullptr, kBlock);
            }
          }
        }
      });
    });
  });
  return out;
#else
  TORCH_CHECK(false, "int4_rows_a8 and int4_rows_a16 are built only for CPUs with AVX2 and without AVX-512");
#endif
}

at::Tensor int4_rows_a8(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
                        int64_t group_size, const at::Tensor& bias, double qmax, double min_scale) {
  return int4_rows_q<false>(x, packed, n, k, sz, group_size, bias, qmax, min_scale);
}

at::Tensor int4_rows_a16(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
                         int64_t group_size, const at::Tensor& bias) {
  return int4_rows_q<true>(x, packed, n, k, sz, group_size, bias, 0.0, 0.0);
}

QS_EPILOGUES(int4_rows_a8,
             (const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
              int64_t group_size, const at::Tensor& bias, double qmax, double min_scale),
             (x, packed, n, k, sz, group_size, bias, qmax, min_scale))
QS_EPILOGUES(int4_rows_a16,
             (const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
              int64_t group_size, const at::Tensor& bias),
             (x, packed, n, k, sz, group_size, bias))

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantserve_rows, m) {
  for (const std::string& product :
       {std::string("int4_rows_a8(Tensor x, Tensor packed, int n, int k, Tensor scales_zeros, int group_size, "
                    "Tensor bias, float qmax, float min_scale) -> Tensor"),
        std::string("int4_rows_a16(Tensor x, Tensor packed, int n, int k, Tensor scales_zeros, int group_size, "
                    "Tensor bias) -> Tensor")}) {
    m.def(product.c_str());
    m.def(qs::epilogue_schema(product, "gated").c_str());
    m.def(qs::epilogue_schema(product, "normed").c_str());
  }
}

TORCH_LIBRARY_IMPL(quantserve_rows, CPU, m) {
  m.impl("int4_rows_a8", &int4_rows_a8);
  m.impl("int4_rows_a16", &int4_rows_a16);
  m.impl("int4_rows_a8_gated", &int4_rows_a8_gated);
  m.impl("int4_rows_a8_normed", &int4_rows_a8_normed);
  m.impl("int4_rows_a16_gated", &int4_rows_a16_gated);
  m.impl("int4_rows_a16_normed", &int4_rows_a16_normed);
}
