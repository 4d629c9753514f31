// The sampler's counter-based uniforms (server/random_stream.py holds the plain PyTorch reference and the design):
// u[b, j] from MurmurHash3_x86_32 of (seed_b lo, seed_b hi, step_b lo, step_b hi, id) under two salts, 52 bits,
// (x + 0.5) * 2**-52. Integer arithmetic on uint32 lanes and one exact conversion: bit for bit the reference.
// The reference spends ~30 int64 tensor ops per salt over (B, V); here each element is one pass in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr uint32_t C1 = 0xCC9E2D51u, C2 = 0x1B873593u;
constexpr uint32_t SALTS[2] = {0x9E3779B9u, 0x7F4A7C15u};
constexpr uint32_t MSG_BYTES = 20;

inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }
inline uint32_t mix_block(uint32_t k) { return rotl(k * C1, 15) * C2; }
inline uint32_t absorb(uint32_t h, uint32_t k) { return rotl(h ^ mix_block(k), 13) * 5u + 0xE6546B64u; }
inline uint32_t finish(uint32_t h, uint32_t id) {
  h = absorb(h, id) ^ MSG_BYTES;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline double uniform(const uint32_t h[2], uint32_t id) {
  const uint64_t x = (uint64_t(finish(h[0], id)) << 20) | (finish(h[1], id) >> 12);
  return (double(int64_t(x)) + 0.5) * 0x1p-52;
}

// seeds, steps (B,) int64; ids (B, K) int64 ids in [0, 2**32), or undefined for every id below vocab.
at::Tensor random_uniform(const at::Tensor& seeds, const at::Tensor& steps, const c10::optional<at::Tensor>& ids,
                          int64_t vocab) {
  TORCH_CHECK(seeds.dim() == 1 && steps.sizes() == seeds.sizes(), "seeds and steps must be (B,)");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && steps.scalar_type() == at::kLong, "seeds and steps must be int64");
  const int64_t B = seeds.size(0);
  const bool listed = ids.has_value() && ids->defined();
  at::Tensor idt;
  if (listed) {
    TORCH_CHECK(ids->dim() == 2 && ids->size(0) == B && ids->scalar_type() == at::kLong, "ids must be (B, K) int64");
    idt = ids->contiguous();
  }
  const int64_t K = listed ? idt.size(1) : vocab;
  auto s = seeds.contiguous(), t = steps.contiguous();
  const int64_t *sp = s.data_ptr<int64_t>(), *tp = t.data_ptr<int64_t>();
  const int64_t* ip = listed ? idt.data_ptr<int64_t>() : nullptr;
  auto out = at::empty({B, K}, seeds.options().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  at::parallel_for(0, B * K, 8192, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo / K; r * K < hi; ++r) {
      const uint64_t seed = static_cast<uint64_t>(sp[r]), step = static_cast<uint64_t>(tp[r]);
      uint32_t h[2];
      for (int salt = 0; salt < 2; ++salt) {
        uint32_t x = SALTS[salt];
        for (uint32_t w : {uint32_t(seed), uint32_t(seed >> 32), uint32_t(step), uint32_t(step >> 32)})
          x = absorb(x, w);
        h[salt] = x;
      }
      const int64_t b = std::max(lo, r * K) - r * K, e = std::min(hi, (r + 1) * K) - r * K;
      const int64_t* row_ids = ip ? ip + r * K : nullptr;
      double* o = op + r * K;
      if (row_ids) {
#pragma omp simd
        for (int64_t j = b; j < e; ++j) o[j] = uniform(h, uint32_t(row_ids[j]));
      } else {
#pragma omp simd
        for (int64_t j = b; j < e; ++j) o[j] = uniform(h, uint32_t(j));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantserve, m) {
  m.def("random_uniform(Tensor seeds, Tensor steps, Tensor? ids, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantserve, CPU, m) { m.impl("random_uniform", &random_uniform); }
