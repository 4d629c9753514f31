// What the tiled products' kernels (gemm_avx512.h, gemm_avx2.h) share, beside the driver in gemm_ops.cpp.
#pragma once

#include <cstdint>

#include "elements.h"

namespace qs::gemm {

// What the driver does to a block's fp32 sums before rounding them to bf16: y = sum (* row_scale[r] *
// col_scale[c], W8A8's rescale, the product first as W8A8Linear._finish; * col_scale[c] without row_scale: an int8
// weight's scales, kept out of AVX2's tiles) (+ bias[c]). Pointers at the block's first row and column; null: not
// applied.
struct Epilogue {
  const float* bias = nullptr;
  const float* row_scale = nullptr;  // only with col_scale
  const float* col_scale = nullptr;
  const int32_t* col_offset = nullptr;  // integer sums only: subtracted first (the VNNI kernel's 128 * sum(q))

  Epilogue at(int64_t m0, int64_t c0) const {
    return {bias ? bias + c0 : nullptr, row_scale ? row_scale + m0 : nullptr, col_scale ? col_scale + c0 : nullptr,
            col_offset ? col_offset + c0 : nullptr};
  }
};

// The scales and offsets z - 8 s of `rows` consecutive rows of W from group g of the int4 (G, N, 2) (scale, zero)
// table, in fp32 as the dequantizer computes them (the product rounds, then the difference).
template <typename S>
inline void group_scales(const S* sz, int64_t g, int64_t n, int64_t r0, int64_t rows, float* s, float* off) {
  const S* row = sz + (g * n + r0) * 2;
  for (int64_t r = 0; r < rows; ++r) {
    s[r] = qs::to_f(row[2 * r]);
    off[r] = qs::to_f(row[2 * r + 1]) - s[r] * 8.0f;
  }
}

// Asks for bytes [off, off + len) of each of `rows` rows (row stride `stride` bytes) from `base` into L2: a tile's
// codes from a row-major weight (a row's bytes need not start on a line, so its last byte is asked for too).
inline void prefetch_rows(const void* base, int64_t rows, int64_t stride, int64_t off, int64_t len) {
  const char* first = static_cast<const char*>(base) + off;
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = first + r * stride;
    for (int64_t i = 0; i < len; i += 64) __builtin_prefetch(p + i, 0, 2);
    __builtin_prefetch(p + len - 1, 0, 2);
  }
}

}  // namespace qs::gemm
