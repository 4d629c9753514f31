// Weight-only Linears' many-row products (prefill) straight from their runtime layouts, one C++ call each (loaded by
// quant/runtime/kernels/gemm.py; tests/test_gemm.py holds them to the modules' fp32 references and to the dequantize-then-matmul
// paths they stand in for, on this CPU and under an AVX2 cap).
//
// Why: above a few dozen rows a weight-only Linear is compute-bound, and its cheapest form was dequantizing all of
// W (N x K writes and reads through memory: 10-40% of a 256-row product) and handing it to oneDNN or MKL, or the
// few-row kernels (quant/runtime/kernels/csrc/rows_ops.cpp), which expand the codes again for every 4 rows of x. Here W is cut into
// blocks of rows, each dequantized once per call, a K-tile at a time, into a tile that stays in L1, and
// register-blocked strips of 6 x rows run over it. The dequantization costs ~1/M of the products. Two kernels, by
// what the CPU has (gemm_avx512.h: AVX512-BF16, bf16 pair tiles and vdpbf16ps; gemm_avx2.h: fp32 tiles and FMAs,
// where a 16-bit GEMM is slower than fp32), one driver.
//
// Numerics: a tile holds the dequantizer's weights (quant/runtime/kernels/csrc/dequant_ops.cpp: int4 code * s + (z - 8 s), int8
// (q - z) * s, in fp32 with its roundings; with AVX512-BF16 then rounded to bf16, to nearest even, as the bf16
// dequantizer, up to NaNs and fp32 subnormals, which dequantized weights are not), so a call computes what the
// dequantize + matmul path of that dtype does, with fp32 sums in another order, rounded once to bf16. (AVX2's int8
// tiles hold q - z, exact, and each output column's sums are multiplied by its row's s: the fp32 path's numbers up
// to one more fp32 rounding.) A row's sums do not depend on which other rows are in the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "elements.h"
#include "gemm_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gemm_avx512.h"
#define QS_GEMM 1
namespace qs::gemm {
using Isa = Avx512;
template <typename S>
using Int4Tiles = Int4Tiles512<S>;
}  // namespace qs::gemm
#elif defined(__AVX2__) && defined(__FMA__)
#include "gemm_avx2.h"
#define QS_GEMM 1
#define QS_GEMM_DENSE 1  // bf16 weights too: without AVX512-BF16, oneDNN's bf16 GEMM is slower than widening to fp32
namespace qs::gemm {
using Isa = Avx2;
template <typename S>
using Int4Tiles = Int4Tiles2<S>;
}  // namespace qs::gemm
#endif

namespace {

constexpr int64_t kStrip = 6;  // x rows per register-blocked strip

// How many row chunks each block's work is cut into, so that (blocks x chunks) splits evenly over the threads or
// is many times their number: with 2 threads and a 576-row W (9 blocks of 64), one chunk each left a thread idle
// 1/9 of the call.
int64_t row_chunks(int64_t blocks, int64_t m, int64_t threads) {
  const int64_t most = std::max<int64_t>(1, (m + kStrip - 1) / kStrip);
  int64_t chunks = 1;
  while (chunks < most && (blocks * chunks) % threads != 0 && blocks * chunks < 16 * threads) ++chunks;
  return chunks;
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  x.scalar_type() == at::kBFloat16,
              "x must be a contiguous CPU (M, K) bf16 tensor");
}

// An int8 (N, K) weight as the int8, W8A8 and int8_sums ops take it: N in whole blocks, K even.
void check_int8_codes(const at::Tensor& q, int64_t block) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "weight must be a contiguous CPU (N, K) int8 tensor");
  TORCH_CHECK(q.size(0) % block == 0 && q.size(1) % 2 == 0, "N must be a multiple of ", block, " and K even");
}

// W8A8's quantized activations as its ops take them: a contiguous CPU (M, K) int8 tensor.
void check_xq(const at::Tensor& xq, int64_t k) {
  TORCH_CHECK(xq.device().is_cpu() && xq.dim() == 2 && xq.is_contiguous() && xq.size(1) == k &&
                  xq.scalar_type() == at::kChar,
              "xq must be a contiguous CPU (M, K) int8 tensor");
}

// An int8 (N, K) weight and its (N,) fp32 scales, as the int8 and W8A8 ops take them.
void check_int8_weight(const at::Tensor& q, const at::Tensor& scale, int64_t block) {
  check_int8_codes(q, block);
  const int64_t n = q.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "weight_scale must be a contiguous (N,) fp32 tensor");
}

uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

const float* optional_bias(const at::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous() && bias.scalar_type() == at::kFloat,
              "bias must be a contiguous (", n, ",) fp32 tensor, or empty");
  return bias.data_ptr<float>();
}

#if defined(QS_GEMM)
using qs::gemm::Isa;

template <typename K, int MR>
void strip(const typename K::X* x, int64_t ldx, int64_t k0, const typename K::Tile* tile, int64_t kt, bool first,
           float* acc) {
  K::template strip<MR>(x, ldx, k0, tile, kt, first, acc);
}

template <typename K>
void run_strip(int64_t mr, const typename K::X* x, int64_t ldx, int64_t k0, const typename K::Tile* tile, int64_t kt,
               bool first, float* acc) {
  switch (mr) {
    case 6: strip<K, 6>(x, ldx, k0, tile, kt, first, acc); break;
    case 5: strip<K, 5>(x, ldx, k0, tile, kt, first, acc); break;
    case 4: strip<K, 4>(x, ldx, k0, tile, kt, first, acc); break;
    case 3: strip<K, 3>(x, ldx, k0, tile, kt, first, acc); break;
    case 2: strip<K, 2>(x, ldx, k0, tile, kt, first, acc); break;
    default: strip<K, 1>(x, ldx, k0, tile, kt, first, acc); break;
  }
}

// x's elements as a kernel reads them: bf16 bits (AVX-512), fp32 (AVX2), or for W8A8 int16 (AVX2) or xq + 128 as
// u8 (AVX512-VNNI), from bf16 bits or int8 (W8A8's quantized activations, exact in all of them).
template <typename To, typename From>
To widen(From v) {
  if constexpr (std::is_same_v<To, uint8_t>) {
    static_assert(std::is_same_v<From, int8_t>, "only quantized activations widen to u8 + 128");
    return static_cast<uint8_t>(static_cast<int>(v) + 128);
  } else if constexpr (std::is_same_v<To, int16_t>) {
    static_assert(std::is_same_v<From, int8_t>, "only quantized activations widen to int16");
    return v;
  } else {
    const float f = [&] {
      if constexpr (std::is_same_v<From, uint16_t>) return qs::Raw<c10::BFloat16>::get(v);
      else return static_cast<float>(v);
    }();
    if constexpr (std::is_same_v<To, float>) return f;
    else return qs::Raw<c10::BFloat16>::put(f);
  }
}

// out (M, N) bf16 (fp32 where Out is float: the int8_sums op) = x (M, K) @ W^T through the epilogue, by the kernel Kn
// (the build's Isa, or Avx2Int16), W's blocks of Kn::kBlock rows expanded by `expand` (and their codes prefetched by
// expand.prefetch): per thread, work items of one block and a chunk of x's rows; per item, K-tile by K-tile, the
// tile expanded once and every strip run over it. x: bf16 bits or int8.
template <typename Kn = Isa, typename Expand, typename XIn, typename Out>
void tiled(const XIn* x, int64_t m, int64_t n, int64_t k, const Expand& expand, const qs::gemm::Epilogue& epi,
           Out* op) {
  if (m == 0) return;
  std::vector<typename Kn::X> staged;  // x as the kernel reads it, where it is not that already
  const typename Kn::X* xp;
  if constexpr (std::is_same_v<typename Kn::X, XIn>) {
    xp = x;
  } else {
    staged.resize(m * k);
    at::parallel_for(0, m * k, 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) staged[i] = widen<typename Kn::X>(x[i]);
    });
    xp = staged.data();
  }
  constexpr int64_t B = Kn::kBlock;
  const int64_t blocks = n / B;
  // K in tiles of about kTileBytes of expanded weights, as equal as the expander's alignment allows
  const int64_t tiles = (k * Kn::kColBytes + Kn::kTileBytes - 1) / Kn::kTileBytes;
  const int64_t kc = ((k + tiles - 1) / tiles + Expand::kAlign - 1) / Expand::kAlign * Expand::kAlign;
  const int64_t chunks = row_chunks(blocks, m, at::get_num_threads());
  const int64_t chunk_rows = ((m + chunks - 1) / chunks + kStrip - 1) / kStrip * kStrip;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t b, int64_t e) {
    std::vector<typename Kn::Tile> tile(kc * Kn::kColBytes / sizeof(typename Kn::Tile));
    std::vector<float> acc(chunk_rows * B);
    for (int64_t item = b; item < e; ++item) {
      const int64_t blk = item / chunks, m0 = (item % chunks) * chunk_rows;
      const int64_t rows = std::min(chunk_rows, m - m0);
      if (rows <= 0) continue;
      for (int64_t k0 = 0; k0 < k; k0 += kc) {
        const int64_t kt = std::min(kc, k - k0);
        expand(blk, k0, kt, tile.data());
        // the next tile's codes are fetched while the strips run (cold weights, a layer at a time; a row-major
        // weight's block is as many strided streams as it has rows, more than the hardware prefetchers follow)
        if (k0 + kc < k) {
          expand.prefetch(blk, k0 + kc, std::min(kc, k - k0 - kc));
        } else if (item + 1 < e && (item + 1) / chunks != blk) {
          expand.prefetch((item + 1) / chunks, 0, std::min(kc, k));
        }
        for (int64_t i = 0; i < rows; i += kStrip)
          run_strip<Kn>(std::min(kStrip, rows - i), xp + (m0 + i) * k, k, k0, tile.data(), kt, k0 == 0,
                        acc.data() + i * B);
      }
      Kn::finish(acc.data(), rows, epi.at(m0, blk * B), op + m0 * n + blk * B, n);
    }
  });
}
#endif  // QS_GEMM

}  // namespace

// What this build computes (the CPU's vector extensions, compiled for): [rows per block of W (0: nothing), the
// int4pack layout's block rows the int4 op reads, whether bf16 weights have an op too, the K multiple for which
// W8A8's sums are exact int32 ones (0: never)].
std::vector<int64_t> gemm_build() {
#if defined(QS_GEMM) && defined(QS_GEMM_DENSE)
  return {Isa::kBlock, Isa::kInt4Block, 1, 2};
#elif defined(QS_GEMM) && defined(__AVX512VNNI__)
  return {Isa::kBlock, Isa::kInt4Block, 0, 4};
#elif defined(QS_GEMM)
  return {Isa::kBlock, Isa::kInt4Block, 0, 0};
#else
  return {0, 0, 0, 0};
#endif
}

// out (M, N) bf16 = x (M, K) bf16, in the kernel's column order, @ W^T (+ bias fp32), W from the CPU int4pack layout
// of this width (split blocks of kInt4Block rows, N a multiple of it) and its (G, N, 2) scale/zero table.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& sz,
                     int64_t group_size, const at::Tensor& bias) {
  const int64_t block = gemm_build()[1];
  TORCH_CHECK(block > 0, "int4_gemm needs a build with AVX512-BF16 or AVX2");
  check_x(x, k);
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == n * k / 2,
              "packed must be a contiguous CPU uint8 tensor of N * K / 2 bytes");
  TORCH_CHECK(n % block == 0, "N must be a multiple of ", block);
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && k % group_size == 0,
              "K must be a multiple of group_size, an even number");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == k / group_size && sz.size(1) == n && sz.size(2) == 2 &&
                  sz.is_contiguous(),
              "scales_zeros must be a contiguous (K / group_size, N, 2) tensor");
  const float* bp = optional_bias(bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(QS_GEMM)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4_gemm", [&] {
    const qs::gemm::Int4Tiles<scalar_t> expand{packed.data_ptr<uint8_t>(), sz.data_ptr<scalar_t>(), n, k, group_size};
    tiled(bf16_bits(x), x.size(0), n, k, expand, {bp}, bf16_bits(out));
  });
#endif
  return out;
}

// out (M, N) bf16 = x (M, K) bf16 @ ((q - zero) * scale)^T (+ bias fp32): q (N, K) int8 (N a multiple of the
// build's block, K even), scale (N,) fp32, zero (N,) int8 or empty (symmetric).
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero,
                     const at::Tensor& bias) {
  const int64_t block = gemm_build()[0];
  TORCH_CHECK(block > 0, "int8_gemm needs a build with AVX512-BF16 or AVX2");
  check_int8_weight(q, scale, block);
  const int64_t n = q.size(0), k = q.size(1);
  check_x(x, k);
  const bool affine = zero.numel() > 0;
  TORCH_CHECK(!affine || (zero.dim() == 1 && zero.size(0) == n && zero.is_contiguous() &&
                          zero.scalar_type() == at::kChar),
              "zero must be a contiguous (N,) int8 tensor, or empty");
  const float* bp = optional_bias(bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(QS_GEMM)
  const int8_t* zp = affine ? zero.data_ptr<int8_t>() : nullptr;
#if defined(QS_GEMM_DENSE)  // fp32 tiles of q - z, the scales applied to the sums
  const qs::gemm::RowTiles2<qs::gemm::Int8Row> expand{{q.data_ptr<int8_t>(), zp, k}, k, 1};
  tiled(bf16_bits(x), x.size(0), n, k, expand, {bp, nullptr, scale.data_ptr<float>()}, bf16_bits(out));
#else
  const qs::gemm::Int8Tiles512 expand{q.data_ptr<int8_t>(), scale.data_ptr<float>(), zp, k};
  tiled(bf16_bits(x), x.size(0), n, k, expand, {bp}, bf16_bits(out));
#endif
#endif
  return out;
}

// W8A8's product from its quantized activations: out (M, N) bf16 = (xq @ q^T) * (x_scale[r] * weight_scale[c]) (+
// bias), the integer products exact, in W8A8Linear's rescale order: xq (M, K) int8, x_scale (M,) fp32, q (N, K) int8
// (N a multiple of the build's block, K even), weight_scale (N,) fp32, weight_sums (N,) int32 sum_k q. The sums are
// int32 (exact: its int_mm path, bit for bit) with AVX2 (vpmaddwd, twice the multiply-adds per instruction of the
// fp32 kernel) and with AVX512-VNNI where K is a multiple of 4 (vpdpbusd); otherwise fp32 over bf16 pair tiles
// (exact below 2^24: the module's fp32 path).
at::Tensor w8a8_gemm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& q,
                     const at::Tensor& weight_scale, const at::Tensor& weight_sums, const at::Tensor& bias) {
  const int64_t block = gemm_build()[0];
  TORCH_CHECK(block > 0, "w8a8_gemm needs a build with AVX512-BF16 or AVX2");
  check_int8_weight(q, weight_scale, block);
  const int64_t n = q.size(0), k = q.size(1);
  check_xq(xq, k);
  const int64_t m = xq.size(0);
  TORCH_CHECK(x_scale.dim() == 1 && x_scale.size(0) == m && x_scale.is_contiguous() &&
                  x_scale.scalar_type() == at::kFloat,
              "x_scale must be a contiguous (M,) fp32 tensor");
  TORCH_CHECK(weight_sums.dim() == 1 && weight_sums.size(0) == n && weight_sums.is_contiguous() &&
                  weight_sums.scalar_type() == at::kInt,
              "weight_sums must be a contiguous (N,) int32 tensor: sum_k weight[n, k]");
  const float* bp = optional_bias(bias, n);
  at::Tensor out = at::empty({m, n}, xq.options().dtype(at::kBFloat16));
#if defined(QS_GEMM)
  qs::gemm::Epilogue epi{bp, x_scale.data_ptr<float>(), weight_scale.data_ptr<float>()};
#if defined(QS_GEMM_DENSE)  // AVX2: int16 pairs and exact int32 sums, as int_mm
  const qs::gemm::Int16PairTiles expand{q.data_ptr<int8_t>(), k};
  tiled<qs::gemm::Avx2Int16>(xq.data_ptr<int8_t>(), m, n, k, expand, epi, bf16_bits(out));
#else
#if defined(__AVX512VNNI__)
  if (k % 4 == 0) {  // u8 x s8 quads and exact int32 sums, as int_mm
    std::vector<int32_t> offsets(n);  // 128 * sum_k q: what xq + 128 adds to each sum
    const int32_t* sums = weight_sums.data_ptr<int32_t>();
    for (int64_t c = 0; c < n; ++c) offsets[c] = 128 * sums[c];
    epi.col_offset = offsets.data();
    const qs::gemm::Int8QuadTiles expand{q.data_ptr<int8_t>(), k};
    tiled<qs::gemm::Avx512Vnni>(xq.data_ptr<int8_t>(), m, n, k, expand, epi, bf16_bits(out));
    return out;
  }
#endif
  const qs::gemm::Int8Tiles512 expand{q.data_ptr<int8_t>(), nullptr, nullptr, k};
  tiled(xq.data_ptr<int8_t>(), m, n, k, expand, epi, bf16_bits(out));
#endif
#endif
  return out;
}

// out (M, N) fp32 = xq (M, K) int8 @ q (N, K) int8 ^T: the exact int32 sums, converted as int_mm's .float() (N a
// multiple of the build's block, K even). Only in the AVX2 build (vpmaddwd, Avx2Int16), where int_mm's own sums are
// not exact and an fp32 product of the codes does half the multiply-adds an instruction: the w8a8 build's search
// scores its candidates with it (quant.runtime.kernels.gemm.int8_product).
at::Tensor int8_sums(const at::Tensor& xq, const at::Tensor& q) {
  TORCH_CHECK(gemm_build()[2] == 1, "int8_sums is built only for CPUs with AVX2 and without AVX512-BF16");
  check_int8_codes(q, gemm_build()[0]);
  const int64_t n = q.size(0), k = q.size(1);
  check_xq(xq, k);
  at::Tensor out = at::empty({xq.size(0), n}, xq.options().dtype(at::kFloat));
#if defined(QS_GEMM_DENSE)
  const qs::gemm::Int16PairTiles expand{q.data_ptr<int8_t>(), k};
  tiled<qs::gemm::Avx2Int16>(xq.data_ptr<int8_t>(), xq.size(0), n, k, expand, qs::gemm::Epilogue{},
                             out.data_ptr<float>());
#endif
  return out;
}

// out (M, N) bf16 = x (M, K) bf16 @ w (N, K) bf16 ^T (+ bias fp32), in fp32 (N a multiple of the block): only where
// bf16 products are slower than fp32 (gemm_build()[2]).
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto build = gemm_build();
  TORCH_CHECK(build[2] == 1, "bf16_gemm is built only for CPUs without AVX512-BF16");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "weight must be a contiguous CPU (N, K) bf16 tensor");
  const int64_t n = w.size(0), k = w.size(1);
  check_x(x, k);
  TORCH_CHECK(n % build[0] == 0, "N must be a multiple of ", build[0]);
  const float* bp = optional_bias(bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(QS_GEMM_DENSE)
  const qs::gemm::RowTiles2<qs::gemm::Bf16Row> expand{{bf16_bits(w), k}, k, 2};
  tiled(bf16_bits(x), x.size(0), n, k, expand, {bp}, bf16_bits(out));
#endif
  return out;
}

TORCH_LIBRARY(quantserve_gemm, m) {
  m.def("gemm_build() -> int[]", &gemm_build);
  m.def("int4_gemm(Tensor x, Tensor packed, int n, int k, Tensor scales_zeros, int group_size, Tensor bias) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor weight_scale, Tensor zero, Tensor bias) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor weight, Tensor bias) -> Tensor");
  m.def("w8a8_gemm(Tensor xq, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor weight_sums, Tensor bias) "
        "-> Tensor");
  m.def("int8_sums(Tensor xq, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantserve_gemm, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("bf16_gemm", &bf16_gemm);
  m.impl("w8a8_gemm", &w8a8_gemm);
  m.impl("int8_sums", &int8_sums);
}
