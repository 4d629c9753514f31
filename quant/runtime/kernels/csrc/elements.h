// Elements of a float dtype as the CPU kernels' vectorised loops read and write them (server/csrc/decode_ops.cpp,
// quant/runtime/kernels/csrc/dequant_ops.cpp). Built with quant/runtime/kernels/native.py, which puts this directory on the include path.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace qs {

// Conversions between the storage dtype and float. bf16 is converted by hand, branch-free (c10's rounding
// branches on NaN, which keeps a loop from vectorising); the results are c10's, bit for bit.
template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }
template <>
inline float to_f(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 rnd(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // to nearest even
  return c10::BFloat16((u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
}

// A dtype's elements as the vectorised loops read and write them: bf16 as its raw 16 bits (the compiler does
// not vectorise loads of c10::BFloat16 itself), converted as to_f / rnd do.
template <typename T>
struct Raw {
  using type = T;
  static float get(T v) { return to_f(v); }
  static T put(float v) { return rnd<T>(v); }
};
template <>
struct Raw<c10::BFloat16> {
  using type = uint16_t;
  static float get(uint16_t v) { return to_f(c10::BFloat16(v, c10::BFloat16::from_bits())); }
  static uint16_t put(float v) { return rnd<c10::BFloat16>(v).x; }
};
template <typename T>
const typename Raw<T>::type* raw(const T* p) { return reinterpret_cast<const typename Raw<T>::type*>(p); }
template <typename T>
typename Raw<T>::type* raw(T* p) { return reinterpret_cast<typename Raw<T>::type*>(p); }

}  // namespace qs
