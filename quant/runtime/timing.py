"""How long a computation takes on the device it runs on, and what makes two such timings comparable (the device's
key), for quant.runtime.kernel_choice's plans and the GPU benches.

- A CPU: paths called in turn, a round at a time, wall-clock medians (:func:`time_paths_us`).
- A GPU: calls captured in a CUDA graph and replayed between CUDA events (:func:`cuda_time_us`), as the engine's
  decode step replays its graphs, so host launch latency is not counted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

PathFn = Callable[[torch.Tensor], torch.Tensor]
log = logging.getLogger("quantserve.kernels")


def cpu_key(threads: int | None = None) -> str:
    """What makes timings on this CPU comparable: its model name, the vector capability PyTorch dispatches to
    (``ATEN_CPU_CAPABILITY`` can lower it, as ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS`` lower oneDNN's
    and MKL's), the thread count and the torch version."""
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    for var in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):  # read per call: a process may be started with them
        if os.environ.get(var):
            cap += f" {var}={os.environ[var]}"
    return f"{name} | {cap} | {threads or torch.get_num_threads()} threads | torch {torch.__version__}"


def gpu_key(device: torch.device) -> str:
    """What makes timings on this GPU comparable: its name, compute capability, multiprocessors and memory, and
    the torch and triton versions (triton's looked up without importing it)."""
    p = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    return (f"{p.name} | sm_{p.major}{p.minor} | {p.multi_processor_count} SMs | {p.total_memory >> 20} MiB | "
            f"torch {torch.__version__} | triton {triton}")


def device_key(device: torch.device | str, threads: int | None = None) -> str:
    device = torch.device(device)
    return gpu_key(device) if device.type == "cuda" else cpu_key(threads)



class DeviceRecord:
    """What was measured on one device, kept between processes: ``cache_dir/<kind>/<digest of the device key>.json``,
    ``{"version", "device", <field>: {...}}``, read whole and written whole, atomically (a temporary file replaces
    it: a concurrent reader sees the old file or the new one). A file of another version or device reads as empty
    (measured again); one that cannot be read or written costs a line on ``logger`` (once a record) and nothing
    else."""

    def __init__(self, cache_dir: Path | str, kind: str, device: str, version: int, field: str, what: str,
                 logger: logging.Logger):
        self.file = Path(cache_dir) / kind / f"{hashlib.sha256(device.encode()).hexdigest()[:16]}.json"
        self.device, self.version, self.field, self.what, self.log = device, version, field, what, logger
        self._said: set[str] = set()

    def _say(self, how: str, e: Exception) -> None:
        if how not in self._said:
            self._said.add(how)
            self.log.warning(how, self.what, self.file, e)

    def read(self) -> dict:
        if not self.file.is_file():
            return {}
        try:
            d = json.loads(self.file.read_text())
            if d.get("version") == self.version and d.get("device") == self.device:
                if not isinstance(d[self.field], dict):
                    raise TypeError(f"{self.field} is not an object")
                return dict(d[self.field])
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._say("%s in %s unreadable (%s); measuring again", e)
        return {}

    def write(self, data: dict) -> None:
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": self.version, "device": self.device, self.field: data}, indent=1))
            tmp.replace(self.file)
        except OSError as e:
            self._say("could not keep %s in %s (%s)", e)


def time_paths_us(paths: dict[str, PathFn], x: torch.Tensor, budget_s: float = 0.05) -> dict[str, float]:
    """Median µs of each path's call on ``x``: on a GPU by :func:`cuda_time_us`, on a CPU by :func:`cpu_time_us`."""
    if x.is_cuda:
        return {name: cuda_time_us(lambda fn=fn: fn(x), device=x.device) for name, fn in paths.items()}
    return cpu_time_us(paths, x, budget_s)


def cpu_time_us(paths: dict[str, PathFn], x: torch.Tensor, budget_s: float = 0.05) -> dict[str, float]:
    """Median µs of each path's calls on ``x`` after a warm-up call each. The paths are called in turn, a round at
    a time, so that a change in the machine's speed while measuring (another process, a clock step) falls on all
    of them alike: timed one after the other, two paths within 5% of each other were ranked by the drift (the
    plans picked dequantizing over the tiled product that beat it by 20% when interleaved). At least 3 rounds,
    then up to 15 within ``budget_s`` per path (fewer when one is slow: a 512-row bf16 product on an AVX2 CPU takes
    a tenth of a second)."""
    for fn in paths.values():
        fn(x)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    t_end = time.perf_counter() + budget_s * len(paths)
    rounds = 0
    while rounds < 3 or (time.perf_counter() < t_end and rounds < 15):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn(x)
            samples[name].append(time.perf_counter() - t)
        rounds += 1
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


class CudaGraphAPI:
    """What :func:`cuda_time_us` asks of CUDA, in one place: a CPU test stands in for it (tests/test_timing.py), so
    the rules below hold in CI, not only on a lent GPU.

    The rules (both broke an engine's start on an H100 when they were not kept, bench/RESULTS.md#gpu-figures-not-re-measured-since-benchgpupy):

    1. **A graph memory pool per timing, never captured into again.** The caching allocator frees a private pool
       once the last graph captured into it is deleted; a later capture into the same handle trips its internal
       assert (``use_count > 0``). So each timing takes a fresh handle (:meth:`pool`) for its graphs, and drops it
       with them.
    2. **A failed capture leaves the CUDA generator as it found it.** ``capture_begin`` puts the device's default
       generator into capture mode before anything else can fail, and only a completed ``capture_end`` takes it
       out: after a failure every later draw on the device raises ("Offset increment outside graph capture").
       So the generator's state is cloned before the capture and put back (:meth:`restore_generator`) when the
       capture fails.
    3. **A failed capture leaves the allocator as it found it.** ``capture_end`` ends the stream capture before it
       stops routing allocations into the pool, and a graph whose capture never ended never releases its pool: after
       an invalidated capture the allocator would keep a capture "under way" (the next ``empty_cache`` asserts) and a
       pool reference for ever. :meth:`abandon_capture` undoes both."""

    def __init__(self):
        self._streams: dict[int, object] = {}

    def stream(self, index: int):
        """One timing stream per device: the warm-up and the capture run on it (cuBLAS keeps a workspace per
        stream; a new stream per timing would leave one behind each time), never on the stream the engine's decode
        graphs are captured on."""
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(index)
        return self._streams[index]

    def device(self, index: int):
        return torch.cuda.device(index)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self):
        return torch.cuda.current_stream()

    def l2_bytes(self, index: int) -> int:
        return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 64 << 20

    def flush_buffer(self, nbytes: int, index: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def graph(self):
        return torch.cuda.CUDAGraph()

    def generator(self, index: int) -> torch.Generator:
        return torch.cuda.default_generators[index]

    def save_generator(self, index: int):
        return self.generator(index).clone_state()

    def restore_generator(self, index: int, saved) -> None:
        self.generator(index).graphsafe_set_state(saved)

    def abandon_capture(self, index: int, pool, graph) -> None:
        """After a capture that failed once ``capture_begin`` had returned (rule 3): stop routing allocations into
        ``pool`` (unless ``capture_end`` got that far), and drop the reference the graph took on it unless its capture
        ended (then the graph releases it itself)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool
        try:
            end(index, pool)
        except RuntimeError:  # "not currently recording to mempool_id": capture_end had done it
            pass
        try:
            graph.pool()  # raises unless the capture ended
        except RuntimeError:
            torch._C._cuda_releasePool(index, pool)


CUDA = CudaGraphAPI()  # the one instance cuda_time_us uses (a test swaps in its stand-in)


def cuda_time_us(fn: Callable[[], object], reps: int = 20, warm: int = 3, inner: int = 10,
                 device: torch.device | str | None = None, cold: bool = True, graph: bool = True) -> float:
    """Median µs of one ``fn()`` on the GPU, as the engine's decode step runs it: ``inner`` calls captured in a CUDA
    graph and replayed between CUDA events, so host launch latency is not counted.

    ``cold``: each call is preceded in the graph by a write over twice the L2 cache, so that it reads its weights
    from memory, as a decode step does (the whole model's weights pass through L2 once per step; replaying one
    call on the same weights would time a 13 MB projection out of an H100's 50 MB L2). The writes are timed in a
    graph of their own, replayed in turn with the first, and subtracted.

    The warm-up calls come first, outside the capture: they compile the kernels and allocate what the kernels keep
    (the split-K counters). Both graphs of one timing are captured into a pool of their own, dropped with them
    (:class:`CudaGraphAPI`'s rules). A call that cannot be captured (one that synchronises) raises, the generator
    and the allocator put back as they were; no eager fallback is tried after it. ``graph=False`` times eager calls instead (host launch
    latency included), for a call known not to be capturable."""
    api = CUDA
    dev = torch.device(device if device is not None else "cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with api.device(index):
        stream = api.stream(index)
        stream.wait_stream(api.current_stream())
        flush = api.flush_buffer(2 * api.l2_bytes(index), index) if cold else None
        with api.use_stream(stream):
            for _ in range(warm):
                fn()
        stream.synchronize()
        if graph:
            pool = api.pool()  # this timing's own: never captured into once its graphs are gone (rule 1)
            runs = [_capture(api, index, fn, inner, stream, pool, flush).replay]
            if flush is not None:
                runs.append(_capture(api, index, None, inner, stream, pool, flush).replay)
        else:
            runs = [lambda: _rounds(fn, inner, flush)] + ([lambda: _rounds(None, inner, flush)] if cold else [])
        api.current_stream().wait_stream(stream)
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(reps):
            for run, t in zip(runs, times):  # in turn: a clock change falls on both
                a, b = api.event(), api.event()
                a.record()
                run()
                b.record()
                b.synchronize()
                t.append(a.elapsed_time(b) * 1e3 / inner)  # ms -> µs per call
        us = statistics.median(times[0]) - (statistics.median(times[1]) if flush is not None else 0.0)
        del runs  # the graphs, and with them the pool's last users
    return max(us, 0.0)


def _rounds(fn, inner: int, flush) -> None:
    """``inner`` rounds of (``flush`` written over, where given; ``fn()``, where given)."""
    for _ in range(inner):
        if flush is not None:
            flush.fill_(1)
        if fn is not None:
            fn()


def _capture(api: CudaGraphAPI, index: int, fn, inner: int, stream, pool, flush):
    """A graph of ``inner`` rounds of (``flush`` written over, where given; ``fn()``, where given), captured on
    ``stream`` into ``pool`` (torch.cuda.graph's context would also collect garbage and empty the allocator's cache
    at each capture: hundreds of times in an engine's start). A capture that fails puts the device's generator back
    as it was before it (:class:`CudaGraphAPI`'s rule 2) and raises."""
    saved = api.save_generator(index)
    g = api.graph()
    began = False
    try:
        with api.use_stream(stream):
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            began = True
            try:
                _rounds(fn, inner, flush)
            finally:
                g.capture_end()
    except BaseException:
        undo = [("generator", lambda: api.restore_generator(index, saved))]
        if began:
            undo.append(("allocator", lambda: api.abandon_capture(index, pool, g)))
        for what, step in undo:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the capture's own error is the one to raise
                log.warning("CUDA %s not restored after a failed capture (%s: %s)", what, type(e).__name__, e)
        raise
    return g
