// How the attention kernels (attention_ops.cpp) read one KV head's K and V rows from the paged cache, and how
// kv_cache_ops.cpp writes quantized ones: the cache of the model's dtype as it is, or codes with a float16 scale
// per token per KV head (quant/runtime/kv_quant.py's int8 and fp8 formats), dequantized as a row is loaded into
// the kernel's fp32 registers and stack row: no full-precision copy of the cache is ever made.
//
// A row's value is code * scale in fp32, exactly quant/runtime/kv_quant.py's round trip (a code of at most 8
// significant bits times a float16 scale is exact in fp32). With a key rotation block b > 0 (the int8 format), keys
// are stored rotated, H k with H the normalized block Walsh-Hadamard transform over head_dim (QuaRot: it spreads a
// key's outlier channels before one scale covers them), and the kernels rotate each query the same way: H is
// orthonormal, so (H q) . (H k) = q . k. With a value rotation block, values are stored as H v and the kernels
// rotate each output row back: H is its own inverse and sum_j p_j H v_j = H sum_j p_j v_j.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "elements.h"
#include "hadamard.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

namespace qs {

// Asks for the cache lines of n bytes.
inline void prefetch_bytes(const void* row, int64_t n) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// A cache of the model's dtype T. k and v point at this KV head's element 0 of slot 0; a slot is `stride`
// elements further.
template <typename T>
struct FloatRows {
  using R = typename Raw<T>::type;
  static constexpr bool kQuantized = false;
  static constexpr int64_t key_block = 0;
  static constexpr int64_t value_block = 0;
  const R* k;
  const R* v;
  int64_t stride;

  FloatRows at_head(int64_t h, int64_t D) const { return {k + h * D, v + h * D, stride}; }
  void load_k(int64_t slot, float* __restrict dst, int64_t D) const { load(k + slot * stride, dst, D); }
  void load_v(int64_t slot, float* __restrict dst, int64_t D) const { load(v + slot * stride, dst, D); }
  void prefetch(int64_t slot, int64_t D) const {
    prefetch_bytes(k + slot * stride, D * sizeof(R));
    prefetch_bytes(v + slot * stride, D * sizeof(R));
  }
  static void load(const R* __restrict src, float* __restrict dst, int64_t D) {
    for (int64_t d = 0; d < D; ++d) dst[d] = Raw<T>::get(src[d]);
  }
};

// int8 codes: the value is the code.
struct Int8Code {
  using C = int8_t;
  static constexpr float kMax = 127.f;
  static float value(int8_t c) { return static_cast<float>(c); }
  // x / scale to the nearest code (ties to even, as torch.round), within [-127, 127]
  static int8_t encode(float x) { return static_cast<int8_t>(std::nearbyint(std::clamp(x, -kMax, kMax))); }
};

// fp8 e4m3 (finite, no infinities) bits: the value by a table of the 256 codes; encoded as c10 converts.
struct Fp8Code {
  using C = uint8_t;
  static constexpr float kMax = 448.f;
  static const std::array<float, 256>& table() {
    static const std::array<float, 256> t = [] {
      std::array<float, 256> a{};
      for (int i = 0; i < 256; ++i) a[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
      return a;
    }();
    return t;
  }
  static uint8_t encode(float x) { return c10::Float8_e4m3fn(std::clamp(x, -kMax, kMax)).x; }
};

// Codes with a float16 scale per token per KV head. k, v: this head's code 0 of slot 0 (a slot is `stride` codes
// further); ks, vs: this head's scale of slot 0 (a slot is `sstride` scales further).
template <typename Code>
struct QuantRows {
  using C = typename Code::C;
  static constexpr bool kQuantized = true;
  const C* k;
  const C* v;
  const c10::Half* ks;
  const c10::Half* vs;
  int64_t stride, sstride;
  int64_t key_block;    // > 0: keys stored rotated in blocks of this many channels; the kernels rotate q to match
  int64_t value_block;  // > 0: values stored rotated; the kernels rotate each output row back

  QuantRows at_head(int64_t h, int64_t D) const {
    return {k + h * D, v + h * D, ks + h, vs + h, stride, sstride, key_block, value_block};
  }
  void load_k(int64_t slot, float* __restrict dst, int64_t D) const {
    load(k + slot * stride, static_cast<float>(ks[slot * sstride]), dst, D);
  }
  void load_v(int64_t slot, float* __restrict dst, int64_t D) const {
    load(v + slot * stride, static_cast<float>(vs[slot * sstride]), dst, D);
  }
  void prefetch(int64_t slot, int64_t D) const {
    prefetch_bytes(k + slot * stride, D);
    prefetch_bytes(v + slot * stride, D);
  }
  static void load(const C* __restrict src, float s, float* __restrict dst, int64_t D) {
    if constexpr (std::is_same_v<Code, Int8Code>) {
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
    } else {
      const float* t = Code::table().data();
      for (int64_t d = 0; d < D; ++d) dst[d] = t[src[d]] * s;
    }
  }
};

// The float16 scale of a row whose largest magnitude is amax: amax / Code::kMax, at least 2^-14 (an all-zero row
// stays zero whatever its scale), rounded to float16; as kv_quant's _half.
template <typename Code>
inline c10::Half row_scale(float amax) {
  return c10::Half(std::max(amax / Code::kMax, 6.103515625e-05f));
}

// One row x (D,) of dtype T quantized into codes and its scale, rotated first in fp32 when rotate > 0 (the int8
// format's keys and values). work: D floats.
template <typename T, typename Code>
inline void quantize_row(const typename Raw<T>::type* __restrict x, typename Code::C* __restrict codes,
                         c10::Half* scale, int64_t D, int64_t rotate, float* __restrict work) {
  for (int64_t d = 0; d < D; ++d) work[d] = Raw<T>::get(x[d]);
  if (rotate > 0) hadamard_blocks(work, D, rotate);
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(work[d]));
  const c10::Half s = row_scale<Code>(amax);
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d) codes[d] = Code::encode(work[d] / sf);
  *scale = s;
}

// A rotation block is 0 (none) or a power of two >= 2 dividing head_dim D.
inline bool valid_rotation(int64_t block, int64_t D) {
  return block == 0 || (block >= 2 && (block & (block - 1)) == 0 && D % block == 0);
}

}  // namespace qs
