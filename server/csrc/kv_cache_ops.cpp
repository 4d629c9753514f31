// The write of a quantized KV cache (the sdpa backend's store for --kv-dtype int8 / fp8; server/fastops.py loads
// it with the glue and attention ops and holds it to ref_store_kv_quant): each token's K and V of each KV head
// quantized to codes with a float16 scale (qs::quantize_row, quant/runtime/kv_quant.py's round trip), written to
// its slot. Slots are checked before anything is written.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "elements.h"
#include "kv_rows.h"

using qs::Raw;
using qs::raw;

namespace {

template <typename T, typename Code>
void store_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& codes, at::Tensor& scales, const int64_t* sp,
                int64_t key_block, int64_t value_block) {
  using R = typename Raw<T>::type;
  using C = typename Code::C;
  const int64_t T_ = k.size(0), Hkv = codes.size(2), D = codes.size(3), nslots = codes.size(1);
  const R* src[2] = {raw(k.data_ptr<T>()), raw(v.data_ptr<T>())};
  const int64_t st[2] = {k.stride(0), v.stride(0)};
  C* cp = reinterpret_cast<C*>(codes.data_ptr());
  c10::Half* sc = scales.data_ptr<c10::Half>();
  at::parallel_for(0, T_, std::max<int64_t>(1, 4096 / (2 * Hkv * D)), [&](int64_t b, int64_t e) {
    std::vector<float> work(D);
    for (int64_t t = b; t < e; ++t)
      for (int64_t which = 0; which < 2; ++which)
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t row = (which * nslots + sp[t]) * Hkv + h;
          qs::quantize_row<T, Code>(src[which] + t * st[which] + h * D, cp + row * D, sc + row, D,
                                    which == 0 ? key_block : value_block, work.data());
        }
  });
}

}  // namespace

// k and v (T, Hkv, D) of the model's dtype, heads contiguous, rows possibly strided, quantized into their slots of
// one layer's cache: codes (2, slots, Hkv, D) int8 or float8_e4m3fn, scales (2, slots, Hkv) float16. key_block > 0
// (value_block > 0): each key (value) rotated by the normalized Walsh-Hadamard transform in blocks of that many
// channels before it is quantized.
void store_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor codes, at::Tensor scales,
                    const at::Tensor& slots, int64_t key_block, int64_t value_block) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == 2 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kFloat8_e4m3fn),
              "codes must be a contiguous (2, slots, Hkv, D) int8 or float8_e4m3fn tensor");
  const int64_t T = k.size(0), Hkv = codes.size(2), D = codes.size(3), nslots = codes.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.size(0) == 2 && scales.size(1) == nslots && scales.size(2) == Hkv,
              "scales must be a contiguous (2, slots, Hkv) float16 tensor matching codes");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == D && t->scalar_type() == k.scalar_type(),
                "k and v must be (T, Hkv, D) with contiguous heads, of one dtype");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous (T,) int64 tensor");
  TORCH_CHECK(qs::valid_rotation(key_block, D), "key_block must be 0 or a power of two >= 2 dividing head_dim, got ",
              key_block);
  TORCH_CHECK(qs::valid_rotation(value_block, D),
              "value_block must be 0 or a power of two >= 2 dividing head_dim, got ", value_block);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "slot ", sp[t], " is outside the cache");
  const bool fp8 = codes.scalar_type() == at::kFloat8_e4m3fn;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv_quant", [&] {
    if (fp8)
      store_rows<scalar_t, qs::Fp8Code>(k, v, codes, scales, sp, key_block, value_block);
    else
      store_rows<scalar_t, qs::Int8Code>(k, v, codes, scales, sp, key_block, value_block);
  });
}

TORCH_LIBRARY_FRAGMENT(quantserve, m) {
  m.def("store_kv_quant(Tensor k, Tensor v, Tensor(a!) codes, Tensor(b!) scales, Tensor slots, int key_block, "
        "int value_block) -> ()");
}

TORCH_LIBRARY_IMPL(quantserve, CPU, m) { m.impl("store_kv_quant", &store_kv_quant); }
