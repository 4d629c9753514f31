// The int8 weight-only passes' rescale of one output (rows_ops.cpp int8_weight_rows, int8_a16_ops.cpp
// int8_weight_rows16): dot * s - rowsum(x) * offset (+ bias), in fp32, in that order; s fp32 or bf16 (an int8
// head's scales, as int8pack takes them), offset (s * z) and bias fp32 or absent.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "elements.h"

namespace qs {

struct Int8Rescale {
  const float* s32 = nullptr;
  const uint16_t* s16 = nullptr;
  const float* offset;
  const float* bias;

  Int8Rescale(const at::Tensor& scale, const float* offset_, const float* bias_) : offset(offset_), bias(bias_) {
    if (scale.scalar_type() == at::kFloat)
      s32 = scale.data_ptr<float>();
    else
      s16 = raw(scale.data_ptr<c10::BFloat16>());
  }

  float operator()(int64_t c, float dot, float rowsum) const {
    float y = dot * (s32 != nullptr ? s32[c] : Raw<c10::BFloat16>::get(s16[c]));
    if (offset != nullptr) y = y - rowsum * offset[c];
    if (bias != nullptr) y = y + bias[c];
    return y;
  }
};

}  // namespace qs
