// Weight dequantizers for the runtime Linears' dequantize-then-matmul paths (quant/layers.py, quant/int4.py; loaded
// by quant/dequant.py, where each has its PyTorch reference, and tests hold the two together bit for bit).
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

// One output row of an int4pack block: the K codes of row `j` of a block of `rows` rows stored as (K, rows/2)
// bytes, with nibble layout `split` (row j in the low nibble of byte j and row j + rows/2 in the high nibble of
// byte j) or interleaved (rows 2i and 2i + 1 in the low and high nibble of byte i). w = (code - 8) * s + z as
// code * s + (z - 8 s), per group of `gs` columns (s, z: this row's (G,) scales and zeros, as floats), the
// result at column perm[c] (perm null: c).
template <typename T>
__attribute__((noinline)) void int4_row(const uint8_t* __restrict block, int64_t rows, int64_t j, bool split,
                                        int64_t k, int64_t gs, const float* __restrict s, const float* __restrict z,
                                        const int64_t* __restrict perm, typename qs::Raw<T>::type* __restrict o,
                                        float* __restrict tmp) {
  const int64_t stride = rows / 2;
  const int64_t byte = split ? (j < stride ? j : j - stride) : j / 2;
  const int shift = split ? (j < stride ? 0 : 4) : (j % 2) * 4;
  for (int64_t g = 0; g < k / gs; ++g) {
    const float sc = s[g], off = z[g] - 8.0f * sc;
    for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
      const float code = static_cast<float>((block[c * stride + byte] >> shift) & 15);
      tmp[c] = code * sc + off;
    }
  }
  if (perm == nullptr) {
    for (int64_t c = 0; c < k; ++c) o[c] = qs::Raw<T>::put(tmp[c]);
  } else {
    for (int64_t c = 0; c < k; ++c) o[perm[c]] = qs::Raw<T>::put(tmp[c]);
  }
}

}  // namespace

// out (N, K) from the CPU int4pack layout: packed holds blocks of `block` rows (the last one may be partial and is
// then interleaved, as is every block when split is false), each (K, rows/2) bytes; sz (G, N, 2): scale and zero
// per group of group_size columns, any float dtype; perm (K,) int64 or empty: code column c is W's column perm[c].
void dequant_int4pack(const at::Tensor& packed, int64_t n, int64_t k, int64_t block, bool split,
                      const at::Tensor& sz, int64_t group_size, const at::Tensor& perm, at::Tensor out) {
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
  check_out(out, n, k);
  const int64_t* pp = permuted ? perm.data_ptr<int64_t>() : nullptr;
  if (permuted) {
    for (int64_t c = 0; c < k; ++c) TORCH_CHECK(pp[c] >= 0 && pp[c] < k, "perm[", c, "] is outside K");
  }
  const at::Tensor tables = sz.to(at::kFloat).permute({1, 2, 0}).contiguous();  // (N, 2, G): scales, then zeros
  const float* tp = tables.data_ptr<float>();
  const uint8_t* bp = packed.data_ptr<uint8_t>();
  const int64_t full = split ? n / block : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequant_int4pack", [&] {
    auto* op = qs::raw(out.data_ptr<scalar_t>());
    at::parallel_for(0, n, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, k)), [&](int64_t b, int64_t e) {
      std::vector<float> tmp(k);
      for (int64_t r = b; r < e; ++r) {
        const int64_t r0 = r / block * block;  // the first row of r's block (full blocks come first)
        const int64_t rows = std::min(block, n - r0);
        const bool sp = split && r < full * block;
        int4_row<scalar_t>(bp + r0 * k / 2, rows, r - r0, sp, k, group_size, tp + r * 2 * G, tp + r * 2 * G + G, pp,
                           op + r * k, tmp.data());
      }
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
