"""Which kernel computes a Linear, chosen on the CPU it runs on, per row count.

A runtime Linear can be computed several ways, and which is fastest depends on the CPU far more than on the
model: on an AVX2-only CPU a 512-row bf16 matmul is 8x slower than fp32 and ``torch._int_mm`` 25x slower, while
with AVX-512 (bf16, VNNI) the low-bit kernels win at every row count (bench/RESULTS.md). So each module offers
its *paths* for an activation dtype (``QuantizedLinear.paths``; dense Linears get :func:`dense_paths`), each a
callable on a contiguous (M, K) input returning (M, N) in that dtype, and a :class:`Chooser` measures them:

1. every path at each row bucket (:data:`ROW_BUCKETS`), on random inputs, median of a few calls (the paths called
   in turn), smallest bucket first; a path both more than :data:`DROP_FACTOR` times slower than the best at one
   bucket and slower than :data:`DROP_US` is not measured at larger ones (a bf16 product of a big shape on an AVX2
   CPU would otherwise take seconds). Being slower at a few rows alone does not drop a path: dequantizing costs
   the same at any row count, so those paths lose at 1 row and win at 512;
2. per bucket, the fastest path; a call of M rows uses the plan of the smallest bucket >= M (the last above it);
3. the plan is kept per computation (the module's ``plan_key``: class, options, shape, dtype) in a JSON file per
   CPU (model name, vector capability, threads, torch version) under the cache dir, so a CPU measures a shape
   once; a file that cannot be read is measured again, never trusted half-way.

``mode="static"`` skips measuring and uses each module's built-in rule (``static_path``), which is what every
path falls back to without a plan. Every path computes the same function (the tests hold each to the module's
reference); they differ in where they round.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quant import gemm
from quant import rows as rowops

log = logging.getLogger("quantserve.kernels")

ROW_BUCKETS = (1, 4, 16, 64, 256, 512)  # 16: a common decode batch; 256: a prefill chunk (max_prefill_tokens)
DROP_FACTOR = 3.0  # a path this much slower than the best at a bucket, and slower than DROP_US, is not
DROP_US = 5000.0  # measured at larger buckets
MODES = ("measure", "static")
_CACHE_VERSION = 10  # bumped when a path gets faster or slower (3: the int4 dequantizer writes W^T, 3-6x faster;
# 4: the C++ kernels run on all threads, and the int8 Linears have a one-call `rows` path; 5: the int4 dequantizer's
# and the rows paths' inner loops written with intrinsics; 6: int4 Linears have a `rows` path; 7: bf16 ones too; 8:
# bf16 int4 rows two columns per instruction with AVX512-BF16; 9: int4 and int8 Linears have a `gemm` path, and
# the paths are timed in turn; with AVX2, bf16 Linears have one too; 10: AVX2's gemm rounds its sums in vector
# steps, and its int8 tiles leave the scales to the sums)

PathFn = Callable[[torch.Tensor], torch.Tensor]


def bucket_index(rows: int) -> int:
    """The bucket whose plan a call of `rows` rows takes: the smallest >= rows, the last above it."""
    return min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)


@dataclass(frozen=True)
class RowPlan:
    """The path for each row bucket, and what was measured (µs per call; None where a path was not run)."""

    paths: tuple[str, ...]  # one per ROW_BUCKETS entry
    us: dict[str, tuple[float | None, ...]]

    def pick(self, rows: int) -> str:
        return self.paths[bucket_index(rows)]

    @property
    def single(self) -> str | None:
        """The path when every bucket uses the same one."""
        return self.paths[0] if len(set(self.paths)) == 1 else None

    def describe(self) -> str:
        """'kernel <= 32 rows, dequant above 32': each run of buckets taking one path, by its last bucket."""
        runs: list[list] = []  # [path, index of its last bucket]
        for i, p in enumerate(self.paths):
            if runs and runs[-1][0] == p:
                runs[-1][1] = i
            else:
                runs.append([p, i])
        if len(runs) == 1:
            return f"{runs[0][0]} at every row count"
        head = [f"{p} <= {ROW_BUCKETS[i]} rows" for p, i in runs[:-1]]
        return ", ".join([*head, f"{runs[-1][0]} above {ROW_BUCKETS[runs[-2][1]]}"])

    def to_json(self) -> dict:
        return {"paths": list(self.paths), "us": {k: list(v) for k, v in self.us.items()}}

    @classmethod
    def from_json(cls, d: dict, names: set[str]) -> "RowPlan | None":
        """The stored plan, or None when it does not fit (other buckets, a path this module does not offer)."""
        paths = tuple(d.get("paths", ()))
        if len(paths) != len(ROW_BUCKETS) or not set(paths) <= names:
            return None
        return cls(paths, {k: tuple(v) for k, v in d.get("us", {}).items()})


def computation_key(kind: str, out_features: int, in_features: int, dtype: torch.dtype) -> str:
    """What a plan is kept under: the computation (its kind and options), its shape and the activation dtype."""
    return f"{kind} {out_features}x{in_features} {str(dtype).removeprefix('torch.')}"


def dense_key(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> str:
    kind = f"dense[{str(weight.dtype).removeprefix('torch.')}{',bias' if bias is not None else ''}]"
    return computation_key(kind, weight.shape[0], weight.shape[1], dtype)


def dense_paths(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                upcast: bool = True) -> dict[str, PathFn]:
    """A float Linear's paths: in its own dtype; (16-bit, ``upcast``) upcast to fp32 per call, which wins for many
    rows where the CPU has no fast 16-bit GEMM but holds an fp32 copy of W while it runs (the engine counts that
    transient for the projections, not for the head, which is bound without it); (bf16) ``rows``, few-row
    products in one C++ pass (``quant.rows.bf16``), and where the CPU has no fast bf16 GEMM, ``gemm``, many-row
    ones in fp32 tiles (``quant.gemm.bf16``)."""
    paths: dict[str, PathFn] = {"dense": lambda x: F.linear(x, weight, bias)}
    if dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu":
        b32 = None if bias is None else bias.float()
        if upcast:
            paths["dense-fp32"] = lambda x: F.linear(x.float(), weight.float(), b32).to(dtype)
        if dtype == torch.bfloat16 == weight.dtype and rowops.available(weight):
            paths["rows"] = rowops.bf16(weight, b32)
        if dtype == torch.bfloat16 == weight.dtype and gemm.available(weight, *weight.shape, dtype, dense=True):
            paths["gemm"] = gemm.bf16(weight, b32)
    return paths


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


def _time_us(paths: dict[str, PathFn], x: torch.Tensor, budget_s: float = 0.05) -> dict[str, float]:
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


@torch.inference_mode()
def measure(paths: dict[str, PathFn], in_features: int, dtype: torch.dtype, device="cpu",
            max_rows: int | None = None) -> RowPlan:
    """Time every path at every bucket (steps 1 and 2 of the module docstring); with ``max_rows``, only up to the
    bucket that holds it, the buckets above taking that bucket's path (calls never have more rows)."""
    g = torch.Generator(device=device).manual_seed(0)
    live = dict(paths)
    us: dict[str, list[float | None]] = {name: [] for name in paths}
    last = len(ROW_BUCKETS) - 1 if max_rows is None else bucket_index(max_rows)  # the last bucket measured
    chosen = []
    for i, rows in enumerate(ROW_BUCKETS):
        if i > last:
            chosen.append(chosen[-1])
            for name in us:
                us[name].append(None)
            continue
        x = torch.randn(rows, in_features, generator=g, device=device).to(dtype)  # (M, K)
        here = _time_us(live, x)
        best = min(here, key=here.__getitem__)
        chosen.append(best)
        for name in us:
            us[name].append(round(here[name], 1) if name in here else None)
        live = {n: fn for n, fn in live.items() if here[n] <= max(DROP_FACTOR * here[best], DROP_US)}
    return RowPlan(tuple(chosen), {k: tuple(v) for k, v in us.items()})


class Chooser:
    """Plans for the Linears of one engine: measured (and cached per CPU) or static."""

    def __init__(self, mode: str = "static", cache_dir: Path | None = None, threads: int | None = None,
                 head_rows: int | None = None):
        if mode not in MODES:
            raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        # The most rows the output head gets in one call (an engine's max_batch: it sees only the sampled rows),
        # so its plan is not measured at prefill sizes (a 49152 x 576 head at 512 rows took seconds per path).
        self.head_rows = head_rows
        self.key = cpu_key(threads)
        self.file = None
        if cache_dir is not None:
            digest = hashlib.sha256(self.key.encode()).hexdigest()[:16]
            self.file = Path(cache_dir) / "kernel-plans" / f"{digest}.json"
        self._plans: dict[str, dict] | None = None
        self.chosen: dict[str, RowPlan] = {}  # plan_key -> plan, for what the engine reports

    def _load(self) -> dict[str, dict]:
        if self._plans is None:
            self._plans = {}
            if self.file is not None and self.file.is_file():
                try:
                    d = json.loads(self.file.read_text())
                    if d.get("version") == _CACHE_VERSION and d.get("cpu") == self.key:
                        self._plans = dict(d["plans"])
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("kernel plans in %s unreadable (%s); measuring again", self.file, e)
        return self._plans

    def _save(self) -> None:
        if self.file is None:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": _CACHE_VERSION, "cpu": self.key, "plans": self._plans}, indent=1))
            tmp.replace(self.file)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as e:
            log.warning("could not keep kernel plans in %s (%s)", self.file, e)

    def plan(self, key: str, paths: dict[str, PathFn], in_features: int, dtype: torch.dtype,
             device: torch.device, max_rows: int | None = None) -> RowPlan | None:
        """The plan for one computation, or None (static mode, one path only, or not a CPU). ``max_rows``: the
        most rows a call will have (the head's: the sampled rows of a step), measured no further."""
        if self.mode == "static" or len(paths) < 2 or torch.device(device).type != "cpu":
            return None
        plans = self._load()
        if max_rows is not None:  # a plan measured up to fewer rows must not serve a computation with more
            key = f"{key} (<= {ROW_BUCKETS[bucket_index(max_rows)]} rows)"
        got = RowPlan.from_json(plans[key], set(paths)) if key in plans else None
        if got is None:
            t = time.perf_counter()
            got = measure(paths, in_features, dtype, device, max_rows)
            log.info("kernel plan for %s: %s (measured in %.2f s)", key, got.describe(), time.perf_counter() - t)
            plans[key] = got.to_json()
            self._save()
        self.chosen[key] = got
        return got

    def table(self) -> list[str]:
        """One line per planned computation: what runs at which row counts."""
        return [f"{k}: {p.describe()}" for k, p in sorted(self.chosen.items())]
