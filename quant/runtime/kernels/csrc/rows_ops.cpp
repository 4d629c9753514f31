// Whole int8, int4 and bf16 Linears for a few rows (batch-1 and small-batch decode) in one call each (quant/runtime/linear.py,
// quant/runtime/int4.py; loaded by quant/runtime/kernels/rows.py, where each has its PyTorch counterpart, and tests hold them together).
//
// Why: at a few rows a quantized Linear reads N x K int8 weight bytes once, half the bytes of a bf16 one, but its
// eager form is a chain of small ATen ops (W8A8: smooth, abs, amax, divide, clamp, divide, round, clamp, convert,
// product, two products and a sum for the rescale, convert; ~12 calls of a few µs each), and on a CPU without
// VNNI ``torch._int_mm`` runs a 1-row product 60x slower than a bf16 one. A model of 30 layers makes ~200 such
// calls per token: the calls, not the bytes, set the speed. Here the quantization of x, the product and the
// rescale are one op, the product one pass over W, parallel over its rows.
//
// w8a8_rows computes what the `_int_mm` path computes, bit for bit: the activations quantized in fp32 as
// quant.runtime.primitives does (division, round half to even, clamp), exact int32 sums, and the fp32 rescale in the same
// order. A rotated module's input (quant.runtime.hadamard) is transformed here by the fast Walsh-Hadamard butterfly, the
// same sums in the same order as the module's other paths (the hadamard_ op below), so still bit for bit. int8_weight_rows computes x @ (s (q - z))^T as (x . q) s - rowsum(x) s z in fp32, rounded once; its sums
// are in another order than ATen's int8pack kernel (which rounds to the activation dtype before the correction),
// so it is held to the module's fp32 reference, as that kernel is; int8_weight_rows16 computes the same on x held as
// int16 blocks (act_blocks.h), the integer products sixteen an instruction. int4_rows reads the CPU int4pack layout
// itself (no dequantized W), also in fp32 and rounded once, and is held to the reference the same way.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_blocks.h"
#include "balanced.h"
#include "elements.h"
#include "epilogue.h"
#include "hadamard.h"
#include "int4_vec.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "gemm_avx2.h"  // qs::gemm::store_rows
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 16;  // multiply-adds per task: below this a call stays on one thread

int64_t grain_rows(int64_t per_row) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, per_row)); }

#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // the eight lanes' sum
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

// x, the int8 weight and its scales (the bias and other optional vectors: optional_f32).
void check_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool bf16_scale = false) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU (M, K) tensor");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar &&
                  w.size(1) == x.size(1),
              "weight must be a contiguous CPU (N, K) int8 tensor with x's K");
  const int64_t n = w.size(0);
  const bool dtype_ok = scale.scalar_type() == at::kFloat || (bf16_scale && scale.scalar_type() == at::kBFloat16);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous() && dtype_ok,
              "weight_scale must be a contiguous (N,) fp32 tensor", bf16_scale ? " (or bf16)" : "");
}

const float* optional_f32(const at::Tensor& t, int64_t n, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == at::kFloat, what,
              " must be a contiguous (", n, ",) fp32 tensor, or empty");
  return t.data_ptr<float>();
}

// One row of x as fp32, divided by the smoothing divisor where there is one.
template <typename T>
void row_f32(const typename qs::Raw<T>::type* __restrict x, const float* __restrict smooth, float* __restrict o,
             int64_t k) {
  for (int64_t j = 0; j < k; ++j) o[j] = qs::Raw<T>::get(x[j]);
  if (smooth)
    for (int64_t j = 0; j < k; ++j) o[j] = o[j] / smooth[j];
}

// Whether `block` can rotate k channels: a power of two >= 2 dividing k (quant.runtime.hadamard.is_block).
bool is_block(int64_t k, int64_t block) { return block >= 2 && (block & (block - 1)) == 0 && k % block == 0; }

// Four weight rows against one x row at once: four independent sums and x read once per four rows. x comes widened
// to int16, and each weight row is widened in registers, so that a 16-bit multiply-add with 32-bit sums does the
// work (vpmaddwd; vpdpwssd with AVX-512 VNNI): written with intrinsics because the compiler's vectoriser instead
// multiplies in 32 bits. Integer sums are exact, so the order does not matter.
#if defined(__AVX512BW__)
inline __m512i madd(__m512i acc, __m512i x, const int8_t* w) {
  const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w16);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w16));
#endif
}
constexpr int64_t kLanes = 32;  // int16 values per vector
#elif defined(__AVX2__)
inline __m256i madd(__m256i acc, __m256i x, const int8_t* w) {
  const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w16));
}
constexpr int64_t kLanes = 16;
#endif

void dot4_i8(const int16_t* __restrict a, const int8_t* __restrict w, int64_t k, int32_t* __restrict out) {
  const int8_t* __restrict ws[4] = {w, w + k, w + 2 * k, w + 3 * k};
  // The next four rows, 4 k contiguous bytes, fetched while these are summed (4 x the lanes' bytes per step):
  // the four short row streams alone leave the hardware prefetchers behind (a cold 3072 x 576 weight read at
  // ~half the bandwidth a bf16 one is).
  const int8_t* next = w + 4 * k;
  int64_t j = 0;
#if defined(__AVX512BW__)
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (; j + kLanes <= k; j += kLanes) {
    __builtin_prefetch(next + 4 * j), __builtin_prefetch(next + 4 * j + 64);
    const __m512i x = _mm512_loadu_si512(a + j);
    s0 = madd(s0, x, ws[0] + j), s1 = madd(s1, x, ws[1] + j), s2 = madd(s2, x, ws[2] + j), s3 = madd(s3, x, ws[3] + j);
  }
  out[0] = _mm512_reduce_add_epi32(s0), out[1] = _mm512_reduce_add_epi32(s1);
  out[2] = _mm512_reduce_add_epi32(s2), out[3] = _mm512_reduce_add_epi32(s3);
#elif defined(__AVX2__)
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (; j + kLanes <= k; j += kLanes) {
    __builtin_prefetch(next + 4 * j), __builtin_prefetch(next + 4 * j + 64);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j));
    s0 = madd(s0, x, ws[0] + j), s1 = madd(s1, x, ws[1] + j), s2 = madd(s2, x, ws[2] + j), s3 = madd(s3, x, ws[3] + j);
  }
  const auto hsum = [](__m256i v) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
  };
  out[0] = hsum(s0), out[1] = hsum(s1), out[2] = hsum(s2), out[3] = hsum(s3);
#else
  out[0] = out[1] = out[2] = out[3] = 0;
#endif
  for (; j < k; ++j)
    for (int i = 0; i < 4; ++i) out[i] += a[j] * static_cast<int32_t>(ws[i][j]);
}

int32_t dot_i8(const int16_t* __restrict a, const int8_t* __restrict b, int64_t k) {
  int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < k; ++j) acc += a[j] * static_cast<int16_t>(b[j]);
  return acc;
}

// The weight-only product, four weight rows against one fp32 x row, with fused multiply-adds (this sum is held to
// a tolerance, not to bits), the next four rows prefetched as in dot4_i8, and intrinsics for the same reason.
void dot4_f32_i8(const float* __restrict a, const int8_t* __restrict w, int64_t k, float* __restrict out) {
  const int8_t* __restrict ws[4] = {w, w + k, w + 2 * k, w + 3 * k};
  const int8_t* next = w + 4 * k;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; j + 16 <= k; j += 16) {
    __builtin_prefetch(next + 4 * j);
    const __m512 x = _mm512_loadu_ps(a + j);
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws[i] + j));
      s[i] = _mm512_fmadd_ps(x, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s[i]);
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = _mm512_reduce_add_ps(s[i]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; j + 8 <= k; j += 8) {
    if ((j & 15) == 0) __builtin_prefetch(next + 4 * j);
    const __m256 x = _mm256_loadu_ps(a + j);
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ws[i] + j));
      s[i] = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s[i]);
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = hsum8(s[i]);
#else
  out[0] = out[1] = out[2] = out[3] = 0.f;
#endif
  for (; j < k; ++j)
    for (int i = 0; i < 4; ++i) out[i] = std::fma(a[j], static_cast<float>(ws[i][j]), out[i]);
}

float dot_f32_i8(const float* __restrict a, const int8_t* __restrict b, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < k; ++j) acc = std::fma(a[j], static_cast<float>(b[j]), acc);
  return acc;
}

float sum_f32(const float* __restrict a, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < k; ++j) acc += a[j];
  return acc;
}

// (m, K / gs) each fp32 x row's sums over its groups of gs columns: the factor of the zero-point term in the int4
// kernels that take them precomputed.
std::vector<float> group_sums(const float* xf, int64_t m, int64_t k, int64_t gs) {
  const int64_t G = k / gs;
  std::vector<float> out(m * G);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < G; ++g) out[r * G + g] = sum_f32(xf + r * k + g * gs, gs);
  return out;
}

// The int8 weight-only passes' rescale of one output (int8_weight_rows, int8_weight_rows16): dot * s - rowsum(x) *
// offset (+ bias), in fp32, in that order; s fp32 or bf16 (an int8 head's scales, as int8pack takes them), offset
// (s * z) and bias fp32 or absent.
struct Int8Rescale {
  const float* s32 = nullptr;
  const uint16_t* s16 = nullptr;
  const float* offset;
  const float* bias;

  Int8Rescale(const at::Tensor& scale, const float* offset_, const float* bias_) : offset(offset_), bias(bias_) {
    if (scale.scalar_type() == at::kFloat)
      s32 = scale.data_ptr<float>();
    else
      s16 = qs::raw(scale.data_ptr<c10::BFloat16>());
  }

  float operator()(int64_t c, float dot, float rowsum) const {
    float y = dot * (s32 != nullptr ? s32[c] : qs::Raw<c10::BFloat16>::get(s16[c]));
    if (offset != nullptr) y = y - rowsum * offset[c];
    if (bias != nullptr) y = y + bias[c];
    return y;
  }
};

#if defined(QS_ACT_BLOCKS)
using qs::act::kBlock;

// R consecutive weight rows (int8, row stride k) times one x row held as int16 blocks (xq, d): out[i] = sum over
// blocks of d_b * (the block's exact lane sums), in fp32. The next R rows are fetched while these are summed (as
// dot4_i8: short row streams alone leave the hardware prefetchers behind).
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

// Every (x row, W row) pair of an (M, K) x (N, K)^T product, four W rows at a time, parallel over W's rows:
// dot4(r, c, acc) sums x row r against W rows c .. c + 3, dot1(r, c) against the one row c (the last, fewer than
// four), and finish(r, c, sum) writes output (r, c).
template <typename Acc, typename Dot4, typename Dot1, typename Finish>
void four_rows(int64_t m, int64_t n, int64_t k, const Dot4& dot4, const Dot1& dot1, const Finish& finish) {
  qs::balanced_for((n + 3) / 4, grain_rows(4 * m * k), [&](int64_t b, int64_t e) {
    Acc acc[4];
    for (int64_t c = 4 * b; c < std::min(n, 4 * e); c += 4) {
      for (int64_t r = 0; r < m; ++r) {
        if (c + 4 <= n) {
          dot4(r, c, acc);
          for (int64_t i = 0; i < 4; ++i) finish(r, c + i, acc[i]);
        } else {
          for (int64_t i = c; i < n; ++i) finish(r, i, dot1(r, i));
        }
      }
    }
  });
}

}  // namespace

// out (M, N) = the W8A8 Linear of x (M, K): x (divided by smooth (K,) where given, then rotated in blocks of
// `rotate` where it is not 0) quantized per row (dynamic:
// input_scale empty; s = max(amax|x| / qmax, min_scale)) or by the 0-dim input_scale, times the int8 weight (N, K),
// rescaled by s_x * weight_scale (N,) in fp32, plus bias (N,) fp32 where given, rounded to x's dtype.
at::Tensor w8a8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                     const at::Tensor& input_scale, const at::Tensor& smooth, const at::Tensor& bias, double qmax,
                     double min_scale, int64_t rotate) {
  check_rows(x, w, w_scale);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(rotate == 0 || is_block(k, rotate), "rotate must be 0 or a power of two dividing K");
  at::Tensor out = at::empty({m, n}, x.options());
  const bool dynamic = input_scale.numel() == 0;
  TORCH_CHECK(dynamic || (input_scale.dim() == 0 && input_scale.scalar_type() == at::kFloat),
              "input_scale must be a 0-dim fp32 tensor, or empty (dynamic)");
  const float* sm = optional_f32(smooth, k, "smooth_scale");
  const float* bp = optional_f32(bias, n, "bias");
  const float qm = static_cast<float>(qmax), floor_s = static_cast<float>(min_scale);
  std::vector<int16_t> xq(m * k);  // the int8 values, widened (see dot4_i8)
  std::vector<float> xs(m);
  std::vector<float> xf(k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "w8a8_rows", [&] {
    const auto* xp = qs::raw(x.data_ptr<scalar_t>());
    for (int64_t r = 0; r < m; ++r) {  // quant.runtime.primitives.quantize_act_dynamic / _static, in the same fp32 steps
      row_f32<scalar_t>(xp + r * k, sm, xf.data(), k);
      if (rotate) qs::hadamard_blocks(xf.data(), k, rotate);
      float s;
      if (dynamic) {
        float amax = 0.f;
        bool nan = false;  // torch's amax propagates NaN (a NaN scale, a NaN output row); std::max would drop it
        for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(xf[j])), nan |= std::isnan(xf[j]);
        s = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax / qm, floor_s);
      } else {
        s = input_scale.item<float>();
      }
      xs[r] = s;
      int16_t* q = xq.data() + r * k;
      for (int64_t j = 0; j < k; ++j) {  // NaN (x or s) -> 0: a defined code, the row's rescale by s is NaN anyway
        const float v = std::clamp(std::nearbyint(xf[j] / s), -qm, qm);
        q[j] = std::isnan(v) ? int16_t{0} : static_cast<int16_t>(v);
      }
    }
    const float* ws = w_scale.data_ptr<float>();
    const int8_t* wp = w.data_ptr<int8_t>();
    auto* op = qs::raw(out.data_ptr<scalar_t>());
    const auto finish = [&](int64_t r, int64_t c, int32_t acc) {  // _finish: acc * (s_x * s_w) + bias, rounded
      float y = static_cast<float>(acc) * (xs[r] * ws[c]);
      if (bp) y = y + bp[c];
      op[r * n + c] = qs::Raw<scalar_t>::put(y);
    };
    four_rows<int32_t>(
        m, n, k, [&](int64_t r, int64_t c, int32_t* acc) { dot4_i8(xq.data() + r * k, wp + c * k, k, acc); },
        [&](int64_t r, int64_t c) { return dot_i8(xq.data() + r * k, wp + c * k, k); }, finish);
  });
  return out;
}

// out (M, N) = x (M, K) @ (s (q - z))^T + bias: (x . q) * s - rowsum(x) * offset (s: (N,) fp32 or bf16; offset (N,)
// = s * z, fp32, or empty when symmetric), in fp32, rounded once to x's dtype.
at::Tensor int8_weight_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const at::Tensor& offset, const at::Tensor& bias) {
  check_rows(x, q, scale, /*bf16_scale=*/true);
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* off = optional_f32(offset, n, "offset");
  const float* bp = optional_f32(bias, n, "bias");
  std::vector<float> xf(m * k);
  std::vector<float> rows(m, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_weight_rows", [&] {
    const auto* xp = qs::raw(x.data_ptr<scalar_t>());
    for (int64_t r = 0; r < m; ++r) {
      row_f32<scalar_t>(xp + r * k, nullptr, xf.data() + r * k, k);
      if (off) rows[r] = sum_f32(xf.data() + r * k, k);
    }
    const Int8Rescale rescale(scale, off, bp);
    const int8_t* qp = q.data_ptr<int8_t>();
    auto* op = qs::raw(out.data_ptr<scalar_t>());
    const auto finish = [&](int64_t r, int64_t c, float dot) {
      op[r * n + c] = qs::Raw<scalar_t>::put(rescale(c, dot, rows[r]));
    };
    four_rows<float>(
        m, n, k, [&](int64_t r, int64_t c, float* acc) { dot4_f32_i8(xf.data() + r * k, qp + c * k, k, acc); },
        [&](int64_t r, int64_t c) { return dot_f32_i8(xf.data() + r * k, qp + c * k, k); }, finish);
  });
  return out;
}

QS_EPILOGUES(int8_weight_rows,
             (const at::Tensor& x, const at::Tensor& q, const at::Tensor& w_scale, const at::Tensor& offset,
              const at::Tensor& bias),
             (x, q, w_scale, offset, bias))

// out (M, N) = x (M, K) @ (s (q - z))^T + bias as int8_weight_rows computes it, (x . q) * s - rowsum(x) * offset
// in fp32, rounded once to x's dtype, with x held as quantize_row16 holds it (act_blocks.h; rowsum: the row as the
// product sees it): each weight row widened to 16 bits and multiplied by vpmaddwd, sixteen products an instruction
// against int8_weight_rows' eight. Each lane of a block's sums holds four products, at most 4 * 128 * 32767 < 2^24,
// so it converts to fp32 exactly and is scaled exactly by the block's power of two: what rounds is the fp32 sum over
// the blocks, so the result is the exact product of x as held to within 2^-14 of its largest output, as int4's
// rows16. K a multiple of 32; x bf16, fp16 or fp32. A row that is not finite gives NaN, as the reference does.
at::Tensor int8_weight_rows16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& offset, const at::Tensor& bias) {
#if defined(QS_ACT_BLOCKS)
  check_rows(x, q, scale, /*bf16_scale=*/true);
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const Int8Rescale rescale(scale, optional_f32(offset, n, "offset"), optional_f32(bias, n, "bias"));
  at::Tensor out = at::empty({m, n}, x.options());
  std::vector<int16_t> xq(m * k);
  std::vector<float> d(m * (k / kBlock)), rowsum(m), xf(k);
  std::vector<char> finite(m);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_weight_rows16", [&] {
    const auto* xp = qs::raw(x.data_ptr<scalar_t>());
    for (int64_t r = 0; r < m; ++r) {
      row_f32<scalar_t>(xp + r * k, nullptr, xf.data(), k);
      finite[r] = qs::act::quantize_row16(xf.data(), k, k, xq.data() + r * k, d.data() + r * (k / kBlock),
                                          rowsum.data() + r);
    }
    const int8_t* qp = q.data_ptr<int8_t>();
    auto* op = qs::raw(out.data_ptr<scalar_t>());
    const auto xs = [&](int64_t r) { return xq.data() + r * k; };
    const auto ds = [&](int64_t r) { return d.data() + r * (k / kBlock); };
    four_rows<float>(
        m, n, k, [&](int64_t r, int64_t c, float* acc) { dot_a16<4>(xs(r), ds(r), qp + c * k, k, acc); },
        [&](int64_t r, int64_t c) {
          float acc;
          dot_a16<1>(xs(r), ds(r), qp + c * k, k, &acc);
          return acc;
        },
        [&](int64_t r, int64_t c, float y) {
          op[r * n + c] = qs::Raw<scalar_t>::put(finite[r] ? rescale(c, y, rowsum[r])
                                                           : std::numeric_limits<float>::quiet_NaN());
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

// ---- 4-bit: W4A16's few-row product straight from the CPU int4pack layout ----

namespace {

// One block of `rows` rows of W (K x rows/2 bytes, split nibbles or interleaved, see quant/runtime/int4.py
// _kernel_codes_cpu) times one fp32 x row: y[r] = sum_g s[g, r] * (sum_{c in g} x[c] * code[r, c]) + off[g, r] *
// (sum_{c in g} x[c]), off = z - 8 s. The inner sums run down the block's columns with the row index in the
// vector lanes (x[c] broadcast), so each byte is read once, in storage order.
template <int64_t HALF, typename S>
void int4_block_rows(const float* __restrict x, const uint8_t* __restrict blk, int64_t rows, bool split, int64_t k,
                     int64_t gs, const S* __restrict sz, int64_t n, float* __restrict y) {
  const int64_t half = HALF > 0 ? HALF : rows / 2;
  float acc[64];
  for (int64_t r = 0; r < rows; ++r) y[r] = 0.f;
  for (int64_t g0 = 0; g0 < k; g0 += gs) {
    const int64_t g = g0 / gs;
    float xs = 0.f;
    bool done = false;
#if defined(QS_INT4_VEC)
    if constexpr (HALF == qs::Int4Vec::kHalf) {  // a full block of this width's layout, split nibbles
      if (split) {
        using V = qs::Int4Vec;
        V::F a[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
        for (int64_t c = g0; c < g0 + gs; ++c) {
          const V::F xc = V::set1(x[c]);
          xs += x[c];
          V::F codes[4];
          V::codes(blk + c * HALF, codes);
          for (int j = 0; j < 4; ++j) a[j] = V::fma(xc, codes[j], a[j]);
        }
        for (int j = 0; j < 4; ++j) V::put(a[j], acc + j * V::kLanes);
        done = true;
      }
    }
#endif
    if (!done) {  // any block, any CPU: the same sums, one row at a time
      for (int64_t r = 0; r < rows; ++r) acc[r] = 0.f;
      for (int64_t c = g0; c < g0 + gs; ++c) {
        xs += x[c];
        const uint8_t* b = blk + c * half;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(b[i] & 15), hi = static_cast<float>(b[i] >> 4);
          const int64_t rl = split ? i : 2 * i, rh = split ? half + i : 2 * i + 1;
          acc[rl] = std::fma(x[c], lo, acc[rl]);
          acc[rh] = std::fma(x[c], hi, acc[rh]);
        }
      }
    }
    const S* zg = sz + g * n * 2;  // this block's rows of group g: (scale, zero) pairs, z - 8 s as the dequantizer's
    for (int64_t r = 0; r < rows; ++r) {
      const float sc = qs::to_f(zg[2 * r]);
      y[r] += sc * acc[r] + (qs::to_f(zg[2 * r + 1]) - sc * 8.0f) * xs;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2's 32-row split block times one fp32 x row, ~1.7x the int4_block_rows loop (default model's gate_up, one
// thread, AMD EPYC Zen 3): no widening and no int-to-float conversion per code. Each code becomes the fp32 number
// whose bits are the code alone, in the mantissa (a subnormal: low nibbles q 2^-133, high ones q 2^-130, exact), by
// one byte shuffle that puts it in byte 2 of a 32-bit lane; x is scaled by 2^e beforehand (x_pairs below), so each
// product x q 2^(e-133) is exact and normal, and the sums come back by 2^(133-e) exactly. Valid only where the
// CPU does not read subnormal inputs as zero (MXCSR's DAZ, checked by the caller on the thread that runs it).
// A 256-bit load covers columns c and c+1: lane l < 4 of lo[j] sums column c's row 4j + l, lane 4 + l column
// c + 1's; hi[j] the same for rows 16 + 4j + l. Sums in fp32, in another order than int4_block_rows.
struct XPairs {
  const float* x;   // (K/2, 8): x[c] four times, then x[c + 1] four times, times 2^e
  const float* sum;  // (G,): each group's sum of x, unscaled
  float lo, hi;      // 2^(133 - e), 2^(130 - e)
};

constexpr uint32_t kDaz = 0x0040;  // MXCSR: subnormal inputs read as zero

// int4_block_avx2's byte shuffles: lane l of each 128-bit half (one column) takes byte 4j + (l & 3) of that half
// into its byte 2, zeros elsewhere (-1).
#define QS_PICK(j) {-1, -1, 4 * j, -1, -1, -1, 4 * j + 1, -1, -1, -1, 4 * j + 2, -1, -1, -1, 4 * j + 3, -1, \
                    -1, -1, 4 * j, -1, -1, -1, 4 * j + 1, -1, -1, -1, 4 * j + 2, -1, -1, -1, 4 * j + 3, -1}
alignas(32) constexpr int8_t kPick[4][32] = {QS_PICK(0), QS_PICK(1), QS_PICK(2), QS_PICK(3)};
#undef QS_PICK

// The scale 2^e of one x row (K floats) for int4_block_avx2, written with the row's pairs into xp (4K floats);
// false where the row is not finite (the caller then takes int4_block_rows, which propagates it as the reference
// does). e puts the largest |x| near 2^100: products stay within 2^-29 and above 2^-126 for every x within 2^97 of it.
bool x_pairs(const float* x, int64_t k, float* xp, float& lo, float& hi) {
  float mx = 0.f;
  for (int64_t c = 0; c < k; ++c) mx = std::max(mx, std::fabs(x[c]));
  if (!std::isfinite(mx)) return false;
  const int e = static_cast<int>(std::clamp<int64_t>(mx > 0.f ? 100 - (std::ilogb(mx) + 1) : 100, 6, 127));
  const float s = std::ldexp(1.f, e);
  for (int64_t c = 0; c < k; c += 2)
    for (int l = 0; l < 4; ++l) xp[4 * c + l] = x[c] * s, xp[4 * c + 4 + l] = x[c + 1] * s;
  lo = std::ldexp(1.f, 133 - e), hi = std::ldexp(1.f, 130 - e);
  return true;
}

// Four consecutive rows' (scale, zero) pairs from the (N, 2) table at p, in fp32, each vector's two halves the same
// four rows (s0 s1 s2 s3 s0 s1 s2 s3): int4_block_avx2's lane order.
template <typename S>
inline void scales4(const S* p, __m256& s, __m256& z) {
  __m256 v;  // s0 z0 s1 z1 s2 z2 s3 z3
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  } else if constexpr (std::is_same_v<S, float>) {
    v = _mm256_loadu_ps(p);
  } else {
    alignas(32) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = qs::to_f(p[i]);
    v = _mm256_load_ps(t);
  }
  s = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
  z = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
}

// y (32,) = the 32-row block times one row: per group s (x . q) + (z - 8 s) sum(x). The group's sums stay in the
// loop's lane order and take their rows' scales there (scales4); the two columns' halves and the codes' power of two
// (xr.lo, xr.hi: exact) are applied once at the end.
template <typename S>
void int4_block_avx2(const XPairs& xr, const uint8_t* __restrict blk, int64_t k, int64_t gs, const S* __restrict sz,
                     int64_t n, float* __restrict y) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m78 = _mm256_set1_epi8(0x78);
  __m256i pick[4];
  for (int j = 0; j < 4; ++j) pick[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPick[j]));
  // sums[j], sums[4 + j]: the scaled group sums of rows 4 j .. 4 j + 3 (low nibbles) and 16 + 4 j .. (high), lanes l
  // and 4 + l each holding one column of every pair; offs[i]: the same rows' (z - 8 s) sum(x), both halves alike
  __m256 sums[8], offs[8];
  for (int i = 0; i < 8; ++i) sums[i] = offs[i] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < k; g0 += gs) {
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t c = g0; c < g0 + gs; c += 2) {
      const __m256 xc = _mm256_loadu_ps(xr.x + 4 * c);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 16));
      const __m256i wl = _mm256_and_si256(w, m0f);                            // low nibble at bits 0-3: q 2^-133
      const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(w, 1), m78);     // high nibble at bits 3-6: q 2^-130
      for (int j = 0; j < 4; ++j) {
        lo[j] = _mm256_fmadd_ps(xc, _mm256_castsi256_ps(_mm256_shuffle_epi8(wl, pick[j])), lo[j]);
        hi[j] = _mm256_fmadd_ps(xc, _mm256_castsi256_ps(_mm256_shuffle_epi8(wh, pick[j])), hi[j]);
      }
    }
    const S* zg = sz + (g0 / gs) * n * 2;
    const __m256 xs = _mm256_set1_ps(xr.sum[g0 / gs]), eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 8; ++i) {
      __m256 s, z;
      scales4(zg + 2 * (i < 4 ? 4 * i : 16 + 4 * (i - 4)), s, z);
      sums[i] = _mm256_fmadd_ps(i < 4 ? lo[i] : hi[i - 4], s, sums[i]);
      offs[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(s, eight, z), xs, offs[i]);
    }
  }
  for (int i = 0; i < 8; ++i) {
    const __m128 both = _mm_add_ps(_mm256_castps256_ps128(sums[i]), _mm256_extractf128_ps(sums[i], 1));
    const __m128 v = _mm_fmadd_ps(both, _mm_set1_ps(i < 4 ? xr.lo : xr.hi), _mm256_castps256_ps128(offs[i]));
    _mm_storeu_ps(y + (i < 4 ? 4 * i : 16 + 4 * (i - 4)), v);
  }
}
#define QS_INT4_AVX2_PAIRS 1
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The scales and offsets of 16 consecutive rows of one group, from the (N, 2) (scale, zero) pairs at p, in fp32.
template <typename S>
inline void scales16(const S* p, __m512& sc, __m512& z) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {  // a pair is one 32-bit lane: scale low, zero high
    const __m512i v = _mm512_loadu_si512(p);
    sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  } else {
    alignas(64) float a[16], b[16];
    for (int i = 0; i < 16; ++i) a[i] = qs::to_f(p[2 * i]), b[i] = qs::to_f(p[2 * i + 1]);
    sc = _mm512_load_ps(a), z = _mm512_load_ps(b);
  }
}

// A 64-row split block (see int4_block_rows) times MR bf16 rows of x (row stride k), one group: vdpbf16ps adds
// x[c] w[c] + x[c+1] w[c+1] into each fp32 lane. A code q becomes the bf16 1 + q / 16 by placing it in mantissa
// bits 3-6 of 1.0 (one shift and one ternary-logic op per 32 codes, against a widening and a conversion per 16 in
// fp32), exact, as are the bf16 products; so sum_c x[c] q[c] = 16 (acc - sum_c x[c]) and, with the table's
// off = z - 8 s, y += 16 s acc + (z - 24 s) sum(x) per group. Sums in fp32, in another order than the fp32 path.
// MR is a template argument so that the 4 MR accumulators stay in registers.
template <int MR, typename S>
inline void int4_group_bf16(const uint16_t* __restrict x, int64_t k, const uint8_t* __restrict blk, int64_t c0,
                            int64_t gs, const S* __restrict zg, const float* xs, bool first, float* __restrict y) {
  const __m512i bits = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);  // mantissa bits 3-6; bf16 1.0
  // acc[i][j]: x row i; j = 0, 1 low nibbles, 2, 3 high nibbles. Lane l of j = 0 holds row l (l < 8) or 8 + l
  // (l >= 8): unpacklo_epi8 interleaves within 128-bit halves; j = 1 holds the other eight of each 16.
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = c0; c < c0 + gs; c += 2) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (c + 1) * 32));
    const __m512i a = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(b0, b1));  // (row, c), (row, c + 1) bytes
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(b0, b1));
    const __m512i w[4] = {_mm512_ternarylogic_epi32(_mm512_slli_epi16(a, 3), bits, one, 0xEA),  // (v & m) | 1.0
                          _mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), bits, one, 0xEA),
                          _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 1), bits, one, 0xEA),
                          _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), bits, one, 0xEA)};
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * k + c, sizeof(pair));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)w[j], xp);
    }
  }
  for (int i = 0; i < MR; ++i) {
    const __m512 xsum = _mm512_set1_ps(xs[i]);
    for (int h = 0; h < 2; ++h) {  // low nibbles: rows 0-31; high: rows 32-63
      const __m512 p = acc[i][2 * h], q = acc[i][2 * h + 1];
      // rows 0-15 are p's then q's first eight lanes (128-bit quarters 0, 1 of each); rows 16-31 the rest
      const __m512 part[2] = {_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE)};
      for (int half = 0; half < 2; ++half) {
        const int64_t row = 32 * h + 16 * half;
        __m512 sc, z;
        scales16(zg + 2 * row, sc, z);
        float* yr = y + i * 64 + row;
        const __m512 off = _mm512_fnmadd_ps(sc, _mm512_set1_ps(24.f), z);  // z - 24 s
        const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(16.f)), part[half],
                                         first ? _mm512_setzero_ps() : _mm512_loadu_ps(yr));
        _mm512_storeu_ps(yr, _mm512_fmadd_ps(off, xsum, v));
      }
    }
  }
}

// The block times m bf16 rows of x: y (m, 64) fp32, overwritten. xsum: (m, G) per-group sums of x.
template <typename S>
void int4_block_bf16(const uint16_t* __restrict x, int64_t m, int64_t k, const uint8_t* __restrict blk, int64_t gs,
                     const S* __restrict sz, int64_t n, const float* __restrict xsum, float* __restrict y) {
  const int64_t G = k / gs;
  float xs[4];
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t mr = std::min<int64_t>(4, m - r0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t i = 0; i < mr; ++i) xs[i] = xsum[(r0 + i) * G + g];
      const uint16_t* xr = x + r0 * k;
      const S* zg = sz + g * n * 2;
      float* yr = y + r0 * 64;
      switch (mr) {
        case 4: int4_group_bf16<4>(xr, k, blk, g * gs, gs, zg, xs, g == 0, yr); break;
        case 3: int4_group_bf16<3>(xr, k, blk, g * gs, gs, zg, xs, g == 0, yr); break;
        case 2: int4_group_bf16<2>(xr, k, blk, g * gs, gs, zg, xs, g == 0, yr); break;
        default: int4_group_bf16<1>(xr, k, blk, g * gs, gs, zg, xs, g == 0, yr); break;
      }
    }
  }
}
#endif

}  // namespace

// out (M, N) = x (M, K, the kernel's column order) @ W^T (+ bias), W from the CPU int4pack layout (packed, block,
// split as for dequant_int4pack) and its (G, N, 2) scale/zero table: in fp32, rounded once to x's dtype.
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t block, bool split,
                     const at::Tensor& sz, int64_t group_size, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == k,
              "x must be a contiguous CPU (M, K) tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == n * k / 2,
              "packed must be a contiguous CPU uint8 tensor of N * K / 2 bytes");
  TORCH_CHECK(n % 2 == 0 && block > 0 && block % 2 == 0 && block <= 64, "N and the block (<= 64) must be even");
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "K must be a multiple of group_size");
  const int64_t G = k / group_size, m = x.size(0);
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == G && sz.size(1) == n && sz.size(2) == 2,
              "scales_zeros must be (K / group_size, N, 2)");
  const float* bp = optional_f32(bias, n, "bias");
  TORCH_CHECK(sz.is_contiguous(), "scales_zeros must be contiguous");
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t full = split ? n / block : 0, blocks = (n + block - 1) / block;
  std::vector<float> xf(m * k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_rows", [&] {
    using T = scalar_t;
    const auto* xr = qs::raw(x.data_ptr<T>());
    for (int64_t r = 0; r < m; ++r) row_f32<T>(xr + r * k, nullptr, xf.data() + r * k, k);
    auto* o = qs::raw(out.data_ptr<T>());
    // bf16 x: whole split 64-row blocks take the two-columns-per-instruction kernel, which needs x's per-group sums
    bool pairs = false;
    std::vector<float> xsum;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      pairs = split && block == 64 && group_size % 2 == 0;
      if (pairs) xsum = group_sums(xf.data(), m, k, group_size);
    }
#endif
#if defined(QS_INT4_AVX2_PAIRS)
    // fp32 x rows prepared for int4_block_avx2 (whole split 32-row blocks), where every row is finite
    std::vector<float> xp_buf;
    std::vector<XPairs> prep;
    if (split && block == 32 && group_size % 2 == 0) {
      xsum = group_sums(xf.data(), m, k, group_size);
      xp_buf.resize(m * 4 * k), prep.resize(m);
      for (int64_t r = 0; r < m && !prep.empty(); ++r) {
        prep[r] = {xp_buf.data() + r * 4 * k, xsum.data() + r * G, 0.f, 0.f};
        if (!x_pairs(xf.data() + r * k, k, xp_buf.data() + r * 4 * k, prep[r].lo, prep[r].hi)) prep.clear();
      }
    }
#endif
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4_rows_table", [&] {
      const scalar_t* zp = sz.data_ptr<scalar_t>();
      qs::balanced_for(blocks, grain_rows(block * k * m), [&](int64_t b, int64_t e) {
        float y[64];
        std::vector<float> ym(pairs ? m * 64 : 0);
#if defined(QS_INT4_AVX2_PAIRS)
        const bool subnormals = !prep.empty() && !(_mm_getcsr() & kDaz);  // this thread's MXCSR
#endif
        for (int64_t i = b; i < e; ++i) {
          const int64_t r0 = i * block, rows = std::min(block, n - r0);
          const bool sb = split && i < full;
          const uint8_t* blk = pp + r0 * k / 2;
          const scalar_t* zb = zp + r0 * 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          if (pairs && sb && rows == 64) {
            int4_block_bf16<scalar_t>(reinterpret_cast<const uint16_t*>(xr), m, k, blk, group_size, zb, n,
                                      xsum.data(), ym.data());
            for (int64_t r = 0; r < m; ++r)
              for (int64_t j = 0; j < 64; ++j)
                o[r * n + r0 + j] = qs::Raw<T>::put(bp ? ym[r * 64 + j] + bp[r0 + j] : ym[r * 64 + j]);
            continue;
          }
#endif
          for (int64_t r = 0; r < m; ++r) {
            const float* xrow = xf.data() + r * k;
#if defined(QS_INT4_AVX2_PAIRS)
            if (subnormals && sb && rows == 32) {
              int4_block_avx2(prep[r], blk, k, group_size, zb, n, y);
            } else
#endif
            if (sb && rows == 64) {
              int4_block_rows<32>(xrow, blk, rows, true, k, group_size, zb, n, y);
            } else if (sb && rows == 32) {
              int4_block_rows<16>(xrow, blk, rows, true, k, group_size, zb, n, y);
            } else {
              int4_block_rows<0>(xrow, blk, rows, sb, k, group_size, zb, n, y);
            }
#if defined(QS_INT4_AVX2_PAIRS)
            if (rows % 16 == 0) {  // c10's rounding, 16 lanes at a time
              qs::gemm::store_rows(out.data_ptr<T>() + r * n + r0, y, bp ? bp + r0 : nullptr, rows);
              continue;
            }
#endif
            for (int64_t j = 0; j < rows; ++j)
              o[r * n + r0 + j] = qs::Raw<T>::put(bp ? y[j] + bp[r0 + j] : y[j]);
          }
        }
      });
    });
  });
  return out;
}

QS_EPILOGUES(int4_rows,
             (const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t block, bool split,
              const at::Tensor& sz, int64_t group_size, const at::Tensor& bias),
             (x, packed, n, k, block, split, sz, group_size, bias))

// ---- 16-bit dense: an unquantized bf16 Linear's few-row product ----
// oneDNN takes a 1-row bf16 product at ~half the bandwidth this does (3072x576, cold: 0.138 ms with AVX-512, where
// ATen's own GEMV, which it uses under an AVX2 cap, takes 0.083 ms).

namespace {

// A weight vector widened to fp32: bf16 bits shifted into the high half, fp32 loaded as it is.
#if defined(__AVX512F__)
inline __m512 wide16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 wide16(const float* p) { return _mm512_loadu_ps(p); }
#endif
#if defined(__AVX2__)
inline __m256 wide8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 wide8(const float* p) { return _mm256_loadu_ps(p); }
#endif
inline float wide1(uint16_t v) { return qs::Raw<c10::BFloat16>::get(v); }
inline float wide1(float v) { return v; }

// Four weight rows (bf16 bits or fp32) against one fp32 x row (rows == 1) or two (rows == 2: each weight vector
// widened once for both), fused multiply-adds, the next four rows prefetched. Each row's sums are formed in the same
// lanes and order whether it is taken alone or with another, so a row's output does not depend on its neighbour.
template <int ROWS, typename W>
void dot4_rows(const float* __restrict a0, const float* __restrict a1, const W* __restrict w, int64_t k,
               float* __restrict out0, float* __restrict out1) {
  const W* __restrict ws[4] = {w, w + k, w + 2 * k, w + 3 * k};
  const char* next = reinterpret_cast<const char*>(w + 4 * k);
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 s0[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512 s1[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; j + 16 <= k; j += 16) {
    for (int64_t b = 0; b < 4 * 16 * int64_t(sizeof(W)); b += 64) __builtin_prefetch(next + 4 * sizeof(W) * j + b);
    const __m512 x0 = _mm512_loadu_ps(a0 + j);
    const __m512 x1 = ROWS == 2 ? _mm512_loadu_ps(a1 + j) : x0;
    for (int i = 0; i < 4; ++i) {
      const __m512 wv = wide16(ws[i] + j);
      s0[i] = _mm512_fmadd_ps(x0, wv, s0[i]);
      if (ROWS == 2) s1[i] = _mm512_fmadd_ps(x1, wv, s1[i]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    out0[i] = _mm512_reduce_add_ps(s0[i]);
    if (ROWS == 2) out1[i] = _mm512_reduce_add_ps(s1[i]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 s1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; j + 8 <= k; j += 8) {
    for (int64_t b = 0; b < 4 * 8 * int64_t(sizeof(W)); b += 64) __builtin_prefetch(next + 4 * sizeof(W) * j + b);
    const __m256 x0 = _mm256_loadu_ps(a0 + j);
    const __m256 x1 = ROWS == 2 ? _mm256_loadu_ps(a1 + j) : x0;
    for (int i = 0; i < 4; ++i) {
      const __m256 wv = wide8(ws[i] + j);
      s0[i] = _mm256_fmadd_ps(x0, wv, s0[i]);
      if (ROWS == 2) s1[i] = _mm256_fmadd_ps(x1, wv, s1[i]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    out0[i] = hsum8(s0[i]);
    if (ROWS == 2) out1[i] = hsum8(s1[i]);
  }
#else
  for (int i = 0; i < 4; ++i) out0[i] = 0.f, out1[i] = 0.f;
#endif
  for (; j < k; ++j)
    for (int i = 0; i < 4; ++i) {
      const float wv = wide1(ws[i][j]);
      out0[i] = std::fma(a0[j], wv, out0[i]);
      if (ROWS == 2) out1[i] = std::fma(a1[j], wv, out1[i]);
    }
}

// out (M, N) = x (M, K) @ w (N, K)^T (+ bias) for fp32 x rows `xf` and weights of element type W (bf16 bits or
// fp32): four W rows at a time, parallel over W's rows; x rows two at a time against them (the last alone when odd).
template <typename W, typename Finish>
void float_rows(const float* xf, const W* wp, int64_t m, int64_t n, int64_t k, const Finish& finish) {
  qs::balanced_for((n + 3) / 4, grain_rows(4 * m * k), [&](int64_t b, int64_t e) {
    float acc[8];
    for (int64_t c = 4 * b; c < std::min(n, 4 * e); c += 4) {
      if (c + 4 > n) {
        for (int64_t r = 0; r < m; ++r)
          for (int64_t i = c; i < n; ++i) {
            float y = 0.f;
            for (int64_t j = 0; j < k; ++j) y = std::fma(xf[r * k + j], wide1(wp[i * k + j]), y);
            finish(r, i, y);
          }
        continue;
      }
      int64_t r = 0;
      for (; r + 2 <= m; r += 2) {
        dot4_rows<2>(xf + r * k, xf + (r + 1) * k, wp + c * k, k, acc, acc + 4);
        for (int64_t i = 0; i < 4; ++i) finish(r, c + i, acc[i]), finish(r + 1, c + i, acc[4 + i]);
      }
      if (r < m) {
        dot4_rows<1>(xf + r * k, nullptr, wp + c * k, k, acc, acc + 4);
        for (int64_t i = 0; i < 4; ++i) finish(r, c + i, acc[i]);
      }
    }
  });
}

}  // namespace

// out (M, N) = x (M, K) @ w (N, K)^T + bias (N,) fp32 where given, x and w both bf16 or both fp32: fp32 sums,
// rounded once to x's dtype.
at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a contiguous CPU (M, K) bf16 or fp32 tensor");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
                  w.size(1) == x.size(1),
              "weight must be a contiguous CPU (N, K) tensor of x's dtype with x's K");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const float* bp = optional_f32(bias, n, "bias");
  at::Tensor out = at::empty({m, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
    float_rows(x.data_ptr<float>(), w.data_ptr<float>(), m, n, k,
               [&](int64_t r, int64_t c, float y) { op[r * n + c] = bp ? y + bp[c] : y; });
    return out;
  }
  using T = c10::BFloat16;
  std::vector<float> xf(m * k);
  const auto* xr = qs::raw(x.data_ptr<T>());
  for (int64_t r = 0; r < m; ++r) row_f32<T>(xr + r * k, nullptr, xf.data() + r * k, k);
  uint16_t* op = qs::raw(out.data_ptr<T>());
  float_rows(xf.data(), qs::raw(w.data_ptr<T>()), m, n, k,
             [&](int64_t r, int64_t c, float y) { op[r * n + c] = qs::Raw<T>::put(bp ? y + bp[c] : y); });
  return out;
}

QS_EPILOGUES(bf16_rows, (const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias), (x, w, bias))

// x (M, K) fp32 or fp64 rotated in place in blocks of `block` (quant.runtime.hadamard on the CPU), parallel over the rows.
at::Tensor& hadamard_(at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "hadamard_: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "hadamard_: x must be fp32 or fp64");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(is_block(k, block), "hadamard_: the block must be a power of two dividing K");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hadamard_", [&] {
    scalar_t* o = x.data_ptr<scalar_t>();
    at::parallel_for(0, m, grain_rows(k * 8), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) qs::hadamard_blocks(o + r * k, k, block);
    });
  });
  return x;
}

TORCH_LIBRARY(quantserve_rows, m) {
  m.def("w8a8_rows(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, Tensor smooth, Tensor bias, "
        "float qmax, float min_scale, int rotate) -> Tensor");
  const std::string int8 = "int8_weight_rows(Tensor x, Tensor weight, Tensor weight_scale, Tensor offset, Tensor bias) -> Tensor";
  m.def(int8.c_str());
  m.def(qs::epilogue_schema(int8, "gated").c_str());
  m.def(qs::epilogue_schema(int8, "normed").c_str());
  const std::string int8_16 = "int8_weight_rows16(Tensor x, Tensor weight, Tensor weight_scale, Tensor offset, "
                              "Tensor bias) -> Tensor";
  m.def(int8_16.c_str());
  m.def(qs::epilogue_schema(int8_16, "gated").c_str());
  m.def(qs::epilogue_schema(int8_16, "normed").c_str());
  m.def("rows16_built() -> bool", &rows16_built);
  const std::string int4 = "int4_rows(Tensor x, Tensor packed, int n, int k, int block, bool split, "
                           "Tensor scales_zeros, int group_size, Tensor bias) -> Tensor";
  m.def(int4.c_str());
  m.def(qs::epilogue_schema(int4, "gated").c_str());
  m.def(qs::epilogue_schema(int4, "normed").c_str());
  const std::string dense = "bf16_rows(Tensor x, Tensor weight, Tensor bias) -> Tensor";
  m.def(dense.c_str());
  m.def(qs::epilogue_schema(dense, "gated").c_str());
  m.def(qs::epilogue_schema(dense, "normed").c_str());
  m.def("hadamard_(Tensor(a!) x, int block) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(quantserve_rows, CPU, m) {
  m.impl("w8a8_rows", &w8a8_rows);
  m.impl("int8_weight_rows", &int8_weight_rows);
  m.impl("int8_weight_rows_gated", &int8_weight_rows_gated);
  m.impl("int8_weight_rows_normed", &int8_weight_rows_normed);
  m.impl("int8_weight_rows16", &int8_weight_rows16);
  m.impl("int8_weight_rows16_gated", &int8_weight_rows16_gated);
  m.impl("int8_weight_rows16_normed", &int8_weight_rows16_normed);
  m.impl("int4_rows", &int4_rows);
  m.impl("int4_rows_gated", &int4_rows_gated);
  m.impl("int4_rows_normed", &int4_rows_normed);
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_rows_gated", &bf16_rows_gated);
  m.impl("bf16_rows_normed", &bf16_rows_normed);
  m.impl("hadamard_", &hadamard_);
}
