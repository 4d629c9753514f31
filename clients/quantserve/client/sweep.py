"""The sampling sweep: every (temperature, top_k, top_p) combination x seeds 0..S-1, concurrently, a cell's seeds
as the samples of one request (``n``).

Each request asks for logprobs=0 (each generated token's logprob under the model's raw distribution) and
trace=1 (the exact per-step entropy of the distribution the token was drawn from); :mod:`quantserve.client.metrics`
turns a cell's results into one row. Rows are written as CSV or JSON (one row per cell, the same columns) and
read back by :mod:`quantserve.client.plot`.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from quantserve.client.client import Client
from quantserve.client.metrics import METRIC_NAMES, CellMetrics, cell_metrics
from quantserve.client.types import Result

GRID_NAMES = ("temperature", "top_k", "top_p")
COLUMNS = GRID_NAMES + METRIC_NAMES


@dataclass(frozen=True)
class SweepSpec:
    prompt: str
    temperatures: tuple[float, ...]
    top_ks: tuple[int, ...]
    top_ps: tuple[float, ...]
    seeds: int  # seeds 0 .. seeds-1 per cell
    max_new_tokens: int | None = None  # None: the server's default
    concurrency: int = 16  # requests in flight (each of up to MAX_N samples; the server queues what exceeds its batch)

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("temperatures", "top_ks", "top_ps"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")

    def cells(self) -> list[tuple[float, int, float]]:
        """The grid, temperature-major (the table's and the files' row order)."""
        return list(itertools.product(self.temperatures, self.top_ks, self.top_ps))

    @property
    def requests(self) -> int:
        return len(self.cells()) * self.seeds


@dataclass(frozen=True)
class SweepRow:
    temperature: float
    top_k: int
    top_p: float
    metrics: CellMetrics

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                **dataclasses.asdict(self.metrics)}


def parse_list(text: str, kind: type, name: str) -> tuple:
    """"0,0.7,1.0" -> (0.0, 0.7, 1.0); a clear ValueError naming the flag otherwise."""
    try:
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not vals:
        raise ValueError(f"--{name} must list at least one value")
    return vals


MAX_N = 16  # samples per request: a cell's seeds go in requests of up to this many (the server's n)


def run_sweep(client: Client, spec: SweepSpec, progress: Callable[[int, int], None] | None = None,
              per_request: int = MAX_N) -> list[SweepRow]:
    """Run every cell of the grid (``spec.concurrency`` requests at a time over the one thread-safe client) and
    return one row per cell. A cell's seeds 0..S-1 are the samples of one request (``n``, up to :data:`MAX_N`
    per request): the server prefills the prompt once for them, and sample i draws with seed i, so each is what
    a request of that seed alone gives. The first failing request's ClientError is raised (the rest are
    cancelled). A greedy cell (temperature 0) is one sample: every seed draws the same tokens there, so its result
    stands for each seed. ``progress(done, total)`` counts samples. ``per_request=1``: a request per seed, greedy
    cells included (what the sweep did before ``n``; bench/prefix_cache.py compares the two)."""
    def seeds_of(cell) -> int:
        # A greedy cell draws the same tokens whatever the seed: one sample, its result standing for each seed.
        return 1 if cell[0] == 0 and per_request > 1 else spec.seeds

    jobs = [(cell, first, min(per_request, seeds_of(cell) - first)) for cell in spec.cells()
            for first in range(0, seeds_of(cell), per_request)]

    def one(job) -> list[Result]:
        (t, k, p), first, n = job
        r = client.generate(spec.prompt, temperature=t, top_k=k, top_p=p, seed=first, n=n,
                            max_new_tokens=spec.max_new_tokens, logprobs=0, trace=1)
        got = list(r.samples) if n > 1 else [r]
        if seeds_of((t, k, p)) == 1:
            got = [dataclasses.replace(got[0], seed=s) for s in range(spec.seeds)]
        return got

    results: dict[tuple, list[Result]] = {cell: [] for cell in spec.cells()}
    with ThreadPoolExecutor(max_workers=spec.concurrency) as pool:
        futures = [(job, pool.submit(one, job)) for job in jobs]
        try:
            done = 0
            for job, fut in futures:
                got = fut.result()
                results[job[0]].extend(got)
                done += len(got)
                if progress:
                    progress(done, spec.requests)
        except BaseException:
            for _, f in futures:
                f.cancel()
            raise
    return [SweepRow(t, k, p, cell_metrics(results[(t, k, p)])) for (t, k, p) in spec.cells()]


# ------------------------------------------------------------------------------------------ files


def _plain(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def write_csv(rows: Sequence[SweepRow], path: str) -> None:
    """One row per cell, columns :data:`COLUMNS`; an undefined metric is an empty field."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if _plain(v) is None else v for k, v in r.as_dict().items()})


def write_json(rows: Sequence[SweepRow], path: str, spec: SweepSpec, transport: str) -> None:
    """{"spec": ..., "transport": ..., "columns": [...], "rows": [{column: value}]}; undefined metrics are null."""
    doc = {"spec": dataclasses.asdict(spec), "transport": transport, "columns": list(COLUMNS),
           "rows": [{k: _plain(v) for k, v in r.as_dict().items()} for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def read_rows(path: str) -> list[dict[str, float]]:
    """Rows of a sweep file (CSV or JSON, by content) as {column: float}; missing values are NaN."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith(("{", "[")):
        doc = json.loads(text)
        raw = doc["rows"] if isinstance(doc, dict) else doc
    else:
        raw = list(csv.DictReader(text.splitlines()))

    def num(v: Any) -> float:
        return math.nan if v is None or v == "" else float(v)

    rows = [{k: num(v) for k, v in r.items() if k in COLUMNS} for r in raw]
    for i, r in enumerate(rows):
        missing = [c for c in GRID_NAMES if c not in r]
        if missing:
            raise ValueError(f"{path}: row {i} has no {', '.join(missing)} column (is it a sweep file?)")
    return rows
