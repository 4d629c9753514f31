// The block-diagonal normalized Walsh-Hadamard transform as every CPU kernel computes it (quant/runtime/kernels/
// csrc/rows_ops.cpp: a rotated W8A8 module's input; server/csrc/kv_rows.h: the int8 KV cache's keys), the same chain
// of sums as quant.runtime.hadamard's PyTorch butterfly, so all agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

namespace qs {

// x (k,) times the block-diagonal normalized Hadamard transform, blocks of `block` (a power of two) in place: the
// butterfly, log2(block) passes of sums and differences (the pass with stride 1 first), then the 1 / sqrt(block)
// scale rounded to T. Each value is the same chain of exactly rounded sums wherever it is computed, so this op, the
// rows pass and quant.runtime.hadamard's PyTorch butterfly agree bit for bit.
template <typename T>
void hadamard_blocks(T* __restrict x, int64_t k, int64_t block) {
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int64_t b = 0; b < k; b += block) {
    T* v = x + b;
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t i = 0; i < block; i += 2 * h)
#pragma omp simd
        for (int64_t j = i; j < i + h; ++j) {
          const T a = v[j], c = v[j + h];
          v[j] = a + c;
          v[j + h] = a - c;
        }
    for (int64_t j = 0; j < block; ++j) v[j] *= scale;
  }
}

}  // namespace qs
