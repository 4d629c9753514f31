// A parallel loop whose threads share the work as they go: the rows passes' split of a weight over the threads.
//
// at::parallel_for gives each thread a fixed equal run, and a call waits for the slowest. On the 2-vCPU machines the
// project runs on, one vCPU intermittently runs at about half the other's speed while both are busy (2026-12-07, Zen
// 3, the int4 rows pass on gate_up, one row, warm weights, in-call timers: thread 0 done with its half at 33 us,
// thread 1 at 54; in other seconds both at 31-39). Here each thread still walks its own contiguous run from the
// front (its stream through memory unbroken), claiming a few items at a time, and a thread done with its run takes
// items from the back of the run with the most left. The default model's 120 int4 projections of a token (30
// layers' distinct weights in turn, one row, 2 threads) took 0.88x, 0.93x and 0.92x the static split's time
// (an ad hoc harness with both splits built side by side; medians of 40 passes, three runs).
// Each item is computed by one thread with the same code whichever thread takes it, so results do not change.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace qs {

// f(begin, end) over [0, n) in pieces; threads = at most one per `grain` items (as at::parallel_for's grain).
template <typename F>
void balanced_for(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (threads <= 1 || at::in_parallel_region() || n >= (int64_t{1} << 32)) {
    at::parallel_for(0, n, grain, f);
    return;
  }
  constexpr int64_t kClaims = 16;  // a run is taken in about this many pieces (the most a thief waits on)
  struct alignas(64) Run {
    std::atomic<uint64_t> span;  // [front, back): front in the low 32 bits
  };
  const auto pack = [](uint64_t lo, uint64_t hi) { return lo | (hi << 32); };
  std::vector<Run> runs(threads);
  for (int64_t t = 0; t < threads; ++t) runs[t].span.store(pack(n * t / threads, n * (t + 1) / threads));
  const uint64_t piece = static_cast<uint64_t>(std::max<int64_t>(1, n / threads / kClaims));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::atomic<uint64_t>& own = runs[t].span;
      for (uint64_t v = own.load(std::memory_order_relaxed);;) {  // the own run, from its front
        const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
        if (lo >= hi) break;
        const uint64_t end = std::min(lo + piece, hi);
        if (own.compare_exchange_weak(v, pack(end, hi))) {
          f(static_cast<int64_t>(lo), static_cast<int64_t>(end));
          v = own.load(std::memory_order_relaxed);
        }
      }
      for (;;) {  // then the back of whichever run has the most left
        Run* most = nullptr;
        uint64_t left = 0;
        for (Run& r : runs) {
          const uint64_t v = r.span.load(std::memory_order_relaxed), lo = v & 0xffffffffu, hi = v >> 32;
          if (hi > lo && hi - lo > left) left = hi - lo, most = &r;
        }
        if (!most) break;
        uint64_t v = most->span.load(std::memory_order_relaxed);
        const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
        if (lo >= hi) continue;
        const uint64_t begin = hi - std::min(piece, hi - lo);
        if (most->span.compare_exchange_weak(v, pack(lo, begin)))
          f(static_cast<int64_t>(begin), static_cast<int64_t>(hi));
      }
    }
  });
}

}  // namespace qs
