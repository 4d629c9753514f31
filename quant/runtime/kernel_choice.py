"""Which kernel computes a Linear, chosen on the device it runs on (a CPU or a GPU), per row count.

A runtime Linear can be computed several ways, and which is fastest depends on the CPU far more than on the
model: on an AVX2-only CPU a 512-row bf16 matmul is 8x slower than fp32 and ``torch._int_mm`` 25x slower, while
with AVX-512 (bf16, VNNI) the low-bit kernels win at every row count (bench/RESULTS.md#cpu-kernels-per-linear-benchlinear_pathspy). So each module offers
its *paths* for an activation dtype (``QuantizedLinear.paths``; dense Linears get :func:`dense_paths`), each a
callable on a contiguous (M, K) input returning (M, N) in that dtype, and a :class:`Chooser` measures them:

1. every path at each row bucket (:data:`ROW_BUCKETS`), on random inputs, median of a few calls (the paths called
   in turn), smallest bucket first; a path both more than :data:`DROP_FACTOR` times slower than the best at one
   bucket and slower than :data:`DROP_US` is not measured at larger ones (a bf16 product of a big shape on an AVX2
   CPU would otherwise take seconds). Being slower at a few rows alone does not drop a path: dequantizing costs
   the same at any row count, so those paths lose at 1 row and win at 512;
2. per bucket, the fastest path; a call of M rows uses the plan of the smallest bucket >= M (the last above it);
3. the plan is kept per computation (the module's ``plan_key``: class, options, shape, dtype) in a JSON file per
   device (a CPU: model name, vector capability, threads, torch version; a GPU: name, compute capability,
   multiprocessors, torch and triton versions) under the cache dir, so a device measures a shape once; a file
   that cannot be read is measured again, never trusted half-way.

A module whose one-row kernel has launch parameters (the Triton GEMVs on CUDA: tile shape, K split, warps) also
offers a :class:`LaunchSpace`; :meth:`Chooser.tune` searches it on the device before the plan is measured (see
:func:`search`), since the best tile and split differ by GPU and shape far more than a rule can say, and batch-1
decode is one such call per Linear. The chosen launch is kept in the same file.

``mode="static"`` skips measuring and uses each module's built-in rule (``static_path``), which is what every
path falls back to without a plan. Every path computes the same function (the tests hold each to the module's
reference); they differ in where they round.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quant.runtime.kernels import gemm
from quant.runtime.kernels import rows as rowops
from quant.runtime.timing import (DeviceRecord, PathFn, cpu_key, device_key,  # noqa: F401 - cpu_key: for callers
                                  time_paths_us)

log = logging.getLogger("quantserve.kernels")

# 8: a verification of drafts (server/speculate.py) or a small decode batch; 16: a common decode batch; 256: a
# prefill chunk (max_prefill_tokens)
ROW_BUCKETS = (1, 4, 8, 16, 64, 256, 512)
DROP_FACTOR = 3.0  # a path this much slower than the best at a bucket, and slower than DROP_US, is not
DROP_US = 5000.0  # measured at larger buckets
MODES = ("measure", "static")
_CACHE_VERSION = 19  # bumped when a path gets faster or slower, so that every device measures again


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
    transient for the projections, not for the head, which is bound without it); (bf16 or fp32) ``rows``, few-row
    products in one C++ pass (``quant.runtime.kernels.rows.dense``), and (bf16) where the CPU has no fast bf16 GEMM, ``gemm``, many-row
    ones in fp32 tiles (``quant.runtime.kernels.gemm.bf16``)."""
    paths: dict[str, PathFn] = {"dense": lambda x: F.linear(x, weight, bias)}
    if dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu":
        b32 = None if bias is None else bias.float()
        if upcast:
            paths["dense-fp32"] = lambda x: F.linear(x.float(), weight.float(), b32).to(dtype)
        if dtype == torch.bfloat16 == weight.dtype and rowops.available(weight):
            paths["rows"] = rowops.dense(weight, b32)
        if dtype == torch.bfloat16 == weight.dtype and gemm.available(weight, *weight.shape, dtype, dense=True):
            paths["gemm"] = gemm.bf16(weight, b32)
    if dtype == torch.float32 == weight.dtype and rowops.available(weight):
        paths["rows"] = rowops.dense(weight, None if bias is None else bias.float())
    return paths


def on_device(device) -> contextlib.AbstractContextManager:
    """``device`` made the current CUDA device while measuring on it (kernels launch on the current device's
    stream; an engine on cuda:1 must not measure on cuda:0)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
        here = time_paths_us(live, x)
        best = min(here, key=here.__getitem__)
        chosen.append(best)
        for name in us:
            us[name].append(round(here[name], 1) if name in here else None)
        live = {n: fn for n, fn in live.items() if here[n] <= max(DROP_FACTOR * here[best], DROP_US)}
    return RowPlan(tuple(chosen), {k: tuple(v) for k, v in us.items()})


AGREE = 2e-2  # a launch whose one-row result differs from the reference by more (of the largest |output|) is refused


@dataclass(frozen=True)
class LaunchSpace:
    """The launch configurations worth measuring for one computation's one-row kernel.

    ``start``: the configuration the kernel's built-in rule gives; ``axes``: per position of the configuration
    tuple (named by ``names``), the values to try; ``make(config)``: the computation of a (1, K) input launched so;
    ``reference``: what every configuration must agree with (within :data:`AGREE`), the module's dequantized
    product; ``reset``: restores what the kernel keeps between calls (the split-K counters) after a launch that
    failed or disagreed, which may not have left it as it found it."""

    start: tuple[int, ...]
    axes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    make: Callable[[tuple[int, ...]], PathFn]
    reference: PathFn
    reset: Callable[[], None] | None = None  # run after a refused launch: what the kernel keeps between calls

    def describe(self, config: tuple[int, ...]) -> str:
        return ", ".join(f"{n}={v}" for n, v in zip(self.names, config))

    def holds(self, config) -> bool:
        """Whether ``config`` (as read back from a file) is one of this space's."""
        return (isinstance(config, (list, tuple)) and len(config) == len(self.axes)
                and all(v in vals for v, vals in zip(config, self.axes)))


@torch.inference_mode()
def search(space: LaunchSpace, in_features: int, dtype: torch.dtype, device="cpu",
           passes: int = 3) -> tuple[tuple[int, ...], dict[tuple[int, ...], float]]:
    """The fastest configuration found by a coordinate search from ``space.start``, and every one measured (µs).

    1. the start is measured;
    2. one axis at a time, every value of that axis with the others at the best so far is measured; the best is
       then the fastest measured so far;
    3. passes over the axes repeat until one changes nothing (at most ``passes``).

    Each configuration is first run on a random (1, K) input and held to ``space.reference``: one that disagrees
    (a tile shape a compiler got wrong on this device) or fails (one it refuses) is logged and never chosen; if
    none agrees, ValueError.
    A full grid of 4 axes is a few hundred compiled variants; the search measures a few dozen, and the tests
    hold it to the grid's best on cost functions with a single minimum per axis."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, in_features, generator=g, device=device).to(dtype)  # (1, K)
    want = space.reference(x).float()  # (1, N)
    scale = float(want.abs().max()) or 1.0
    timed: dict[tuple[int, ...], float] = {}
    refused: set[tuple[int, ...]] = set()

    def visit(cfg: tuple[int, ...]) -> None:
        if cfg in timed or cfg in refused:
            return
        fn = space.make(cfg)
        try:
            err = float((fn(x).float() - want).abs().max()) / scale
            why = None if err <= AGREE else f"disagrees with the reference (relative error {err:.3g})"  # NaN too
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses (out of registers, shared memory)
            why = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is not None:
            refused.add(cfg)
            log.warning("launch %s %s: not used", space.describe(cfg), why)
            if space.reset is not None:
                space.reset()
            return
        timed[cfg] = time_paths_us({"launch": fn}, x)["launch"]

    best = tuple(space.start)
    visit(best)
    for _ in range(passes):
        before = best
        for axis, values in enumerate(space.axes):
            for v in values:
                visit(best[:axis] + (v,) + best[axis + 1:])
            if timed:
                best = min(timed, key=timed.__getitem__)
        if best == before:
            break
    if not timed:
        raise ValueError(f"no launch of the one-row kernel agrees with its reference on {device} (tried "
                         f"{len(refused)}, from {space.describe(space.start)})")
    return best, timed


class Chooser:
    """Plans for the Linears of one engine on one device (a CPU or a CUDA GPU): measured (and cached per device)
    or static."""

    def __init__(self, mode: str = "static", cache_dir: Path | None = None, threads: int | None = None,
                 head_rows: int | None = None, device: torch.device | str = "cpu"):
        if mode not in MODES:
            raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        # The most rows the output head gets in one call (an engine's max_batch: it sees only the sampled rows),
        # so its plan is not measured at prefill sizes (a 49152 x 576 head at 512 rows took seconds per path).
        self.head_rows = head_rows
        self.device = torch.device(device)
        self.measures = mode == "measure" and self.device.type in ("cpu", "cuda")
        self.key = device_key(self.device, threads) if self.measures else ""
        self.record = (DeviceRecord(cache_dir, "kernel-plans", self.key, _CACHE_VERSION, "plans", "kernel plans", log)
                       if cache_dir is not None and self.measures else None)
        self._plans: dict[str, dict] | None = None
        self.chosen: dict[str, RowPlan] = {}  # plan_key -> plan, for what the engine reports
        self.launches: dict[str, str] = {}  # plan_key -> its one-row launch, described
        self.failed: dict[str, str] = {}  # plan_key -> why measuring it failed (it runs by the built-in rule)
        self._refused: set[tuple[str, str]] = set()  # (what, plan_key) whose measuring failed: not tried again

    def _load(self) -> dict[str, dict]:
        if self._plans is None:
            self._plans = self.record.read() if self.record is not None else {}
        return self._plans

    def _save(self) -> None:
        if self.record is not None:
            self.record.write(self._plans)

    def _here(self, device) -> bool:
        """Whether this chooser measures computations on ``device`` (its own device type, in measure mode)."""
        return self.measures and torch.device(device).type == self.device.type

    def plan(self, key: str, paths: dict[str, PathFn], in_features: int, dtype: torch.dtype,
             device: torch.device, max_rows: int | None = None) -> RowPlan | None:
        """The plan for one computation, or None (static mode, one path only, or not this chooser's device).
        ``max_rows``: the most rows a call will have (the head's: the sampled rows of a step), measured no
        further."""
        if len(paths) < 2 or not self._here(device):
            return None
        plans = self._load()
        if max_rows is not None:  # a plan measured up to fewer rows must not serve a computation with more
            key = f"{key} (<= {ROW_BUCKETS[bucket_index(max_rows)]} rows)"
        got = RowPlan.from_json(plans[key], set(paths)) if key in plans else None
        if got is None and ("kernel plan", key) in self._refused:
            return None  # failed once for another module of the same computation: said once
        if got is None:
            t = time.perf_counter()
            with on_device(device), self._or_rule(key, "kernel plan"):
                got = measure(paths, in_features, dtype, device, max_rows)
            if got is None:
                return None
            log.info("kernel plan for %s: %s (measured in %.2f s)", key, got.describe(), time.perf_counter() - t)
            plans[key] = got.to_json()
            self._save()
        self.chosen[key] = got
        return got

    def tune(self, key: str, space: LaunchSpace, in_features: int, dtype: torch.dtype,
             device: torch.device) -> tuple[int, ...] | None:
        """The one-row launch for one computation (:func:`search`, kept per device), or None (static mode, not
        this chooser's device)."""
        if not self._here(device):
            return None
        plans = self._load()
        entry = f"{key} one-row launch"
        stored = plans.get(entry)
        config = tuple(stored["config"]) if isinstance(stored, dict) and space.holds(stored.get("config")) else None
        if config is None and ("one-row launch", key) in self._refused:
            return None
        if config is None:
            t = time.perf_counter()
            with on_device(device), self._or_rule(key, "one-row launch"):
                config, timed = search(space, in_features, dtype, device)
            if config is None:
                return None
            log.info("one-row launch for %s: %s, %.1f us (the rule's: %s; %d measured in %.2f s)", key,
                     space.describe(config), timed[config], space.describe(space.start), len(timed),
                     time.perf_counter() - t)
            plans[entry] = {"config": list(config),
                            "us": {",".join(map(str, c)): round(us, 2) for c, us in sorted(timed.items())}}
            self._save()
        self.launches[key] = space.describe(config)
        return config

    @contextlib.contextmanager
    def _or_rule(self, key: str, what: str):
        """Measuring that fails, for any reason, is one log line naming the computation and the failure; the caller
        then uses the built-in rule (its result stays None) and the engine starts. On a GPU a failed timing may
        leave the device's state in doubt (a capture that broke), so this chooser measures nothing more there."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a measurement must never take the engine down
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.failed[key] = why
            self._refused.add((what, key))
            rest = ""
            if self.device.type == "cuda":
                self.measures = False
                rest = "; nothing more is measured on this GPU (the built-in rules from here)"
            log.warning("%s for %s not measured (%s): the built-in rule%s", what, key, why, rest)

    def table(self) -> list[str]:
        """One line per planned computation: what runs at which row counts (and its one-row launch, if tuned)."""
        lines = []
        for k in sorted({*self.chosen, *self.launches, *self.failed}):
            parts = [self.chosen[k].describe()] if k in self.chosen else []
            if k in self.launches:
                parts.append(f"one row launched with {self.launches[k]}")
            if k in self.failed:
                parts.append(f"measuring failed ({self.failed[k]}), the built-in rule")
            lines.append(f"{k}: " + "; ".join(parts))
        return lines
