"""quant.runtime.timing's GPU timer held to the CUDA graph API's rules on the CPU, through a stand-in for that API which
fails the way the real one does (tests/test_cuda.py times real kernels on a lent GPU).

The stand-in models the two behaviours that took every measured CUDA engine down at start (bench/RESULTS.md,
2026-11): the caching allocator asserts when a capture goes into a pool whose graphs were all deleted, and a
capture that fails after ``capture_begin`` leaves the device's generator in capture mode, so every later draw
raises."""

from __future__ import annotations

import contextlib
import gc
import itertools

import pytest
import torch

from quant.runtime import timing

pytestmark = pytest.mark.unit


class _GenState:
    def __init__(self, capturing: bool = False):
        self.capturing = capturing


class _Generator:
    def __init__(self):
        self.state = _GenState()

    def clone_state(self) -> _GenState:
        return _GenState()  # a clone is never in capture mode (CUDAGeneratorState::clone)

    def graphsafe_set_state(self, state: _GenState) -> None:
        self.state = state


class _Graph:
    def __init__(self, api: "_FakeCuda"):
        self.api, self.pool = api, None

    def capture_begin(self, pool, capture_error_mode):
        api = self.api
        api.gen.state.capturing = True  # the generator's prologue runs before the allocator is asked for the pool
        p = api.pools.setdefault(pool, {"live": 0, "used": False})
        if p["used"] and p["live"] == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp")
        p["live"] += 1  # the graph's reference on its pool, dropped when it is deleted, if its capture ended
        p["used"] = True
        api.underway.add(pool)  # the allocator routes allocations into the pool until the capture ends
        self.pool, self.ended = pool, False
        api.log.append(("capture", pool))
        api.capturing, api.broken = True, False

    def capture_end(self):
        api = self.api
        api.capturing = False
        if api.broken:  # cudaStreamEndCapture of an invalidated capture: nothing after it runs
            raise RuntimeError("operation not permitted when stream is capturing")
        api.underway.discard(self.pool)
        api.gen.state.capturing = False
        self.ended = True

    def pool_id(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool

    def replay(self):
        pass

    def __del__(self):
        if self.pool is not None and self.ended:
            self.api.pools[self.pool]["live"] -= 1
            self.api.log.append(("free", self.pool))


class _Stream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _Event:
    clock = itertools.count()

    def record(self):
        self.t = next(self.clock)

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return float(other.t - self.t)


class _FakeCuda(timing.CudaGraphAPI):
    """The CUDA calls cuda_time_us makes, on the CPU, with the allocator's and the generator's rules."""

    def __init__(self):
        super().__init__()
        self.handles = itertools.count(1)
        self.pools: dict[int, dict] = {}
        self.log: list[tuple[str, int]] = []
        self.gen = _Generator()
        self.capturing = self.broken = False
        self.underway: set[int] = set()  # pools the allocator routes allocations into

    def stream(self, index):
        return _Stream()

    def device(self, index):
        return contextlib.nullcontext()

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self):
        return _Stream()

    def l2_bytes(self, index):
        return 64

    def flush_buffer(self, nbytes, index):
        return torch.empty(nbytes, dtype=torch.uint8)

    def event(self):
        return _Event()

    def pool(self):
        return next(self.handles)

    def graph(self):
        return _Graph(self)

    def generator(self, index):
        return self.gen

    def abandon_capture(self, index, pool, graph):
        # the real one's calls, as the allocator answers them: end the routing (an error if it had ended), then drop
        # the graph's reference unless its capture ended
        if pool not in self.underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.underway.discard(pool)
        try:
            graph.pool_id()
        except RuntimeError:
            self.pools[pool]["live"] -= 1

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache on 2.11: it asserts no capture is under way."""
        assert not self.underway, "captures_underway.empty() INTERNAL ASSERT FAILED"

    def draw(self) -> None:
        """A random draw on the device outside any capture (torch.randint(..., device="cuda"))."""
        if self.gen.state.capturing and not self.capturing:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")


@pytest.fixture
def fake(monkeypatch) -> _FakeCuda:
    api = _FakeCuda()
    monkeypatch.setattr(timing, "CUDA", api)
    return api


def _sync_in_capture(api: _FakeCuda):
    """A call that cannot be captured: it synchronises, which invalidates the capture."""
    def fn():
        if api.capturing:
            api.broken = True
            raise RuntimeError("operation not permitted when stream is capturing")
    return fn


@pytest.mark.parametrize("cold", [True, False])
def test_each_timing_captures_into_a_pool_of_its_own_that_dies_with_its_graphs(fake, cold):
    """Timings one after another (an engine's start makes hundreds): each captures its graphs into one fresh pool,
    never one whose graphs are gone, and its graphs are freed when it returns."""
    calls = []
    for _ in range(4):
        us = timing.cuda_time_us(lambda: calls.append(1), reps=3, warm=1, inner=2, device="cuda:0", cold=cold)
        assert us >= 0.0
        gc.collect()
    captured = [p for what, p in fake.log if what == "capture"]
    per_timing = 2 if cold else 1  # the call's graph, and the flush's graph to subtract
    assert len(captured) == 4 * per_timing
    assert [len(set(captured[i:i + per_timing])) for i in range(0, len(captured), per_timing)] == [1] * 4
    assert len(set(captured)) == 4  # no handle is captured into by two timings
    assert all(p["live"] == 0 for p in fake.pools.values())  # each timing's graphs freed with it
    first_free = {p: fake.log.index(("free", p)) for p in set(captured)}
    assert all(fake.log.index(("capture", p)) < first_free[p] for p in first_free)
    assert len(calls) == 4 * (1 + 2)  # the warm-up call, then two inside the capture (replays run no Python)
    fake.draw()


def test_a_pool_reused_after_its_graphs_died_is_what_the_stand_in_refuses(fake):
    """The stand-in fails as the allocator does (so the test above could fail): one handle kept across timings, as
    the timer once did, trips the assert at the second timing, and the generator is left usable."""
    fake.pool = lambda: 7
    timing.cuda_time_us(lambda: None, reps=2, warm=1, inner=1, device="cuda:0", cold=False)
    gc.collect()
    with pytest.raises(RuntimeError, match="use_count > 0"):
        timing.cuda_time_us(lambda: None, reps=2, warm=1, inner=1, device="cuda:0", cold=False)
    fake.draw()  # the generator was put back: a later draw does not raise


def test_a_failed_capture_raises_and_leaves_the_generator_and_the_allocator_usable(fake):
    """A call that cannot be captured raises from the timer; the device's generator and the allocator are put back
    as they were (no capture left under way, no pool reference held for ever), so the process's later draws, cache
    emptying and timings work."""
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        timing.cuda_time_us(_sync_in_capture(fake), reps=2, warm=1, inner=2, device="cuda:0")
    fake.draw()
    fake.empty_cache()
    gc.collect()
    assert all(p["live"] == 0 for p in fake.pools.values())
    assert timing.cuda_time_us(lambda: None, reps=2, warm=1, inner=2, device="cuda:0") >= 0.0
    fake.draw()
    fake.empty_cache()


def test_without_the_allocators_undo_the_stand_in_shows_a_capture_left_under_way(fake, monkeypatch):
    """What rule 3 prevents, shown on the stand-in: without it a failed capture stays under way in the allocator
    (the next empty_cache asserts on torch 2.11) and its pool is never released."""
    monkeypatch.setattr(fake, "abandon_capture", lambda index, pool, graph: None)
    with pytest.raises(RuntimeError):
        timing.cuda_time_us(_sync_in_capture(fake), reps=2, warm=1, inner=2, device="cuda:0")
    gc.collect()
    with pytest.raises(AssertionError, match="captures_underway"):
        fake.empty_cache()
    assert any(p["live"] == 1 for p in fake.pools.values())


def test_without_the_restore_the_stand_in_shows_the_poisoned_generator(fake, monkeypatch):
    """What rule 2 prevents, shown on the stand-in: with the generator not put back, the failed capture leaves
    every later draw raising."""
    monkeypatch.setattr(fake, "restore_generator", lambda index, saved: None)
    with pytest.raises(RuntimeError):
        timing.cuda_time_us(_sync_in_capture(fake), reps=2, warm=1, inner=2, device="cuda:0")
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        fake.draw()
