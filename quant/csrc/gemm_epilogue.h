// What the tiled products (gemm_ops.cpp) do to a block's fp32 sums before rounding them to bf16: y = sum (* row_scale[r]
// * col_scale[c], W8A8's rescale) (+ bias[c]). Pointers at the block's first row and column; null: not applied.
#pragma once

#include <cstdint>

namespace qs::gemm {

struct Epilogue {
  const float* bias = nullptr;
  const float* row_scale = nullptr;  // set together with col_scale
  const float* col_scale = nullptr;

  Epilogue at(int64_t m0, int64_t c0) const {
    return {bias ? bias + c0 : nullptr, row_scale ? row_scale + m0 : nullptr, col_scale ? col_scale + c0 : nullptr};
  }
};

}  // namespace qs::gemm
