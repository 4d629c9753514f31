// The int4 KV pool's ops (--kv-dtype int4: server/kv_int4.py gives its tensors' layout and the PyTorch reference
// of each op, which the tests hold these to):
//
// - store_blocks_int4: the int4 codes of the blocks a step completes, from their residual values (the tail's int8
//   rows for the positions written before the step, the step's own rows rounded to int8 for the rest): keys
//   asymmetric per channel over the block (KIVI), values asymmetric per token in the rotated space;
// - store_tail_int4: the rows of each sequence's incomplete block into its tail, in the residual format (int8 with a
//   float16 scale per token per KV head, values rotated);
// - attention_int4: a step's rows (decode rows and prefill chunks alike) against their sequences' caches, each
//   query reading its own block from the residual and earlier blocks from int4, dequantized as each row is
//   loaded; values are held rotated, so each output row is rotated back once.
//
// Scores, softmax and sums run in fp32; outputs are rounded once to q's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elements.h"
#include "kv_rows.h"
#include "vec_math.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

using qs::Raw;
using qs::raw;
using qs::to_f;

namespace {

constexpr float kMinScale = 6.103515625e-05f;  // 2^-14: a float16 scale is never below it

// One row x (D,) of dtype T rounded to the residual (int8, a float16 scale; rotated first when rotate > 0) and
// read back in fp32 into dst: what the tail would hold of it.
template <typename T>
void residual_row(const typename Raw<T>::type* x, float* dst, int64_t D, int64_t rotate, float* work,
                  int8_t* codes) {
  c10::Half s;
  qs::quantize_row<T, qs::Int8Code>(x, codes, &s, D, rotate, work);
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(codes[d]) * sf;
}

// A tail row (int8 codes and their float16 scale) read back in fp32.
inline void tail_row(const int8_t* codes, c10::Half s, float* dst, int64_t D) {
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(codes[d]) * sf;
}

// The float16 minimum and scale of a 4-bit asymmetric range [lo, hi] (kv_quant.asym_codes).
inline void asym_params(float lo, float hi, c10::Half& s, c10::Half& m) {
  m = c10::Half(lo);
  s = c10::Half(std::max((hi - static_cast<float>(m)) / 15.f, kMinScale));
}

inline uint8_t asym_code(float x, float m, float s) {
  return static_cast<uint8_t>(std::clamp(std::nearbyint((x - m) / s), 0.f, 15.f));
}

// One layer's units (server/kv_int4.py's layout): each an int4 block or a tail half, at fixed offsets in the unit.
struct Pool {
  int64_t Hkv, D, bs, units, ub;
  uint8_t* base;

  Pool(const at::Tensor& units_, int64_t kv_heads, int64_t head_dim, int64_t block_size)
      : Hkv(kv_heads), D(head_dim), bs(block_size) {
    TORCH_CHECK(bs > 0 && bs % 32 == 0 && Hkv > 0 && D > 0 && D % 8 == 0,
                "the int4 pool needs a block size that is a multiple of 32 and a head_dim that is a multiple of 8");
    TORCH_CHECK(units_.dim() == 2 && units_.is_contiguous() && units_.scalar_type() == at::kByte &&
                    units_.size(1) == bs * Hkv * (D + 4) + 4 * Hkv * D,
                "units must be a contiguous (units, ", bs * Hkv * (D + 4) + 4 * Hkv * D,
                ") uint8 tensor: the int4 pool of this block size, KV heads and head_dim");
    units = units_.size(0), ub = units_.size(1);
    base = units_.data_ptr<uint8_t>();
  }
  int64_t vblock() const { return D & -D; }  // the values' rotation block: the largest power of two dividing D
  uint8_t* unit(int64_t u) const { return base + u * ub; }
  // an int4 block's parts
  uint8_t* code_row(int64_t which, int64_t block, int64_t i, int64_t h) const {
    return unit(block) + which * bs * Hkv * (D / 2) + (i * Hkv + h) * (D / 2);
  }
  c10::Half* kparam(int64_t block, int64_t h) const {  // (2, D): scales, then minimums
    return reinterpret_cast<c10::Half*>(unit(block) + bs * Hkv * D) + h * 2 * D;
  }
  c10::Half* vparam(int64_t block, int64_t i, int64_t h) const {  // (2,): scale, minimum
    return reinterpret_cast<c10::Half*>(unit(block) + bs * Hkv * D + 4 * Hkv * D) + (i * Hkv + h) * 2;
  }
  // a tail half's parts
  int8_t* tail_codes(int64_t u, int64_t i, int64_t h) const {
    return reinterpret_cast<int8_t*>(unit(u)) + (i * Hkv + h) * D;
  }
  c10::Half* tail_scale(int64_t u, int64_t i, int64_t h) const {
    return reinterpret_cast<c10::Half*>(unit(u) + bs * Hkv * D) + i * Hkv + h;
  }
};

void check_rows(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3, "k must be (T, Hkv, D)");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == k.size(0) && t->size(1) == k.size(1) &&
                    t->size(2) == k.size(2) && t->stride(2) == 1 && t->stride(1) == k.size(2) &&
                    t->scalar_type() == k.scalar_type(),
                "k and v must be CPU (T, Hkv, D) tensors with contiguous heads, of one shape and dtype");
}

// A contiguous (N, cols) int64 table of a step's entries.
const int64_t* entries(const at::Tensor& t, int64_t cols, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.is_contiguous() && t.scalar_type() == at::kLong, name,
              " must be a contiguous (N, ", cols, ") int64 tensor");
  return t.data_ptr<int64_t>();
}

void check_unit(const Pool& p, int64_t u, const char* what) {
  TORCH_CHECK(u >= 0 && u < p.units, what, " ", u, " is outside the pool");
}

// The int4 codes of the blocks a step completes; completed (N, 5) int64: (block, K tail unit, V tail unit,
// from_tail, row).
void store_blocks_int4(const at::Tensor& k, const at::Tensor& v, at::Tensor units, const at::Tensor& completed,
                       int64_t block_size) {
  check_rows(k, v);
  const Pool p(units, k.size(1), k.size(2), block_size);
  const int64_t* cp = entries(completed, 5, "completed");
  const int64_t N = completed.size(0), T = k.size(0), bs = p.bs, D = p.D, Hkv = p.Hkv;
  for (int64_t i = 0; i < N; ++i) {  // every entry checked before anything is written
    const int64_t* e = cp + 5 * i;
    check_unit(p, e[0], "block");
    check_unit(p, e[1], "tail unit");
    check_unit(p, e[2], "tail unit");
    TORCH_CHECK(e[3] >= 0 && e[3] < bs && e[4] >= 0 && e[4] + bs - e[3] <= T, "completed entry ", i,
                " reads rows outside the step");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_blocks_int4", [&] {
    const auto* kp = raw(k.data_ptr<scalar_t>());
    const auto* vp = raw(v.data_ptr<scalar_t>());
    at::parallel_for(0, N * Hkv, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> kb(bs * D), vb(bs * D), work(D);
      std::vector<int8_t> c8(D);
      for (int64_t item = b0; item < b1; ++item) {
        const int64_t i = item / Hkv, h = item % Hkv;
        const int64_t *e = cp + 5 * i, block = e[0], tk = e[1], tv = e[2], from = e[3], row = e[4];
        for (int64_t j = 0; j < bs; ++j) {
          if (j < from) {
            tail_row(p.tail_codes(tk, j, h), *p.tail_scale(tk, j, h), kb.data() + j * D, D);
            tail_row(p.tail_codes(tv, j, h), *p.tail_scale(tv, j, h), vb.data() + j * D, D);
          } else {
            const int64_t r = row + j - from;
            residual_row<scalar_t>(kp + r * k.stride(0) + h * D, kb.data() + j * D, D, 0, work.data(), c8.data());
            residual_row<scalar_t>(vp + r * v.stride(0) + h * D, vb.data() + j * D, D, p.vblock(), work.data(),
                                   c8.data());
          }
        }
        c10::Half* kpar = p.kparam(block, h);  // keys: per channel over the block's tokens
        for (int64_t d = 0; d < D; ++d) {
          float lo = kb[d], hi = kb[d];
          for (int64_t j = 1; j < bs; ++j) lo = std::min(lo, kb[j * D + d]), hi = std::max(hi, kb[j * D + d]);
          asym_params(lo, hi, kpar[d], kpar[D + d]);
        }
        for (int64_t j = 0; j < bs; ++j) {
          uint8_t* kc = p.code_row(0, block, j, h);
          for (int64_t d = 0; d < D; d += 2)
            kc[d / 2] = asym_code(kb[j * D + d], kpar[D + d], kpar[d]) |
                        (asym_code(kb[j * D + d + 1], kpar[D + d + 1], kpar[d + 1]) << 4);
          const float* x = vb.data() + j * D;  // values: per token
          float lo = x[0], hi = x[0];
          for (int64_t d = 1; d < D; ++d) lo = std::min(lo, x[d]), hi = std::max(hi, x[d]);
          c10::Half* vpar = p.vparam(block, j, h);
          asym_params(lo, hi, vpar[0], vpar[1]);
          const float s = vpar[0], m = vpar[1];
          uint8_t* vc = p.code_row(1, block, j, h);
          for (int64_t d = 0; d < D; d += 2) vc[d / 2] = asym_code(x[d], m, s) | (asym_code(x[d + 1], m, s) << 4);
        }
      }
    });
  });
}

// Rows k, v (T, Hkv, D) into their tails in the residual format; slots (T, 2) int64: the row's place in its K and
// its V tail half (unit * block_size + offset), -1 where it is not written.
void store_tail_int4(const at::Tensor& k, const at::Tensor& v, at::Tensor units, const at::Tensor& slots,
                     int64_t block_size) {
  check_rows(k, v);
  const Pool p(units, k.size(1), k.size(2), block_size);
  const int64_t* sp = entries(slots, 2, "slots");
  const int64_t T = k.size(0), D = p.D, Hkv = p.Hkv, bs = p.bs;
  TORCH_CHECK(slots.size(0) == T, "slots must give each of the step's ", T, " rows its tail slots");
  for (int64_t i = 0; i < 2 * T; ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < p.units * bs, "tail slot ", sp[i], " is outside the pool");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_tail_int4", [&] {
    const scalar_t* src[2] = {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    const int64_t st[2] = {k.stride(0), v.stride(0)};
    at::parallel_for(0, T * Hkv, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> work(D);
      for (int64_t item = b0; item < b1; ++item) {
        const int64_t t = item / Hkv, h = item % Hkv;
        for (int64_t which = 0; which < 2; ++which) {
          const int64_t slot = sp[2 * t + which];
          if (slot < 0) continue;
          qs::quantize_row<scalar_t, qs::Int8Code>(raw(src[which]) + t * st[which] + h * D,
                                                   p.tail_codes(slot / bs, slot % bs, h),
                                                   p.tail_scale(slot / bs, slot % bs, h), D,
                                                   which ? p.vblock() : 0, work.data());
        }
      }
    });
  });
}

// Channel order of the attention kernel's fp32 rows: the even channels, then the odd ones (how the 4-bit codes
// unpack with contiguous loads and stores). A dot product does not depend on the order, so queries, keys and values
// are held this way and only the output is put back.
inline void deinterleave(const float* __restrict src, float* __restrict dst, int64_t D) {
  for (int64_t i = 0; i < D / 2; ++i) dst[i] = src[2 * i], dst[D / 2 + i] = src[2 * i + 1];
}

inline void reinterleave(const float* __restrict src, float* __restrict dst, int64_t D) {
  for (int64_t i = 0; i < D / 2; ++i) dst[2 * i] = src[i], dst[2 * i + 1] = src[D / 2 + i];
}

// An int4 row (D / 2 bytes) dequantized in deinterleaved order: code * scale + minimum, per channel (s, m: (D,) in
// the same order) or one for the row.
inline void int4_row_split(const uint8_t* __restrict c, const float* __restrict s, const float* __restrict m,
                           float* __restrict dst, int64_t D) {
  const int64_t half = D / 2;
  _Pragma("omp simd")
  for (int64_t i = 0; i < half; ++i) {
    dst[i] = static_cast<float>(c[i] & 15) * s[i] + m[i];
    dst[half + i] = static_cast<float>(c[i] >> 4) * s[half + i] + m[half + i];
  }
}

inline void int4_row_split(const uint8_t* __restrict c, float s, float m, float* __restrict dst, int64_t D) {
  const int64_t half = D / 2;
  _Pragma("omp simd")
  for (int64_t i = 0; i < half; ++i) {
    dst[i] = static_cast<float>(c[i] & 15) * s + m;
    dst[half + i] = static_cast<float>(c[i] >> 4) * s + m;
  }
}

// Register-blocked pieces of attend_item (qs::V8: 8 floats a vector on AVX2 and AVX-512 alike).
using qs::V8;
using qs::load8;
using qs::store8;

// S (R, bs) = Q (R rows of D, stride D) times KT (D, bs): R rows' scores against a block of keys, kept in registers.
template <int R>
inline void scores(const float* __restrict qr, const float* __restrict KT, float* __restrict S, int64_t D,
                   int64_t bs) {
  for (int64_t c = 0; c < bs; c += 32) {
    V8 acc[R][4] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* kt = KT + d * bs + c;
      const V8 k0 = load8(kt), k1 = load8(kt + 8), k2 = load8(kt + 16), k3 = load8(kt + 24);
      for (int r = 0; r < R; ++r) {
        const V8 x = V8{} + qr[r * D + d];
        acc[r][0] += x * k0, acc[r][1] += x * k1, acc[r][2] += x * k2, acc[r][3] += x * k3;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) store8(S + r * bs + c + 8 * u, acc[r][u]);
  }
}

// One work item of attention_int4: KV head h of one chunk, its queries [i0, i1), all of one block (so all read the
// same positions from the residual). Keys are walked a block at a time: each block's keys (transposed, so a row's
// scores vectorise over the keys) and values dequantized once into fp32 tiles in L1, every query row's scores
// against them, and an online softmax carrying each row's running maximum, sum and weighted values across blocks.
// Out of the dispatch lambda with raw pointers so that its loops vectorise.
template <typename T>
__attribute__((noinline)) void attend_item(const Pool& p, const typename Raw<T>::type* q, int64_t qstride,
                                           const typename Raw<T>::type* k, const typename Raw<T>::type* v,
                                           int64_t kstride, int64_t vstride, const int64_t* table, int64_t start,
                                           const int64_t* tail, int64_t i0, int64_t i1, int64_t h, int64_t g,
                                           int64_t window, float scale, float cap, typename Raw<T>::type* o,
                                           int64_t ostride, std::vector<float>& work) {
  const int64_t D = p.D, bs = p.bs, first = start / bs * bs, nq = (i1 - i0) * g;
  const int64_t ob = (start + i0) / bs * bs;  // the queries' own block starts here
  const auto first_key = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  work.resize(3 * bs * D + 2 * nq * D + 2 * nq + 3 * bs + 4 * D);
  float* __restrict K = work.data();   // (bs, D): one block's keys
  float* __restrict KT = K + bs * D;   // (D, bs): transposed
  float* __restrict V = KT + bs * D;   // (bs, D): its values (rotated)
  float* __restrict qf = V + bs * D;   // (nq, D): row r = (i - i0) * g + e
  float* __restrict acc = qf + nq * D;  // (nq, D)
  float* __restrict mx = acc + nq * D;  // (nq,) running maxima
  float* __restrict l = mx + nq;  // (nq,) running sums
  float* __restrict s = l + nq;   // (bs,) one row's scores in the block
  float* __restrict tmp = s + bs;  // (D,)
  float* __restrict kpar = tmp + D;  // (2, D): a block's key scales and minimums, deinterleaved
  float* __restrict row = kpar + 2 * D;  // (D,)
  float* __restrict S = row + D;  // (2, bs): two rows' scores
  std::vector<int8_t> c8(D);
  for (int64_t r = 0; r < nq; ++r) {
    const auto* src = q + (i0 + r / g) * qstride + (h * g + r % g) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = Raw<T>::get(src[d]);
    deinterleave(row, qf + r * D, D);
  }
  std::fill(acc, acc + nq * D, 0.f);
  std::fill(mx, mx + nq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nq, 0.f);
  const int64_t kend = start + i1;
  for (int64_t b0 = first_key(start + i0) / bs * bs; b0 < kend; b0 += bs) {
    const int64_t j0 = std::max(b0, first_key(start + i0)), j1 = std::min(b0 + bs, kend);  // keys [j0, j1)
    const int64_t blk = table[b0 / bs];
    if (b0 < ob) {  // an earlier block: int4
      const c10::Half* kp = p.kparam(blk, h);
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(kp[d]);
      deinterleave(row, kpar, D);
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(kp[D + d]);
      deinterleave(row, kpar + D, D);
    }
    for (int64_t j = j0; j < j1; ++j) {
      float* kd = K + (j - b0) * D;
      float* vd = V + (j - b0) * D;
      if (j < ob) {
        const int64_t i = j % bs;
        int4_row_split(p.code_row(0, blk, i, h), kpar, kpar + D, kd, D);
        const c10::Half* vp = p.vparam(blk, i, h);
        int4_row_split(p.code_row(1, blk, i, h), static_cast<float>(vp[0]), static_cast<float>(vp[1]), vd, D);
        continue;
      }
      if (j < start) {  // the own block's positions written before the step: the tail
        tail_row(p.tail_codes(tail[0], j - first, h), *p.tail_scale(tail[0], j - first, h), row, D);
        deinterleave(row, kd, D);
        tail_row(p.tail_codes(tail[1], j - first, h), *p.tail_scale(tail[1], j - first, h), row, D);
        deinterleave(row, vd, D);
      } else {  // the step's own rows, as the residual holds them
        residual_row<T>(k + (j - start) * kstride + h * D, row, D, 0, tmp, c8.data());
        deinterleave(row, kd, D);
        residual_row<T>(v + (j - start) * vstride + h * D, row, D, p.vblock(), tmp, c8.data());
        deinterleave(row, vd, D);
      }
    }
    const int64_t nk = j1 - j0;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d) KT[d * bs + j] = K[(j0 - b0 + j) * D + d];
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t pos = start + i0 + r / g;
      const int64_t a = std::max(j0, first_key(pos)) - j0, z = std::min(j1, pos + 1) - j0;  // its keys [a, z)
      if (r % 2 == 0) {  // two rows at once where the next row is in the item (its scores in S's next row)
        if (r + 1 < nq) scores<2>(qf + r * D, KT, S, D, bs);
        else scores<1>(qf + r * D, KT, S, D, bs);
      }
      if (a >= z) continue;
      const float* s_r = S + (r % 2) * bs;
      std::copy(s_r, s_r + nk, s);
      float m = mx[r];
      for (int64_t j = a; j < z; ++j) {
        float x = s[j] * scale;
        if (cap > 0.f) x = qs::softcap(x, cap);
        s[j] = x;
        m = x > m ? x : m;
      }
      const float alpha = qs::exp_approx(mx[r] - m);  // ~0 at the first block a row meets (its maximum was -inf)
      float sum = 0.f;
      for (int64_t j = a; j < z; ++j) sum += (s[j] = qs::exp_approx(s[j] - m));
      l[r] = l[r] * alpha + sum;
      mx[r] = m;
      float* ar = acc + r * D;
      qs::weighted_sum(ar, alpha, s, V + (j0 - b0) * D, a, z, D);
    }
  }
  for (int64_t r = 0; r < nq; ++r) {
    float* ar = acc + r * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) ar[d] *= inv;
    reinterleave(ar, row, D);
    qs::hadamard_blocks(row, D, p.vblock());  // the values were held rotated
    const int64_t i = i0 + r / g, e = r % g;
    for (int64_t d = 0; d < D; ++d) o[i * ostride + (h * g + e) * D + d] = Raw<T>::put(row[d]);
  }
}

// A step's rows q (T, H, D) against the int4 pool; chunks (N, 5) int64 (row, n, start, K tail unit, V tail unit);
// tables (N, blocks).
at::Tensor attention_int4(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& units,
                          const at::Tensor& chunks, const at::Tensor& tables, int64_t block_size, int64_t window,
                          double scale, double softcap) {
  check_rows(k, v);
  const Pool p(units, k.size(1), k.size(2), block_size);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.size(0) == k.size(0) && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && q.size(2) == p.D && q.size(1) % p.Hkv == 0 &&
                  q.scalar_type() == k.scalar_type(),
              "q must be a CPU (T, H, D) tensor with contiguous heads, H a multiple of the pool's KV heads");
  const int64_t* cp = entries(chunks, 5, "chunks");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == chunks.size(0) && tables.is_contiguous() &&
                  tables.scalar_type() == at::kLong,
              "tables must be a contiguous (N, blocks) int64 tensor");
  const int64_t N = chunks.size(0), NB = tables.size(1), T = q.size(0), H = q.size(1), bs = p.bs;
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t c = 0; c < N; ++c) {  // every block and row a chunk reads is checked before anything is read
    const int64_t *e = cp + 5 * c, row = e[0], n = e[1], start = e[2];
    TORCH_CHECK(row >= 0 && n > 0 && row + n <= T, "chunk ", c, "'s rows are outside the step");
    TORCH_CHECK(start >= 0 && start + n <= NB * bs, "chunk ", c, "'s positions are outside its block table");
    check_unit(p, e[3], "tail unit");
    check_unit(p, e[4], "tail unit");
    for (int64_t b = 0; b < (start + n) / bs; ++b) check_unit(p, tp[c * NB + b], "block");
  }
  at::Tensor out = at::empty({T, H, p.D}, q.options());
  const float sc = to_f(scale), cap = to_f(softcap);
  constexpr int64_t kSpan = 16;  // queries per work item, at most
  std::vector<std::array<int64_t, 4>> items;  // (chunk, head, first query, end query): queries of one block
  for (int64_t c = 0; c < N; ++c) {
    const int64_t n = cp[5 * c + 1], start = cp[5 * c + 2];
    for (int64_t i0 = 0; i0 < n;) {
      const int64_t block_end = ((start + i0) / bs + 1) * bs - start;
      const int64_t i1 = std::min({n, i0 + kSpan, block_end});
      for (int64_t h = 0; h < p.Hkv; ++h) items.push_back({c, h, i0, i1});
      i0 = i1;
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_int4", [&] {
    const auto* qp = raw(q.data_ptr<scalar_t>());
    const auto* kp = raw(k.data_ptr<scalar_t>());
    const auto* vp = raw(v.data_ptr<scalar_t>());
    auto* op = raw(out.data_ptr<scalar_t>());
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> work;
      for (int64_t it = b0; it < b1; ++it) {
        const auto [c, h, i0, i1] = items[it];
        const int64_t row = cp[5 * c];
        attend_item<scalar_t>(p, qp + row * q.stride(0), q.stride(0), kp + row * k.stride(0), vp + row * v.stride(0),
                              k.stride(0), v.stride(0), tp + c * NB, cp[5 * c + 2], cp + 5 * c + 3, i0, i1, h,
                              H / p.Hkv, window, sc, cap, op + row * H * p.D, H * p.D, work);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantserve, m) {
  m.def("store_blocks_int4(Tensor k, Tensor v, Tensor(a!) units, Tensor completed, int block_size) -> ()");
  m.def("store_tail_int4(Tensor k, Tensor v, Tensor(a!) units, Tensor slots, int block_size) -> ()");
  m.def("attention_int4(Tensor q, Tensor k, Tensor v, Tensor units, Tensor chunks, Tensor tables, int block_size, "
        "int window, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantserve, CPU, m) {
  m.impl("store_blocks_int4", &store_blocks_int4);
  m.impl("store_tail_int4", &store_tail_int4);
  m.impl("attention_int4", &attention_int4);
}
