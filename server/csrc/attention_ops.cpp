// The sdpa backend's CPU attention kernels (server/attention/sdpa.py), reading K/V through a request's block table
// in place: decode rows (one query each) and prefill chunks (causal over the request's past plus the chunk). One
// library with the glue ops of decode_ops.cpp (server/fastops.py loads both and holds each op to its PyTorch
// reference there).
//
// Scores, softmax and weighted sums run in fp32; outputs are rounded once to q's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "balanced.h"
#include "elements.h"
#include "kv_rows.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using qs::Raw;
using qs::exp_approx;
using qs::raw;
using qs::to_f;

namespace {

constexpr int64_t kAhead = 8;   // keys ahead that attend_keys prefetches
constexpr int64_t kTile = 8;    // keys whose scores attend_keys computes together
constexpr int64_t kSpan = 64;   // keys attend_keys stages at once (their scores and values in fp32)
constexpr int64_t kParts = 4;   // work items a decode row's KV head is cut into, at most (decode_impl)

using qs::V8;
using qs::load8;
using qs::store8;
inline V8 v8fma(V8 a, V8 b, V8 c) {  // a * b + c in one rounding (the library is built with -ffp-contract=off)
#if defined(__FMA__)
  return (V8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline float v8sum(V8 v) {  // lanes l and l + 4 first, then a fixed tree
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
// Lane t = the sum of a[t]'s eight lanes, in a fixed tree (AVX: pairwise horizontal adds, then the two halves).
inline V8 sum8x8(const V8* a) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (V8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  V8 r;
  for (int t = 0; t < 8; ++t) r[t] = v8sum(a[t]);
  return r;
#endif
}

// The scores of the g query heads qf (g, D) against kTile staged key rows kt (kTile, D), D a multiple of 8, into
// s[i * n + t] for head i: a key's dot product in eight lanes, the tile's keys in independent accumulators (one chain
// of D / 8 FMAs per key instead of one latency-bound chain per dot product), the tile's eight sums reduced together
// (sum8x8). `nt` keys are real; the rest of the tile is padding whose scores are not written.
inline void tile_scores(const float* __restrict qf, const float* __restrict kt, int64_t g, int64_t D, int64_t nt,
                        float scale, float cap, float* __restrict s, int64_t n) {
  for (int64_t i = 0; i < g; ++i) {
    V8 acc[kTile];
    for (int64_t t = 0; t < kTile; ++t) acc[t] = V8{};
    for (int64_t d = 0; d < D; d += 8) {
      const V8 qv = load8(qf + i * D + d);
      for (int64_t t = 0; t < kTile; ++t) acc[t] = v8fma(qv, load8(kt + t * D + d), acc[t]);
    }
    V8 x = sum8x8(acc) * scale;
    if (cap > 0.f)
      for (int64_t t = 0; t < nt; ++t) x[t] = qs::softcap(x[t], cap);
    if (nt == kTile) {
      store8(s + i * n, x);
    } else {
      for (int64_t t = 0; t < nt; ++t) s[i * n + t] = x[t];
    }
  }
}

// The part of one decode row's attention that keys [j0, j1) of one KV head give its g query heads qf (g, D) fp32
// (rotated where the keys are stored rotated): per head i the scores' maximum m[i], the sum l[i] of exp(score -
// m[i]) and the weighted sum acc (g, D) of the values by those exponentials, unnormalised (merge_parts joins a
// row's parts). Keys are read through the block table, rows: this head's K and V, read as qs::FloatRows or
// dequantized as qs::QuantRows, kSpan keys at a time with an online softmax across the spans (the running maximum
// rescaling what came before). Each K and V row is read once: K rows staged kTile at a time for tile_scores (where
// D is a multiple of 8; otherwise one key and one dot product at a time), V rows staged as fp32 for the weighted
// sums, which hold 64 channels in registers over the span's keys (qs::weighted_sum). Out of the dispatch lambda and
// with raw pointers so that its loops vectorise.
template <typename Rows>
__attribute__((noinline)) void attend_keys(const float* __restrict qf, const Rows& rows, const int64_t* table,
                                           int64_t bs, int64_t j0, int64_t j1, int64_t g, int64_t D, float scale,
                                           float cap, float* __restrict acc, float* __restrict m,
                                           float* __restrict l, std::vector<float>& work) {
  const bool tiled = D % 8 == 0;
  work.resize(kTile * D + g * kSpan + kSpan * D);
  float* __restrict row = work.data();        // (kTile, D): staged key rows
  float* __restrict s = row + kTile * D;      // (g, kSpan) a span's scores, then exponentials
  float* __restrict V = s + g * kSpan;        // (kSpan, D) its staged value rows
  // Positions are walked block by block (an integer division per key cost more than its dot products).
  int64_t blk = j0 / bs, off = j0 % bs;
  // A second cursor kAhead positions on prefetches that position's K and V rows. Between two decode steps a
  // layer's cache has been evicted by the weights streaming through; without it, each row's cache misses
  // were paid one after another.
  int64_t pblk = blk, poff = off;
  const auto prefetch_next = [&]() {
    rows.prefetch(table[pblk] * bs + poff, D);
    if (++poff == bs) poff = 0, ++pblk;
  };
  for (int64_t j = 0; j < std::min(j1 - j0, kAhead); ++j) prefetch_next();
  if (tiled) std::fill(row, row + kTile * D, 0.f);  // a short first tile's padding reads zeros (later ones, the tile before)
  std::fill(acc, acc + g * D, 0.f);
  for (int64_t a = j0; a < j1; a += kSpan) {
    const int64_t n = std::min(kSpan, j1 - a);
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t nt = std::min(kTile, n - t0);
      for (int64_t t = 0; t < nt; ++t, ++off == bs ? (off = 0, ++blk) : 0) {
        if (a + t0 + t + kAhead < j1) prefetch_next();
        const int64_t slot = table[blk] * bs + off;
        float* kr = row + (tiled ? t * D : 0);
        rows.load_k(slot, kr, D);
        rows.load_v(slot, V + (t0 + t) * D, D);
        if (!tiled) {
          for (int64_t i = 0; i < g; ++i) {
            float dot = 0.f;
            _Pragma("omp simd reduction(+ : dot)")
            for (int64_t d = 0; d < D; ++d) dot += qf[i * D + d] * kr[d];
            float x = dot * scale;
            if (cap > 0.f) x = qs::softcap(x, cap);
            s[i * kSpan + t0 + t] = x;
          }
        }
      }
      if (tiled) tile_scores(qf, row, g, D, nt, scale, cap, s + t0, kSpan);
    }
    for (int64_t i = 0; i < g; ++i) {
      float* si = s + i * kSpan;
      float mx = si[0];
      for (int64_t j = 1; j < n; ++j) mx = si[j] > mx ? si[j] : mx;
      if (a > j0) mx = std::max(mx, m[i]);
      const float alpha = a > j0 ? exp_approx(m[i] - mx) : 0.f;  // what the spans before are worth now
      float sum = 0.f;
      _Pragma("omp simd reduction(+ : sum)")
      for (int64_t j = 0; j < n; ++j) {
        si[j] = exp_approx(si[j] - mx);
        sum += si[j];
      }
      m[i] = mx, l[i] = (a > j0 ? l[i] * alpha : 0.f) + sum;
      float* __restrict ai = acc + i * D;
      if (tiled) {
        qs::weighted_sum(ai, alpha, si, V, 0, n, D);
      } else {
        for (int64_t d = 0; d < D; ++d) {
          float x = ai[d] * alpha;
          for (int64_t j = 0; j < n; ++j) x += si[j] * V[j * D + d];
          ai[d] = x;
        }
      }
    }
  }
}

// A decode row's output o (g, D) for one KV head from its C parts (attend_keys; each acc (g, D), then m (g), then
// l (g), `stride` floats apart): o = sum_c w_c acc_c / sum_c w_c l_c with w_c = exp(m_c - max_c m_c), in part
// order; rotated back where the values are stored rotated; rounded once to o's type.
template <typename T>
void merge_parts(const float* parts, int64_t stride, int64_t C, int64_t g, int64_t D, int64_t value_block,
                 typename Raw<T>::type* __restrict o, float* __restrict out) {
  for (int64_t i = 0; i < g; ++i) {
    float mx = parts[g * D + i];
    for (int64_t c = 1; c < C; ++c) mx = std::max(mx, parts[c * stride + g * D + i]);
    std::fill(out, out + D, 0.f);
    float total = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const float* p = parts + c * stride;
      const float w = C == 1 ? 1.f : exp_approx(p[g * D + i] - mx);
      total += w * p[g * D + g + i];
      for (int64_t d = 0; d < D; ++d) out[d] += w * p[i * D + d];
    }
    const float r = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) out[d] *= r;
    if (value_block > 0) qs::hadamard_blocks(out, D, value_block);  // values stored rotated: rotate back
    for (int64_t d = 0; d < D; ++d) o[i * D + d] = Raw<T>::put(out[d]);
  }
}

// q (rows, H, D) with contiguous heads and one layer's cache kv (2, slots, Hkv, D), contiguous, with H a multiple
// of Hkv: of q's dtype, or (scales given) int8 or float8_e4m3fn codes with scales (2, slots, Hkv) float16.
void check_q_kv(const at::Tensor& q, const at::Tensor& kv, const at::Tensor* scales, int64_t key_block,
                int64_t value_block, const char* q_shape) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be a CPU ",
              q_shape, " tensor with contiguous heads");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous (2, slots, Hkv, D) tensor");
  if (scales == nullptr) {
    TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "kv must be of q's dtype");
  } else {
    TORCH_CHECK(kv.scalar_type() == at::kChar || kv.scalar_type() == at::kFloat8_e4m3fn,
                "quantized kv must hold int8 or float8_e4m3fn codes");
    TORCH_CHECK(scales->dim() == 3 && scales->is_contiguous() && scales->scalar_type() == at::kHalf &&
                    scales->size(0) == 2 && scales->size(1) == kv.size(1) && scales->size(2) == kv.size(2),
                "scales must be a contiguous (2, slots, Hkv) float16 tensor matching kv");
    TORCH_CHECK(qs::valid_rotation(key_block, kv.size(3)),
                "key_block must be 0 or a power of two >= 2 dividing head_dim, got ", key_block);
    TORCH_CHECK(qs::valid_rotation(value_block, kv.size(3)),
                "value_block must be 0 or a power of two >= 2 dividing head_dim, got ", value_block);
  }
  TORCH_CHECK(kv.size(3) == q.size(2) && kv.size(2) > 0 && q.size(1) % kv.size(2) == 0,
              "q's heads must be a multiple of kv's, with one head_dim");
}

// Calls f(scalar_t{}, rows) with q's element type and the layer cache's rows (head 0): float, or int8 / fp8 codes
// with their scales.
template <typename F>
void dispatch_rows(const at::Tensor& q, const at::Tensor& kv, const at::Tensor* scales, int64_t key_block,
                   int64_t value_block, F&& f) {
  const int64_t S = kv.size(1), Hkv = kv.size(2), D = kv.size(3), half = S * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention", [&] {
    if (scales == nullptr) {
      const auto* k = raw(kv.data_ptr<scalar_t>());
      f(scalar_t{}, qs::FloatRows<scalar_t>{k, k + half, Hkv * D});
      return;
    }
    const auto* sc = scales->data_ptr<c10::Half>();
    if (kv.scalar_type() == at::kChar) {
      const auto* k = kv.data_ptr<int8_t>();
      f(scalar_t{},
        qs::QuantRows<qs::Int8Code>{k, k + half, sc, sc + S * Hkv, Hkv * D, Hkv, key_block, value_block});
    } else {
      const auto* k = reinterpret_cast<const uint8_t*>(kv.data_ptr());
      f(scalar_t{},
        qs::QuantRows<qs::Fp8Code>{k, k + half, sc, sc + S * Hkv, Hkv * D, Hkv, key_block, value_block});
    }
  });
}

// A decode row's keys [lo, L) are cut into C = min(kParts, ceil(n / kSpan)) chunks of near-equal size (chunk c from
// lo + n c / C), a function of n alone, so that a row's output does not depend on its batch or the threads. Work
// items are (row, KV head, chunk): a short context's few KV heads still spread over the threads, and a long one's
// keys too. The parts of rows cut into chunks are kept in fp32 until merged: at most kParts (g D + 2 g) floats per
// KV head of a row (quant/shape/memory.py's decode_attention_scratch counts them).
at::Tensor decode_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor* scales, int64_t key_block,
                       int64_t value_block, const at::Tensor& block_table, const at::Tensor& lens,
                       int64_t block_size, int64_t window, double scale, double softcap) {
  check_q_kv(q, kv, scales, key_block, value_block, "(B, H, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = kv.size(1), Hkv = kv.size(2);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B && block_table.is_contiguous() &&
                  block_table.scalar_type() == at::kLong,
              "block_table must be a contiguous (B, blocks) int64 tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.is_contiguous() && lens.scalar_type() == at::kLong,
              "lens must be a contiguous (B,) int64 tensor");
  TORCH_CHECK(block_size > 0 && S % block_size == 0, "the cache's slots must be whole blocks");
  const int64_t NB = block_table.size(1), nblocks = S / block_size, g = H / Hkv;
  const int64_t* tp = block_table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> first(B + 1, 0), chunks(B), lows(B);  // row b's items are [first[b], first[b + 1])
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {  // every block a row reads is checked before anything is read
    TORCH_CHECK(lp[b] > 0 && lp[b] <= NB * block_size, "lens[", b, "] = ", lp[b], " is outside its block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * NB + i] >= 0 && tp[b * NB + i] < nblocks, "block ", tp[b * NB + i], " is outside the cache");
    lows[b] = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;
    chunks[b] = std::min(kParts, (lp[b] - lows[b] + kSpan - 1) / kSpan);
    first[b + 1] = first[b] + Hkv * chunks[b];
    keys += Hkv * (lp[b] - lows[b]);
  }
  const int64_t items = first[B], stride = g * D + 2 * g;  // a part: acc (g, D), m (g), l (g)
  const bool split = std::any_of(chunks.begin(), chunks.end(), [](int64_t c) { return c > 1; });
  // Every item's part where some row is split: at most kParts per KV head of a row (decode_attention_scratch).
  at::Tensor parts = at::empty({split ? items * stride : 0}, q.options().dtype(at::kFloat));
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float sc = to_f(scale), cap = to_f(softcap);
  dispatch_rows(q, kv, scales, key_block, value_block, [&](auto tag, const auto& rows) {
    using scalar_t = decltype(tag);
    const auto* qp = raw(q.data_ptr<scalar_t>());
    auto* op = raw(out.data_ptr<scalar_t>());
    const int64_t qstride = q.stride(0);
    // A thread takes at least ~16K multiply-adds of scores (and as many of weighted sums), so that a short
    // batch-1 step stays on one thread rather than paying for waking another.
    const int64_t grain = std::max<int64_t>(1, items * 16384 / std::max<int64_t>(1, keys * g * D));
    qs::balanced_for(items, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> work, qf, own;
      qf.resize(g * D + D);
      own.resize(stride);
      for (int64_t it = begin; it < end; ++it) {
        const int64_t b = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
        const int64_t C = chunks[b], h = (it - first[b]) / C, c = (it - first[b]) % C;
        const int64_t lo = lows[b], n = lp[b] - lo;
        const auto* src = qp + b * qstride + h * g * D;
        for (int64_t e = 0; e < g * D; ++e) qf[e] = Raw<scalar_t>::get(src[e]);
        if (rows.key_block > 0)  // keys are stored rotated: rotate q to match
          for (int64_t i = 0; i < g; ++i) qs::hadamard_blocks(qf.data() + i * D, D, rows.key_block);
        float* part = C > 1 ? parts.data_ptr<float>() + it * stride : own.data();
        attend_keys(qf.data(), rows.at_head(h, D), tp + b * NB, block_size, lo + n * c / C, lo + n * (c + 1) / C, g,
                    D, sc, cap, part, part + g * D, part + g * D + g, work);
        if (C == 1) merge_parts<scalar_t>(part, stride, 1, g, D, rows.value_block, op + (b * H + h * g) * D,
                                          qf.data() + g * D);
      }
    });
    std::vector<int64_t> joined;  // (row, KV head) of rows cut into chunks: their parts merged
    int64_t merged = 0;
    for (int64_t b = 0; b < B; ++b)
      if (chunks[b] > 1)
        for (int64_t h = 0; h < Hkv; ++h) joined.push_back(b * Hkv + h), merged += chunks[b];
    if (joined.empty()) return;
    const int64_t n = static_cast<int64_t>(joined.size());
    at::parallel_for(0, n, std::max<int64_t>(1, n * 65536 / (merged * g * D)), [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = joined[i] / Hkv, h = joined[i] % Hkv;
        merge_parts<scalar_t>(parts.data_ptr<float>() + (first[b] + h * chunks[b]) * stride, stride, chunks[b], g, D,
                              rows.value_block, op + (b * H + h * g) * D, tmp.data());
      }
    });
  });
  return out;
}

}  // namespace

// Attention of decode rows (one query each) over the paged cache, for the sdpa backend's decode rows: one
// call per layer instead of a gather, a mask and an SDPA call, whose fixed cost (~40 us) was a sixth of a
// batch-1 step of the default model.
// q (B, H, D): heads contiguous, rows may be strided (q is a slice of the fused qkv output). kv (2, slots, Hkv,
// D): one layer's cache, contiguous; position p of request b is in slot block_table[b][p / bs] * bs + p % bs.
// lens (B,): request b attends to its keys at positions [lo, lens[b]), lo = max(0, lens[b] - window) with a
// window (window <= 0: none). softcap > 0: scores -> softcap * tanh(scores / softcap). Scores, softmax and the
// weighted sum run in fp32 and the output is rounded once to q's dtype. The g = H / Hkv query heads of a KV
// head share each K/V row read (GQA without repeating K/V).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                            const at::Tensor& lens, int64_t block_size, int64_t window, double scale,
                            double softcap) {
  return decode_impl(q, kv, nullptr, 0, 0, block_table, lens, block_size, window, scale, softcap);
}

// decode_attention over a quantized cache: kv holds int8 or float8_e4m3fn codes, scales (2, slots, Hkv) their
// float16 scale per token per KV head; each row is dequantized as it is loaded (qs::QuantRows). key_block > 0: the
// keys were stored rotated in blocks of that many channels (store_kv_quant), and each query is rotated to match;
// value_block > 0: the values were, and each output row is rotated back.
at::Tensor decode_attention_quant(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& scales,
                                  const at::Tensor& block_table, const at::Tensor& lens, int64_t block_size,
                                  int64_t window, double scale, double softcap, int64_t key_block,
                                  int64_t value_block) {
  return decode_impl(q, kv, &scales, key_block, value_block, block_table, lens, block_size, window, scale, softcap);
}

// The other sources' ops this one composes (decode_ops.cpp, kv_cache_ops.cpp).
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv, const at::Tensor& slots);
void store_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor codes, at::Tensor scales,
                    const at::Tensor& slots, int64_t key_block, int64_t value_block);

// A decode step's attention of one layer in one call, from the fused qkv projection's output (B, (H + 2 Hkv) D):
// rope_ on its q and k in place, k and v stored to their slots (store_kv, or store_kv_quant where scales are
// given), and decode_attention (decode_attention_quant) of q; returns (B, H * D). The same functions in the same
// order as the sdpa backend's separate calls, so the same bits: what it saves is the dozen small calls around them.
at::Tensor rotary_decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv,
                                   const std::optional<at::Tensor>& scales, const at::Tensor& slots,
                                   const at::Tensor& block_table, const at::Tensor& lens, int64_t heads,
                                   int64_t block_size, int64_t window, double scale, double softcap,
                                   int64_t key_block, int64_t value_block) {
  TORCH_CHECK(kv.dim() == 4, "kv must be a (2, slots, Hkv, D) tensor");
  const int64_t Hkv = kv.size(2), D = kv.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && qkv.size(1) == (heads + 2 * Hkv) * D,
              "qkv must be (B, (heads + 2 Hkv) D) with contiguous rows of the cache's heads and head_dim");
  const int64_t B = qkv.size(0);
  at::Tensor q = qkv.narrow(1, 0, heads * D).view({B, heads, D});
  at::Tensor k = qkv.narrow(1, heads * D, Hkv * D).view({B, Hkv, D});
  at::Tensor v = qkv.narrow(1, (heads + Hkv) * D, Hkv * D).view({B, Hkv, D});
  rope_(q, k, cos, sin);
  at::Tensor out;
  if (scales.has_value()) {
    store_kv_quant(k, v, kv, *scales, slots, key_block, value_block);
    out = decode_impl(q, kv, &*scales, key_block, value_block, block_table, lens, block_size, window, scale, softcap);
  } else {
    store_kv(k, v, kv, slots);
    out = decode_impl(q, kv, nullptr, 0, 0, block_table, lens, block_size, window, scale, softcap);
  }
  return out.view({B, heads * D});
}

// ------------------------------------------------------------------------------------------- prefill chunks
//
// A prefill chunk's C queries against the request's keys at positions [0, start + C), causal (query i sits at
// position start + i), flash-style: key tiles of kKeys keys are read from the paged cache once per work item and
// staged for the products, and each tile's scores, online-softmax update and weighted sum are done before the
// next, so no (C, keys) score matrix and no gathered copy of the cache ever exist. A work item is one KV head and a
// run of query positions, with the g query heads of that KV head among its rows (GQA without repeating K/V).
//
// The scores are computed transposed, S^T = K Q^T (keys, rows), with the item's rows along the vectors: the softmax
// then runs down each column, a vector of rows at a time (maxima and sums lane-wise, no horizontal reductions),
// and K needs no transpose. Both products are register-blocked rank-1 updates, C (MR rows, NV vectors) += a
// broadcast element of A x a row of B, 24 accumulators on AVX-512 and 12 on AVX2. With AVX512-BF16 and a bf16
// model, each step is a pair of bf16 products (vdpbf16ps, Bf16Pairs): the scores exact in fp32 (K read as the
// cache's bytes), the numerators P rounded to bf16 for the weighted sum, as PyTorch's flash attention does; other
// dtypes and CPUs multiply in fp32 (F32). Softmax, sums and the output's rounding are fp32 either way.
//
// Why: PyTorch's CPU SDPA took 100 of the 263 ms of a 512-token prefill of the default model; the chunk after the
// first (a mask over past + chunk) went through its unfused path. This kernel is 2-3x faster on those chunks
// (bench/RESULTS.md#cpu-prefill-attention-benchattention_cpupy).

namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kScoreMR = 4, kScoreNV = 6;  // S^T: 4 keys x 96 rows
constexpr int kSumMR = 6, kSumNV = 4;      // O: 6 rows x 64 dims
#else
constexpr int kVecBytes = 32;
constexpr int kScoreMR = 4, kScoreNV = 3;  // 4 keys x 24 rows
constexpr int kSumMR = 6, kSumNV = 2;      // 6 rows x 16 dims
#endif
constexpr int64_t kW = kVecBytes / 4;  // floats per vector
constexpr int64_t kKeys = 64;          // keys per tile
constexpr int64_t kRows = 96;          // rows (query positions x heads of a group) per work item, at most
typedef float Vec __attribute__((vector_size(kVecBytes)));
typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
typedef uint32_t UVec __attribute__((vector_size(kVecBytes)));

inline Vec vload(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline IVec iload(const int32_t* p) {
  IVec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Vec vbcast(float x) {
#if defined(__AVX512F__)
  return (Vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (Vec)_mm256_set1_ps(x);
#else
  Vec v;
  for (int64_t i = 0; i < kW; ++i) v[i] = x;
  return v;
#endif
}
// a * b + c in one rounding (the library is built with -ffp-contract=off, for the glue ops' sake)
inline Vec fmadd(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

// qs::exp_approx lane-wise: the same reduction and polynomial, its steps fused multiply-adds (it is the softmax's
// main cost; the scalar one keeps separate roundings only because the library is built without contraction).
inline Vec vexp(Vec x) {
  x = vmax(x, vbcast(-87.3f));
  x = x > vbcast(88.3f) ? vbcast(88.3f) : x;
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const Vec r = fmadd(n, vbcast(2.12194440e-4f), fmadd(n, vbcast(-0.693359375f), x));
  Vec p = fmadd(vbcast(1.9875691500e-4f), r, vbcast(1.3981999507e-3f));
  p = fmadd(p, r, vbcast(8.3334519073e-3f));
  p = fmadd(p, r, vbcast(4.1665795894e-2f));
  p = fmadd(p, r, vbcast(1.6666665459e-1f));
  p = fmadd(p, r, vbcast(5.0000001201e-1f));
  p = fmadd(p * r, r, r + 1.0f);
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;  // 2^n
  return p * (Vec)bits;
}

// How a product's elements are multiplied: E::A and E::B its operands' element types, E::bcast an A element to
// every lane, E::load a vector of B, E::madd one step of a lane's sum.
struct F32 {  // fp32 elements, one FMA each
  using A = float;
  using B = float;
  static Vec bcast(float a) { return vbcast(a); }
  static Vec load(const float* p) { return vload(p); }
  static Vec madd(Vec acc, Vec a, Vec b) { return fmadd(a, b, acc); }
};
#if defined(__AVX512BF16__)
// Pairs of bf16 along the sum as 32-bit elements (low half first): vdpbf16ps adds both products of a pair to a lane,
// exactly (a product of two bf16 is exact in fp32), at twice the FMA's multiply-adds per instruction.
struct Bf16Pairs {
  using A = uint32_t;
  using B = uint32_t;
  static Vec bcast(uint32_t a) { return (Vec)_mm512_set1_epi32(static_cast<int>(a)); }
  static Vec load(const uint32_t* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static Vec madd(Vec acc, Vec a, Vec b) { return (Vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b); }
};
#endif

// C (MR, NV * kW) = A (MR, n) B (n, NV * kW), or += when `add`. A's element (i, p) is at A[i * sa + p * sp]; ldb,
// ldc: row strides in elements.
template <typename E, int MR, int NV>
__attribute__((always_inline)) inline void rank_block(const typename E::A* __restrict A, int64_t sa, int64_t sp,
                                                      const typename E::B* __restrict B, int64_t ldb, int64_t n,
                                                      float* __restrict C, int64_t ldc, bool add) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = add ? vload(C + i * ldc + j * kW) : Vec{};
  for (int64_t p = 0; p < n; ++p) {
    Vec b[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b[j] = E::load(B + p * ldb + j * kW);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec a = E::bcast(A[i * sa + p * sp]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = E::madd(acc[i][j], a, b[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vstore(C + i * ldc + j * kW, acc[i][j]);
}

// rank_block over `vecs` column vectors: blocks of NV, then single vectors.
template <typename E, int MR, int NV>
void rows_block(const typename E::A* A, int64_t sa, int64_t sp, const typename E::B* B, int64_t ldb, int64_t n,
                float* C, int64_t ldc, int64_t vecs, bool add) {
  int64_t c = 0;
  for (; c + NV <= vecs; c += NV) rank_block<E, MR, NV>(A, sa, sp, B + c * kW, ldb, n, C + c * kW, ldc, add);
  for (; c < vecs; ++c) rank_block<E, MR, 1>(A, sa, sp, B + c * kW, ldb, n, C + c * kW, ldc, add);
}

// C (rows, vecs * kW) (+)= A (rows, n) B (n, vecs * kW): blocks of MR rows, then the rest.
template <typename E, int MR, int NV>
__attribute__((noinline)) void matmul(const typename E::A* A, int64_t sa, int64_t sp, const typename E::B* B,
                                      int64_t ldb, int64_t n, float* C, int64_t ldc, int64_t rows, int64_t vecs,
                                      bool add) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) rows_block<E, MR, NV>(A + r * sa, sa, sp, B, ldb, n, C + r * ldc, ldc, vecs, add);
  const typename E::A* a = A + r * sa;
  float* c = C + r * ldc;
  switch (rows - r) {  // MR <= 6
    case 5: rows_block<E, 5, NV>(a, sa, sp, B, ldb, n, c, ldc, vecs, add); break;
    case 4: rows_block<E, 4, NV>(a, sa, sp, B, ldb, n, c, ldc, vecs, add); break;
    case 3: rows_block<E, 3, NV>(a, sa, sp, B, ldb, n, c, ldc, vecs, add); break;
    case 2: rows_block<E, 2, NV>(a, sa, sp, B, ldb, n, c, ldc, vecs, add); break;
    case 1: rows_block<E, 1, NV>(a, sa, sp, B, ldb, n, c, ldc, vecs, add); break;
    default: break;
  }
}

// The online-softmax step of one key tile for one vector of rows: st points at that vector in the tile's first
// key's raw scores q.k (S^T, row stride ld), nk keys at positions k0.. ; lane r sees keys [lo[r], pos[r]]. The
// scores are scaled (and soft-capped), then become the numerators exp(s - m') (0 where not visible; what is not
// visible may hold anything, it is selected away), m and l (the rows' running max and sum) are updated, and the
// factor exp(m - m') that the rows' earlier weighted sums must be scaled by is returned (0 where m was -inf:
// nothing was seen yet).
inline Vec softmax_step(float* __restrict st, int64_t ld, int64_t nk, int64_t k0, IVec lo, IVec pos, float scale,
                        float cap, Vec& m, Vec& l) {
  const Vec ninf = vbcast(-std::numeric_limits<float>::infinity()), zero = Vec{};
  Vec mx = ninf;
  for (int64_t j = 0; j < nk; ++j) {
    Vec s = vload(st + j * ld) * scale;
    if (cap > 0.f) s = cap * (2.0f / (1.0f + vexp(s * (-2.0f / cap))) - 1.0f);  // cap * tanh(s / cap), as qs::softcap
    vstore(st + j * ld, s);
    const IVec kp = IVec{} + static_cast<int32_t>(k0 + j);
    mx = vmax(mx, (kp >= lo) & (kp <= pos) ? s : ninf);
  }
  const Vec mnew = vmax(m, mx);
  Vec sum = zero;
  for (int64_t j = 0; j < nk; ++j) {
    const IVec kp = IVec{} + static_cast<int32_t>(k0 + j);
    const Vec e = (kp >= lo) & (kp <= pos) ? vexp(vload(st + j * ld) - mnew) : zero;
    vstore(st + j * ld, e);
    sum += e;
  }
  const Vec alpha = m == ninf ? zero : vexp(m - mnew);
  m = mnew;
  l = l * alpha + sum;
  return alpha;
}

struct Prefill {
  const int64_t* table;
  int64_t bs, start, H, Hkv, D, Dp, g, window, qstride;
  float scale, cap;

  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  // the cache slot of position pos
  int64_t slot(int64_t pos) const { return table[pos / bs] * bs + pos % bs; }
};

// Scratch of one thread for up to `rows` rows (a multiple of the vector width), allocated once per call. q, k, v
// hold the products' operands: fp32, or bf16 pairs (bits) for Bf16Pairs, whose P^T pairs are in p. The padding
// head dims [D, Dp) of k's and v's rows are never written, so they stay the zeros they start as.
struct Work {
  std::vector<float> qt, k, v, st, p, o, m, l, alpha, qrow;
  std::vector<int32_t> pos, lo;
  Work(int64_t Dp, int64_t rows)
      : qt(Dp * rows), k(kKeys * Dp), v(kKeys * Dp), st(kKeys * rows), p(kKeys / 2 * rows), o(rows * Dp), m(rows),
        l(rows), alpha(rows), qrow(Dp), pos(rows), lo(rows) {}
};

// How a work item's operands are staged for E. F32: Q^T (Dp, rp), K (nk, Dp) and V (nk, Dp) in fp32, the
// softmax's numerators P^T (nk, rp) read in place. Bf16Pairs: the same with pairs along each product's sum: Q^T
// (Dp / 2, rp) and K (nk, Dp / 2) paired along the head dim (K's pairs are the cache's own bytes), V (nk / 2, Dp)
// and P^T (nk / 2, rp) paired along the keys, P rounded to bf16 as PyTorch's flash attention rounds it.
template <typename T, typename E>
struct Stage;

template <typename T>
struct Stage<T, F32> {
  using R = typename Raw<T>::type;
  static constexpr int64_t kPair = 1;
  // query row r (D,) into Q^T, rotated in fp32 first when the keys were stored rotated (key_block > 0)
  static void q_elem(float* qt, int64_t rp, int64_t r, const R* src, int64_t D, int64_t key_block, float* row) {
    for (int64_t d = 0; d < D; ++d) row[d] = Raw<T>::get(src[d]);
    if (key_block > 0) qs::hadamard_blocks(row, D, key_block);
    for (int64_t d = 0; d < D; ++d) qt[d * rp + r] = row[d];
  }
  template <typename Rows>  // one KV head's rows, of the model's dtype or dequantized as they are loaded
  static void kv_tile(Work& w, const Prefill& a, const Rows& rows, int64_t k0, int64_t nk) {
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = a.slot(k0 + j);
      rows.load_k(slot, w.k.data() + j * a.Dp, a.D);
      rows.load_v(slot, w.v.data() + j * a.Dp, a.D);
    }
  }
  static const float* p(Work& w, int64_t, int64_t) { return w.st.data(); }
};

#if defined(__AVX512BF16__)
inline uint32_t pair(uint16_t lo, uint16_t hi) { return lo | (static_cast<uint32_t>(hi) << 16); }

template <>
struct Stage<c10::BFloat16, Bf16Pairs> {
  using R = uint16_t;
  static constexpr int64_t kPair = 2;
  static void q_elem(float* qt, int64_t rp, int64_t r, const R* src, int64_t D, int64_t, float*) {
    auto* q2 = reinterpret_cast<uint32_t*>(qt);
    for (int64_t t = 0; t < D / 2; ++t) q2[t * rp + r] = pair(src[2 * t], src[2 * t + 1]);
  }
  static void kv_tile(Work& w, const Prefill& a, const qs::FloatRows<c10::BFloat16>& rows, int64_t k0, int64_t nk) {
    const int64_t D = a.D, Dp = a.Dp;
    const R* kc = rows.k;
    const R* vc = rows.v;
    auto* k2 = reinterpret_cast<uint32_t*>(w.k.data());
    auto* v2 = reinterpret_cast<uint32_t*>(w.v.data());
    for (int64_t u = 0; u < (nk + 1) / 2; ++u) {  // keys 2u, 2u + 1 (a missing last one: V 0)
      const bool two = 2 * u + 1 < nk;
      const int64_t at0 = a.slot(k0 + 2 * u) * rows.stride, at1 = two ? a.slot(k0 + 2 * u + 1) * rows.stride : 0;
      std::memcpy(k2 + 2 * u * (Dp / 2), kc + at0, D * sizeof(R));
      if (two) std::memcpy(k2 + (2 * u + 1) * (Dp / 2), kc + at1, D * sizeof(R));
      uint32_t* row = v2 + u * Dp;
      if (two)
        for (int64_t d = 0; d < D; ++d) row[d] = pair(vc[at0 + d], vc[at1 + d]);
      else
        for (int64_t d = 0; d < D; ++d) row[d] = vc[at0 + d];
    }
  }
  // P^T (nk, rp) fp32 -> (ceil(nk / 2), rp) pairs of bf16 along the keys (a missing last key weighs 0)
  static const uint32_t* p(Work& w, int64_t nk, int64_t rp) {
    const float* st = w.st.data();
    auto* p2 = reinterpret_cast<uint32_t*>(w.p.data());
    for (int64_t u = 0; u < (nk + 1) / 2; ++u)
      for (int64_t c = 0; c < rp; c += kW) {
        const UVec lo = round(vload(st + 2 * u * rp + c));
        const UVec hi = 2 * u + 1 < nk ? round(vload(st + (2 * u + 1) * rp + c)) : UVec{};
        const UVec both = lo | (hi << 16);
        std::memcpy(p2 + u * rp + c, &both, sizeof(both));
      }
    return p2;
  }
  // fp32 -> bf16 bits (in the low half), to nearest even as c10 rounds; P has no NaN
  static UVec round(Vec x) {
    const UVec u = (UVec)x;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  }
};
#endif

// KV head h, query positions [i0, i1) of the chunk: rows r = (i - i0) * g + e for query head h * g + e.
template <typename T, typename E, typename Rows>
void prefill_item(const Prefill& a, const typename Raw<T>::type* qp, const Rows& cache, typename Raw<T>::type* op,
                  int64_t h, int64_t i0, int64_t i1, Work& w) {
  using S = Stage<T, E>;
  using EA = typename E::A;
  const int64_t g = a.g, D = a.D, Dp = a.Dp, rows = (i1 - i0) * g, rp = (rows + kW - 1) / kW * kW;
  const int64_t dsum = Dp / S::kPair;  // the scores' sum: over head dims, or pairs of them
  const Rows head = cache.at_head(h, D);
  float* O = w.o.data();    // (rows, Dp)
  float* ST = w.st.data();  // (kKeys, rp): scores, then numerators
  std::fill(w.qt.begin(), w.qt.begin() + Dp * rp, 0.f);  // padding rows and dims stay 0 (in either form)
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t pos = a.start + i0 + r / g;
    w.pos[r] = r < rows ? static_cast<int32_t>(pos) : -1;  // a padding row sees nothing
    w.lo[r] = r < rows ? static_cast<int32_t>(a.first_key(pos)) : 0;
    if (r < rows)
      S::q_elem(w.qt.data(), rp, r, qp + (i0 + r / g) * a.qstride + (h * g + r % g) * D, D, head.key_block,
                w.qrow.data());
  }
  std::fill(O, O + rows * Dp, 0.f);
  std::fill(w.m.begin(), w.m.begin() + rp, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rp, 0.f);
  // Key tiles start at multiples of kKeys, whatever the item: a row meets the same tiles in the same order however
  // the prompt was cut into chunks and the chunk into items, so its result does not depend on them (the engine's
  // chunks depend on the other requests in flight). A tile is cut at the item's last key.
  const int64_t kend = a.start + i1;
  for (int64_t k0 = a.first_key(a.start + i0) / kKeys * kKeys; k0 < kend; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, kend - k0);
    S::kv_tile(w, a, head, k0, nk);
    // S^T = K Q^T: (nk, rp)
    matmul<E, kScoreMR, kScoreNV>(reinterpret_cast<const EA*>(w.k.data()), dsum, 1,
                                  reinterpret_cast<const EA*>(w.qt.data()), rp, dsum, ST, rp, nk, rp / kW, false);
    for (int64_t c = 0; c < rp; c += kW) {
      Vec m = vload(w.m.data() + c), l = vload(w.l.data() + c);
      const Vec alpha = softmax_step(ST + c, rp, nk, k0, iload(w.lo.data() + c), iload(w.pos.data() + c), a.scale,
                                     a.cap, m, l);
      vstore(w.m.data() + c, m), vstore(w.l.data() + c, l), vstore(w.alpha.data() + c, alpha);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float s = w.alpha[r];
      if (s != 1.f)
        for (int64_t d = 0; d < Dp; ++d) O[r * Dp + d] *= s;
    }
    // O += P V: (rows, Dp), P's element (r, j) at P^T[j * rp + r]
    matmul<E, kSumMR, kSumNV>(S::p(w, nk, rp), 1, rp, reinterpret_cast<const EA*>(w.v.data()), Dp,
                              (nk + S::kPair - 1) / S::kPair, O, Dp, rows, Dp / kW, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    typename Raw<T>::type* dst = op + (i0 + r / g) * a.H * D + (h * g + r % g) * D;
    const float inv = w.l[r] > 0.f ? 1.0f / w.l[r] : 0.f;
    float* o = O + r * Dp;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    if (head.value_block > 0) qs::hadamard_blocks(o, D, head.value_block);  // values stored rotated: rotate back
    for (int64_t d = 0; d < D; ++d) dst[d] = Raw<T>::put(o[d]);
  }
}

at::Tensor prefill_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor* scales, int64_t key_block,
                        int64_t value_block, const at::Tensor& block_table, int64_t start, int64_t block_size,
                        int64_t window, double scale, double softcap) {
  check_q_kv(q, kv, scales, key_block, value_block, "(C, H, D)");
  const int64_t C = q.size(0), H = q.size(1), D = q.size(2), S = kv.size(1), Hkv = kv.size(2);
  TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous() && block_table.scalar_type() == at::kLong,
              "block_table must be a contiguous (blocks,) int64 tensor");
  TORCH_CHECK(block_size > 0 && S % block_size == 0, "the cache's slots must be whole blocks");
  TORCH_CHECK(start >= 0 && start + C <= block_table.size(0) * block_size,
              "positions [", start, ", ", start + C, ") are outside the block table");
  const int64_t* tp = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (start + C + block_size - 1) / block_size; ++i)  // checked before anything is read
    TORCH_CHECK(tp[i] >= 0 && tp[i] < S / block_size, "block ", tp[i], " is outside the cache");
  at::Tensor out = at::empty({C, H, D}, q.options());
  if (C == 0) return out;
  const int64_t g = H / Hkv, Dp = (D + kW - 1) / kW * kW;
  const int64_t span = std::max<int64_t>(1, kRows / g);  // query positions per work item (rows: span * g)
  const Prefill a{tp, block_size, start, H, Hkv, D, Dp, g, window, q.stride(0), to_f(scale), to_f(softcap)};
  // Work items (KV head, positions [i0, i1)), the costliest (most keys) first, dealt to the threads in turn.
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> items;  // (-keys, h, i0, i1)
  for (int64_t i0 = 0; i0 < C; i0 += span) {
    const int64_t i1 = std::min(C, i0 + span), keys = start + i1 - a.first_key(start + i0);
    for (int64_t h = 0; h < Hkv; ++h) items.emplace_back(-keys * (i1 - i0), h, i0, i1);
  }
  std::stable_sort(items.begin(), items.end());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  dispatch_rows(q, kv, scales, key_block, value_block, [&](auto tag, const auto& rows) {
    using scalar_t = decltype(tag);
    using Rows = std::decay_t<decltype(rows)>;
    const auto* qp = raw(q.data_ptr<scalar_t>());
    auto* op = raw(out.data_ptr<scalar_t>());
    auto run = &prefill_item<scalar_t, F32, Rows>;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Rows, qs::FloatRows<c10::BFloat16>>) {
      if (D % 2 == 0) run = &prefill_item<scalar_t, Bf16Pairs, Rows>;
    }
#endif
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      Work w(Dp, (span * g + kW - 1) / kW * kW);
      for (int64_t t = b; t < e; ++t)
        for (size_t i = t; i < items.size(); i += threads) {
          const auto& [cost, h, i0, i1] = items[i];
          run(a, qp, rows, op, h, i0, i1, w);
        }
    });
  });
  return out;
}

}  // namespace

// Attention of one prefill chunk over the request's paged cache (its keys and values for positions
// [0, start + C) already stored): q (C, H, D), heads contiguous, rows may be strided (a slice of the fused qkv
// output); kv (2, slots, Hkv, D), one layer's cache, contiguous; block_table (blocks,): position p is in slot
// block_table[p / bs] * bs + p % bs. Query i (position start + i) attends to the keys at positions
// [max(0, start + i - window + 1), start + i] (window <= 0: from 0); softcap > 0: scores -> softcap *
// tanh(scores / softcap). Returns (C, H, D) in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, int64_t start,
                             int64_t block_size, int64_t window, double scale, double softcap) {
  return prefill_impl(q, kv, nullptr, 0, 0, block_table, start, block_size, window, scale, softcap);
}

// prefill_attention over a quantized cache: kv holds int8 or float8_e4m3fn codes, scales (2, slots, Hkv) their
// float16 scale per token per KV head; each key tile is dequantized as it is staged (qs::QuantRows). key_block and
// value_block as for decode_attention_quant.
at::Tensor prefill_attention_quant(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& scales,
                                   const at::Tensor& block_table, int64_t start, int64_t block_size, int64_t window,
                                   double scale, double softcap, int64_t key_block, int64_t value_block) {
  return prefill_impl(q, kv, &scales, key_block, value_block, block_table, start, block_size, window, scale, softcap);
}

// The two above with the chunk's first position held by a (1,) int64 tensor (server.batch.StepInt's), so that a
// recorded step program (server/cpu_graphs.py) reads it per step.
int64_t start_of(const at::Tensor& start) {
  TORCH_CHECK(start.device().is_cpu() && start.scalar_type() == at::kLong && start.numel() == 1,
              "start must be a (1,) int64 CPU tensor");
  return start.data_ptr<int64_t>()[0];
}

at::Tensor prefill_attention_at(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                const at::Tensor& start, int64_t block_size, int64_t window, double scale,
                                double softcap) {
  return prefill_attention(q, kv, block_table, start_of(start), block_size, window, scale, softcap);
}

at::Tensor prefill_attention_quant_at(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& scales,
                                      const at::Tensor& block_table, const at::Tensor& start, int64_t block_size,
                                      int64_t window, double scale, double softcap, int64_t key_block,
                                      int64_t value_block) {
  return prefill_attention_quant(q, kv, scales, block_table, start_of(start), block_size, window, scale, softcap,
                                 key_block, value_block);
}

// The parts a decode row's KV head is cut into at most (quant/shape/memory.py counts their bytes with its copy).
int64_t decode_attention_parts() { return kParts; }

TORCH_LIBRARY_FRAGMENT(quantserve, m) {
  m.def("decode_attention_parts() -> int", &decode_attention_parts);
  m.def("decode_attention(Tensor q, Tensor kv, Tensor block_table, Tensor lens, int block_size, int window, "
        "float scale, float softcap) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor kv, Tensor block_table, int start, int block_size, int window, "
        "float scale, float softcap) -> Tensor");
  m.def("decode_attention_quant(Tensor q, Tensor kv, Tensor scales, Tensor block_table, Tensor lens, int block_size, "
        "int window, float scale, float softcap, int key_block, int value_block) -> Tensor");
  m.def("prefill_attention_quant(Tensor q, Tensor kv, Tensor scales, Tensor block_table, int start, int block_size, "
        "int window, float scale, float softcap, int key_block, int value_block) -> Tensor");
  m.def("prefill_attention_at(Tensor q, Tensor kv, Tensor block_table, Tensor start, int block_size, int window, "
        "float scale, float softcap) -> Tensor");
  m.def("prefill_attention_quant_at(Tensor q, Tensor kv, Tensor scales, Tensor block_table, Tensor start, "
        "int block_size, int window, float scale, float softcap, int key_block, int value_block) -> Tensor");
  m.def("rotary_decode_attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv, Tensor(c!)? scales, "
        "Tensor slots, Tensor block_table, Tensor lens, int heads, int block_size, int window, float scale, "
        "float softcap, int key_block, int value_block) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("decode_attention_quant", &decode_attention_quant);
  m.impl("prefill_attention_quant", &prefill_attention_quant);
  m.impl("prefill_attention_at", &prefill_attention_at);
  m.impl("prefill_attention_quant_at", &prefill_attention_quant_at);
  m.impl("rotary_decode_attention", &rotary_decode_attention);
}
