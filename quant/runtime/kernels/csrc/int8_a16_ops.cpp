// int8 weights times int16 activations, for a few rows on AVX2: the `rows16` path of int8 weight-only Linears and
// of the int8 head (quant/runtime/int8.py, server/layers/embedding.py; loaded with the rows ops by
// quant/runtime/kernels/rows.py, held to the exact product in tests/test_rows.py).
//
// Why: int8_weight_rows (rows_ops.cpp) widens every weight to fp32 and multiplies it by an fp32 activation, eight
// products an instruction plus a widening and a conversion for each eight weights. Here each x row is first held as
// int16 in blocks of 32 columns with power-of-two scales (act_blocks.h quantize_row16, the int4 rows16 pass's
// activations: a bf16 element within 2^7 of its block's largest exactly), and each weight row widened to 16 bits is
// multiplied by vpmaddwd into 32-bit sums, sixteen products an instruction. Each lane of a block's sums holds four
// products, at most 4 * 128 * 32767 < 2^24, so it converts to fp32 exactly and is scaled exactly by the block's
// power of two: what rounds is the fp32 sum over the blocks, so the result is the exact product of x as held to
// within 2^-14 of its largest output, as rows16's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_blocks.h"
#include "balanced.h"
#include "elements.h"
#include "epilogue.h"
#include "int8_rescale.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace {

#if defined(QS_ACT_BLOCKS)
using qs::act::kBlock;

inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// R consecutive weight rows (int8, row stride k) times one x row held as int16 blocks (xq, d): out[i] = sum over
// blocks of d_b * (the block's exact lane sums), in fp32. The next R rows are fetched while these are summed (as
// rows_ops.cpp's dot4_i8: short row streams alone leave the hardware prefetchers behind).
template <int R>
inline void dot_a16(const int16_t* __restrict xq, const float* __restrict d, const int8_t* __restrict w, int64_t k,
                    float* __restrict out) {
  const int8_t* next = w + R * k;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < k; b0 += kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(next + R * b0), _MM_HINT_T0);
    if (R > 2) _mm_prefetch(reinterpret_cast<const char*>(next + R * b0 + 64), _MM_HINT_T0);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b0));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b0 + 16));
    const __m256 db = _mm256_set1_ps(d[b0 / kBlock]);
    for (int i = 0; i < R; ++i) {
      const int8_t* wr = w + i * k + b0;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16)));
      const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(x0, w0), _mm256_madd_epi16(x1, w1));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), db, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum8(acc[i]);
}
#endif

// out (M, N) = x (M, K) @ (s (q - z))^T + bias as int8_weight_rows computes it, (x . q) * s - rowsum(x) * offset
// in fp32, rounded once to x's dtype, with x held as quantize_row16 holds it (rowsum: the row as the product sees
// it). K a multiple of 32; x bf16, fp16 or fp32. A row that is not finite gives NaN, as the reference does.
at::Tensor int8_weight_rows16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& offset, const at::Tensor& bias) {
#if defined(QS_ACT_BLOCKS)
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU (M, K) tensor");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar &&
                  q.size(1) == x.size(1),
              "weight must be a contiguous CPU (N, K) int8 tensor with x's K");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "weight_scale must be a contiguous (N,) fp32 or bf16 tensor");
  for (const auto& [t, what] : {std::pair{&offset, "offset"}, std::pair{&bias, "bias"}})
    TORCH_CHECK(t->numel() == 0 || (t->dim() == 1 && t->size(0) == n && t->is_contiguous() &&
                                    t->scalar_type() == at::kFloat),
                what, " must be a contiguous (", n, ",) fp32 tensor, or empty");
  const float* off = offset.numel() ? offset.data_ptr<float>() : nullptr;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;  // a step that samples nothing calls the head on no rows
  std::vector<int16_t> xq(m * k);
  std::vector<float> d(m * (k / kBlock)), rowsum(m), xf(k);
  std::vector<char> finite(m);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_weight_rows16", [&] {
    using T = scalar_t;
    const auto* xr = qs::raw(x.data_ptr<T>());
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) xf[c] = qs::Raw<T>::get(xr[r * k + c]);
      finite[r] = qs::act::quantize_row16(xf.data(), k, k, xq.data() + r * k, d.data() + r * (k / kBlock),
                                          rowsum.data() + r);
    }
    const qs::Int8Rescale rescale(scale, off, bp);
    const int8_t* qp = q.data_ptr<int8_t>();
    auto* op = qs::raw(out.data_ptr<T>());
    const auto finish = [&](int64_t r, int64_t c, float dot) {
      op[r * n + c] = qs::Raw<T>::put(finite[r] ? rescale(c, dot, rowsum[r]) : std::numeric_limits<float>::quiet_NaN());
    };
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / (4 * m * k));
    qs::balanced_for((n + 3) / 4, grain, [&](int64_t b, int64_t e) {
      float acc[4];
      for (int64_t c = 4 * b; c < std::min(n, 4 * e); c += 4) {
        for (int64_t r = 0; r < m; ++r) {
          const int16_t* xs = xq.data() + r * k;
          const float* ds = d.data() + r * (k / kBlock);
          if (c + 4 <= n) {
            dot_a16<4>(xs, ds, qp + c * k, k, acc);
            for (int64_t i = 0; i < 4; ++i) finish(r, c + i, acc[i]);
          } else {
            for (int64_t i = c; i < n; ++i) dot_a16<1>(xs, ds, qp + i * k, k, acc), finish(r, i, acc[0]);
          }
        }
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "int8_weight_rows16 is built only for CPUs with AVX2 and without AVX-512");
#endif
}

// Whether this build holds the passes on 16-bit block activations (int8_weight_rows16, int4_rows_a16).
bool rows16_built() {
#if defined(QS_ACT_BLOCKS)
  return true;
#else
  return false;
#endif
}

QS_EPILOGUES(int8_weight_rows16,
             (const at::Tensor& x, const at::Tensor& q, const at::Tensor& w_scale, const at::Tensor& offset,
              const at::Tensor& bias),
             (x, q, w_scale, offset, bias))

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantserve_rows, m) {
  const std::string product = "int8_weight_rows16(Tensor x, Tensor weight, Tensor weight_scale, Tensor offset, "
                              "Tensor bias) -> Tensor";
  m.def(product.c_str());
  m.def(qs::epilogue_schema(product, "gated").c_str());
  m.def(qs::epilogue_schema(product, "normed").c_str());
  m.def("rows16_built() -> bool", &rows16_built);
}

TORCH_LIBRARY_IMPL(quantserve_rows, CPU, m) {
  m.impl("int8_weight_rows16", &int8_weight_rows16);
  m.impl("int8_weight_rows16_gated", &int8_weight_rows16_gated);
  m.impl("int8_weight_rows16_normed", &int8_weight_rows16_normed);
}
