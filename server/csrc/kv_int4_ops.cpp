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

// An int4 row: 4-bit codes (D / 2 bytes, channel 2i low) times per-channel scales plus minimums (keys), or times
// one scale plus one minimum (values).
inline void int4_row(const uint8_t* c, const c10::Half* s, const c10::Half* m, float* dst, int64_t D) {
  for (int64_t i = 0; i < D / 2; ++i) {
    dst[2 * i] = static_cast<float>(c[i] & 15) * static_cast<float>(s[2 * i]) + static_cast<float>(m[2 * i]);
    dst[2 * i + 1] =
        static_cast<float>(c[i] >> 4) * static_cast<float>(s[2 * i + 1]) + static_cast<float>(m[2 * i + 1]);
  }
}

inline void int4_row(const uint8_t* c, float s, float m, float* dst, int64_t D) {
  for (int64_t i = 0; i < D / 2; ++i) {
    dst[2 * i] = static_cast<float>(c[i] & 15) * s + m;
    dst[2 * i + 1] = static_cast<float>(c[i] >> 4) * s + m;
  }
}

// One layer's units (server/kv_int4.py's layout): each an int4 block or a tail half, at fixed offsets in the unit.
struct Pool {
  int64_t Hkv, D, bs, units, ub;
  uint8_t* base;

  Pool(const at::Tensor& units_, int64_t kv_heads, int64_t head_dim, int64_t block_size)
      : Hkv(kv_heads), D(head_dim), bs(block_size) {
    TORCH_CHECK(bs > 0 && Hkv > 0 && D > 0 && D % 2 == 0, "the int4 pool needs a positive block size and an even "
                "head_dim");
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

// One work item of attention_int4: KV head h of one chunk, its queries [i0, i1).
template <typename T>
void attend_chunk(const Pool& p, const typename Raw<T>::type* q, int64_t qstride, const typename Raw<T>::type* k,
                  const typename Raw<T>::type* v, int64_t kstride, int64_t vstride, const int64_t* table, int64_t start,
                  const int64_t* tail, int64_t i0, int64_t i1, int64_t h, int64_t g, int64_t window, float scale, float cap,
                  typename Raw<T>::type* o, int64_t ostride) {
  const int64_t D = p.D, bs = p.bs, first = start / bs * bs;
  std::vector<float> own_k((i1) * D), own_v((i1) * D), work(D), qf(g * D), acc(g * D), row(D);
  std::vector<int8_t> c8(D);
  for (int64_t i = 0; i < i1; ++i) {  // the chunk's rows up to the item's last query, as the residual holds them
    residual_row<T>(k + i * kstride + h * D, own_k.data() + i * D, D, 0, work.data(), c8.data());
    residual_row<T>(v + i * vstride + h * D, own_v.data() + i * D, D, p.vblock(), work.data(), c8.data());
  }
  // position j's key (0) or value (1) row into dst, as a query of own block `ob` reads it
  const auto load = [&](int64_t which, int64_t j, int64_t ob, float* dst) {
    if (j < ob) {
      const int64_t blk = table[j / bs], i = j % bs;
      if (which == 0) {
        const c10::Half* par = p.kparam(blk, h);
        int4_row(p.code_row(0, blk, i, h), par, par + D, dst, D);
      } else {
        const c10::Half* par = p.vparam(blk, i, h);
        int4_row(p.code_row(1, blk, i, h), static_cast<float>(par[0]), static_cast<float>(par[1]), dst, D);
      }
    } else if (j < start) {
      tail_row(p.tail_codes(tail[which], j - first, h), *p.tail_scale(tail[which], j - first, h), dst, D);
    } else {
      const float* src = (which == 0 ? own_k.data() : own_v.data()) + (j - start) * D;
      std::copy(src, src + D, dst);
    }
  };
  std::vector<float> s;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t pos = start + i, ob = pos / bs * bs, lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t n = pos + 1 - lo;
    s.resize(g * n);
    for (int64_t e = 0; e < g * D; ++e) qf[e] = Raw<T>::get(q[i * qstride + h * g * D + e]);
    for (int64_t j = 0; j < n; ++j) {
      load(0, lo + j, ob, row.data());
      for (int64_t e = 0; e < g; ++e) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[e * D + d] * row[d];
        float x = dot * scale;
        if (cap > 0.f) x = qs::softcap(x, cap);
        s[e * n + j] = x;
      }
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t e = 0; e < g; ++e) {
      float* se = s.data() + e * n;
      const float m = *std::max_element(se, se + n);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += (se[j] = qs::exp_approx(se[j] - m));
      for (int64_t j = 0; j < n; ++j) se[j] /= sum;
    }
    for (int64_t j = 0; j < n; ++j) {
      load(1, lo + j, ob, row.data());
      for (int64_t e = 0; e < g; ++e) {
        const float w = s[e * n + j];
        for (int64_t d = 0; d < D; ++d) acc[e * D + d] += w * row[d];
      }
    }
    for (int64_t e = 0; e < g; ++e) {
      float* a = acc.data() + e * D;
      qs::hadamard_blocks(a, D, p.vblock());  // the values were held rotated
      for (int64_t d = 0; d < D; ++d) o[i * ostride + (h * g + e) * D + d] = Raw<T>::put(a[d]);
    }
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
  constexpr int64_t kSpan = 16;  // queries per work item
  std::vector<std::array<int64_t, 3>> items;  // (chunk, head, first query)
  for (int64_t c = 0; c < N; ++c)
    for (int64_t i0 = 0; i0 < cp[5 * c + 1]; i0 += kSpan)
      for (int64_t h = 0; h < p.Hkv; ++h) items.push_back({c, h, i0});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_int4", [&] {
    const auto* qp = raw(q.data_ptr<scalar_t>());
    const auto* kp = raw(k.data_ptr<scalar_t>());
    const auto* vp = raw(v.data_ptr<scalar_t>());
    auto* op = raw(out.data_ptr<scalar_t>());
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t it = b0; it < b1; ++it) {
        const auto [c, h, i0] = items[it];
        const int64_t row = cp[5 * c], n = cp[5 * c + 1];
        attend_chunk<scalar_t>(p, qp + row * q.stride(0), q.stride(0), kp + row * k.stride(0), vp + row * v.stride(0),
                               k.stride(0), v.stride(0), tp + c * NB, cp[5 * c + 2], cp + 5 * c + 3, i0,
                               std::min(n, i0 + kSpan), h, H / p.Hkv, window, sc, cap, op + row * H * p.D, H * p.D);
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
