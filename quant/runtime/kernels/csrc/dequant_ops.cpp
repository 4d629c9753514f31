// Weight dequantizers for the runtime Linears' dequantize-then-matmul paths (quant/runtime/linear.py, quant/runtime/int4.py; loaded
// by quant/runtime/kernels/dequant.py, where each has its PyTorch reference, and tests hold the two together bit for bit).
//
// Why: a long prefill computes a quantized Linear as dequantize + a dense GEMM, and the eager dequantization
// (int8: convert, subtract, scale, round: four passes over N x K; int4: unpack the kernel layout, convert, scale,
// shift, permute, round: seven) cost up to as much as the GEMM it feeds. Here it is one pass, writing the
// activation dtype directly, in the same float operations and order as the reference (compiled without
// contraction, so every product and sum rounds where the reference's does).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elements.h"
#include "int4_vec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per task: below this a call stays on one thread

// One row of int8 codes: o = (q - z) * s.
template <typename T>
__attribute__((noinline)) void int8_row(const int8_t* __restrict q, float z, float s,
                                        typename qs::Raw<T>::type* __restrict o, int64_t k) {
  for (int64_t j = 0; j < k; ++j) o[j] = qs::Raw<T>::put((static_cast<float>(q[j]) - z) * s);
}

void check_out(const at::Tensor& out, int64_t n, int64_t k) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "out must be a contiguous CPU (", n, ", ", k, ") tensor");
}

}  // namespace

// out (N, K) = (q - zero) * scale per row: q (N, K) int8, scale (N,) fp32, zero (N,) int8 or an empty tensor.
void dequant_int8(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q must be a contiguous CPU (N, K) int8 tensor");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "scale must be a contiguous (N,) fp32 tensor");
  const bool affine = zero.numel() > 0;
  TORCH_CHECK(!affine || (zero.dim() == 1 && zero.size(0) == n && zero.is_contiguous() &&
                          zero.scalar_type() == at::kChar),
              "zero must be a contiguous (N,) int8 tensor, or empty");
  check_out(out, n, k);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int8_t* zp = affine ? zero.data_ptr<int8_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequant_int8", [&] {
    auto* op = qs::raw(out.data_ptr<scalar_t>());
    at::parallel_for(0, n, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, k)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        int8_row<scalar_t>(qp + r * k, zp ? static_cast<float>(zp[r]) : 0.f, sp[r], op + r * k, k);
    });
  });
}

namespace {

#if defined(QS_INT4_VEC)
// A full block's column (int4_vec.h) into W^T, written with intrinsics: the compiler's vectorisation of the short
// loops below unpacked bytes one 128-bit lane at a time (AVX2: 6x slower than a bf16 -> fp32 conversion of the same
// W) and rounded to bf16 at half the speed it wrote fp32 (AVX-512). Same operations, same order, same rounding (a
// product, then a sum; bf16 to nearest even, NaN to 0x7FC0) as qs::Raw<T>::put of the scalar loop.
template <typename O>
inline void int4_split_full(const uint8_t* __restrict src, const float* __restrict sb, const float* __restrict ob,
                            O* __restrict w) {
  using V = qs::Int4Vec;
  V::F codes[4];
  V::codes(src, codes);
  for (int j = 0; j < 4; ++j) {
    const int64_t i = j * V::kLanes;
    V::put(V::mul_add(codes[j], V::load(sb + i), V::load(ob + i)), w + i);
  }
}
#endif

// Column c of one block of the int4pack layout (`rows` rows of W stored as (K, rows/2) bytes, column c's codes in
// bytes [c * rows/2, (c + 1) * rows/2) of the block) into W^T's row c, entries r0 .. r0 + rows. Nibble layout
// `split` (byte i: row i low, row i + rows/2 high) or interleaved (byte i: rows 2i low, 2i + 1 high). w = code * s +
// (z - 8 s) per row (s, off: that column group's (N,) scales and offsets).
// HALF > 0: rows / 2 known at compile time (the full blocks of the AVX-512 and AVX2 layouts, 32 and 16), so
// the short loops vectorise without a scalar remainder; 0: any block (the partial last one).
template <typename T, int64_t HALF>
inline void int4_column(const uint8_t* __restrict src, int64_t rows, bool split, const float* __restrict sb,
                        const float* __restrict ob, typename qs::Raw<T>::type* __restrict w) {
#if defined(QS_INT4_VEC)
  if constexpr (HALF == qs::Int4Vec::kHalf && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)) {
    if (split) {
      int4_split_full(src, sb, ob, w);
      return;
    }
  }
#endif
  const int64_t half = HALF > 0 ? HALF : rows / 2;
  if (split) {  // two single-stream loops: the compiler vectorises these, not one loop with both stores
    for (int64_t i = 0; i < half; ++i) w[i] = qs::Raw<T>::put(static_cast<float>(src[i] & 15) * sb[i] + ob[i]);
    for (int64_t i = 0; i < half; ++i)
      w[half + i] = qs::Raw<T>::put(static_cast<float>(src[i] >> 4) * sb[half + i] + ob[half + i]);
  } else {
    for (int64_t i = 0; i < half; ++i) {
      w[2 * i] = qs::Raw<T>::put(static_cast<float>(src[i] & 15) * sb[2 * i] + ob[2 * i]);
      w[2 * i + 1] = qs::Raw<T>::put(static_cast<float>(src[i] >> 4) * sb[2 * i + 1] + ob[2 * i + 1]);
    }
  }
}

// W^T's rows c0 .. c1 (columns of W), each written whole and in order along N, block after block: one
// sequential store stream per thread (a block-outer order wrote 128 bytes into each of K rows in turn, K streams
// the prefetchers do not follow). The reads are the blocks' column c, 16 or 32 bytes each, at a stride of the
// block's size. A group's scales and offsets z - 8 s (fp32, as the reference computes them) are expanded from sz
// (G, N, 2) into the thread's own rows when its columns enter the group, and reused by the group's columns.
template <typename T, typename S, int64_t HALF>
__attribute__((noinline)) void int4_rows(const uint8_t* __restrict packed, int64_t c0, int64_t c1, int64_t block,
                                         int64_t full, int64_t n, int64_t k, int64_t gs, const S* __restrict sz,
                                         const int64_t* __restrict perm, typename qs::Raw<T>::type* __restrict o) {
  const int64_t half = block / 2;
  std::vector<float> table(2 * n);
  float* __restrict sg = table.data();
  float* __restrict og = sg + n;
  int64_t loaded = -1;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t g = c / gs;
    if (g != loaded) {
      const S* row = sz + g * n * 2;
      for (int64_t r = 0; r < n; ++r) {
        sg[r] = qs::to_f(row[2 * r]);
        og[r] = qs::to_f(row[2 * r + 1]) - sg[r] * 8.0f;
      }
      loaded = g;
    }
    auto* __restrict w = o + (perm ? perm[c] : c) * n;
    int64_t r0 = 0;
    for (int64_t b = 0; b < full; ++b, r0 += block)
      int4_column<T, HALF>(packed + r0 * k / 2 + c * half, block, true, sg + r0, og + r0, w + r0);
    for (; r0 < n; r0 += block) {  // the interleaved blocks: all of them without split, else the partial last
      const int64_t rows = std::min(block, n - r0);
      int4_column<T, 0>(packed + r0 * k / 2 + c * (rows / 2), rows, false, sg + r0, og + r0, w + r0);
    }
  }
}

}  // namespace

// out_t (K, N) = W^T from the CPU int4pack layout: packed holds blocks of `block` rows (the last one may be
// partial and is then interleaved, as is every block when split is false), each (K, rows/2) bytes; sz (G, N, 2):
// scale and zero per group of group_size columns, any float dtype; perm (K,) int64 or empty: code column c is
// W's column perm[c], so it lands in out_t's row perm[c].
void dequant_int4pack(const at::Tensor& packed, int64_t n, int64_t k, int64_t block, bool split,
                      const at::Tensor& sz, int64_t group_size, const at::Tensor& perm, at::Tensor out_t) {
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == n * k / 2,
              "packed must be a contiguous CPU uint8 tensor of N * K / 2 bytes");
  TORCH_CHECK(n % 2 == 0 && block > 0 && block % 2 == 0, "N and the block must be even");
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "K must be a multiple of group_size");
  const int64_t G = k / group_size;
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == G && sz.size(1) == n && sz.size(2) == 2,
              "scales_zeros must be (K / group_size, N, 2)");
  const bool permuted = perm.numel() > 0;
  TORCH_CHECK(!permuted || (perm.dim() == 1 && perm.size(0) == k && perm.is_contiguous() &&
                            perm.scalar_type() == at::kLong),
              "perm must be a contiguous (K,) int64 tensor, or empty");
  check_out(out_t, k, n);
  const int64_t* pp = permuted ? perm.data_ptr<int64_t>() : nullptr;
  if (permuted) {
    for (int64_t c = 0; c < k; ++c) TORCH_CHECK(pp[c] >= 0 && pp[c] < k, "perm[", c, "] is outside K");
  }
  TORCH_CHECK(sz.is_contiguous(), "scales_zeros must be contiguous");
  const uint8_t* bp = packed.data_ptr<uint8_t>();
  const int64_t full = split ? n / block : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_t.scalar_type(), "dequant_int4pack", [&] {
    using T = scalar_t;
    auto* o = qs::raw(out_t.data_ptr<T>());
    const int64_t grain = std::max<int64_t>(1, kGrain / n);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "dequant_int4pack_table", [&] {
      const scalar_t* zp = sz.data_ptr<scalar_t>();
      at::parallel_for(0, k, grain, [&](int64_t c0, int64_t c1) {
        if (full > 0 && block == 64) {
          int4_rows<T, scalar_t, 32>(bp, c0, c1, block, full, n, k, group_size, zp, pp, o);
        } else if (full > 0 && block == 32) {
          int4_rows<T, scalar_t, 16>(bp, c0, c1, block, full, n, k, group_size, zp, pp, o);
        } else {
          int4_rows<T, scalar_t, 0>(bp, c0, c1, block, full, n, k, group_size, zp, pp, o);
        }
      });
    });
  });
}

TORCH_LIBRARY(quantserve_quant, m) {
  m.def("dequant_int8(Tensor q, Tensor scale, Tensor zero, Tensor(a!) out) -> ()");
  m.def("dequant_int4pack(Tensor packed, int n, int k, int block, bool split, Tensor scales_zeros, int group_size, "
        "Tensor perm, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(quantserve_quant, CPU, m) {
  m.impl("dequant_int8", &dequant_int8);
  m.impl("dequant_int4pack", &dequant_int4pack);
}
