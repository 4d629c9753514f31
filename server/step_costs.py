"""What a step costs on this device by its rows (server/speculate.py's ``DraftCosts``), measured when an engine that
speculates starts, and kept per device like the kernel plans.

:func:`measure` times a runner's forwards over 1, 2, 4 ... :data:`PROBE_ROWS` rows of scratch blocks (a
verification's forward), steps of up to :data:`PROBE_DECODE_ROWS` decode rows (a plain step's), and one row's
draw, with a draft model's forwards besides; for the default model that is ~45 forwards, 4-8 s of a server's start
on a 2-core CPU. :class:`CostCache` keeps the result in a JSON file per device under the cache dir (``step-costs/``),
keyed by everything the step's speed depends on: the device (``quant.runtime.timing.device_key``: CPU model, vector
capability, threads, torch version), the engine's sources (``server/`` and ``quant/runtime/``, C++ included: a
changed kernel or step measures again), and what the engine describes of itself (the model's config, dtype and
scheme, the kernels chosen per Linear, the attention backend, the KV layout, the rows its pool lets the probe
measure, replay, the draft model's). An engine whose key is kept takes the costs from the file; a file that cannot be read is measured again,
never trusted half-way, and one that cannot be written is said in one log line. The file keeps the
:data:`MAX_ENTRIES` most recently measured keys. Delete ``step-costs/`` to measure again (the costs are timings:
taken while the machine was busy, they stay as busy as it was).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path

from quant.runtime.timing import DeviceRecord, device_key
from server.cpu_graphs import RUNS_BEFORE_REPLAY
from server.runner import build_step
from server.sampling import SamplingBatch, sample
from server.sampling_params import SamplingParams
from server.speculate import DraftCosts

log = logging.getLogger("quantserve.engine")

PROBE_ID = "\0draft-costs"  # the pool id of the blocks measure writes to
PROBE_ROWS = 64  # the most rows it measures a forward over (a step's time beyond: extrapolated)
PROBE_DECODE_ROWS = 16  # ... and a step of decode rows alone (beyond: DraftCosts.plain)
PROBE_CONTEXTS = (512, 256, 128)  # the context of the rows that measure a row's attention (the first that fits)
PROBE_ATTEND_ROWS = 8  # ... and how many
VERSION = 2  # of the file's layout
MAX_ENTRIES = 64
_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu")


def _fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe_rows(pool) -> int:
    """The most rows :func:`probe_forwards` measures in ``pool``: a power of two, at most PROBE_ROWS, whose blocks
    are free (1: none)."""
    n = PROBE_ROWS
    while n > 1 and pool.layout.blocks_for(n) > pool.free_blocks:
        n //= 2
    return n


def _reserve_rows(pool, rows: int, context: int) -> bool:
    """Blocks of ``context`` positions for each of ``rows`` probe rows (their own: KV read from memory, as distinct
    requests' is), all or none."""
    for i in range(rows):
        if pool.try_reserve(f"{PROBE_ID}{i}", context) is None:
            for j in range(i):
                pool.release(f"{PROBE_ID}{j}")
            return False
    return True


def probe_forwards(runner, pool, device, repeats: int, attend: bool = False):
    """((rows, seconds, decode seconds, attend), the last forward's last logits row or None): a runner's forwards
    over 1, 2, 4 ... PROBE_ROWS rows of scratch blocks of its pool (as many as it has room for; none: ((1, 2), (1.0,
    2.0), None, 0.0), a row as dear as a step), as one chunk (a verification's or a prefill's forward) and, up to
    PROBE_DECODE_ROWS, as that many decode rows (a plain step's), the fastest of ``repeats`` each (where the runner
    replays recorded programs, at least one replay: server.cpu_graphs.RUNS_BEFORE_REPLAY). Those rows sit at the
    first positions; with ``attend``, a step of PROBE_ATTEND_ROWS decode rows, each over a context of its own of
    the first of PROBE_CONTEXTS tokens that the pool has room for, against the same rows at the first positions
    gives ``attend``, the seconds a row's attention costs per token of context (0.0 where none fits)."""
    n = probe_rows(pool)
    table = pool.try_reserve(PROBE_ID, n) if n > 1 else None
    if table is None:
        return ((1, 2), (1.0, 2.0), None, 0.0), None
    times, plain, logits = {}, {}, []
    bs = pool.layout.block_size
    runs = repeats if runner.cpu_graphs is None else max(repeats, RUNS_BEFORE_REPLAY + 1)
    try:
        for rows in (2**i for i in range(n.bit_length())):
            step = build_step([], [([0] * rows, 0, table, rows)], bs, device)
            times[rows] = _fastest(lambda: logits.append(runner.forward(step)[-1:]) or float(logits[-1][0, 0]), runs)
            if rows <= PROBE_DECODE_ROWS:
                step = build_step([(0, i, table) for i in range(rows)], [], bs, device)
                plain[rows] = _fastest(lambda: float(runner.forward(step)[-1, 0]), runs)
        per_token, r = 0.0, min(PROBE_ATTEND_ROWS, PROBE_DECODE_ROWS, n)
        context = next((c for c in PROBE_CONTEXTS if _reserve_rows(pool, r, c)), None) if attend else None
        if context is not None:  # r rows at the last of their own context's positions: a decode step's program
            steps = [build_step([(0, i, table) for i in range(r)], [], bs, device),
                     build_step([(0, context - 1, pool.blocks_of(f"{PROBE_ID}{i}")) for i in range(r)], [], bs, device)]
            best = [float("inf")] * 2
            for _ in range(2 * runs):  # in turn, so that the machine's drift falls on both alike
                for j, step in enumerate(steps):
                    best[j] = min(best[j], _fastest(lambda: float(runner.forward(step)[-1, 0]), 1))
            per_token = max(0.0, best[1] - best[0]) / (r * (context - (r + 1) / 2))
    finally:
        for i in [""] + list(range(PROBE_ATTEND_ROWS)):
            pool.release(f"{PROBE_ID}{i}")
    return (tuple(times), tuple(times.values()), tuple(plain.values()), per_token), logits[-1]  # (1, V)


def measure(runner, pool, device, drafter=None, repeats: int = 3) -> tuple[DraftCosts, DraftCosts | None]:
    """The step's costs on this device (:func:`probe_forwards`) and one row's draw at temperature 0.7 without and
    with top-p over the model's logits of the last of those rows; the fastest of ``repeats`` each. Where the pool
    has no room for even two rows, every row costs as much as a step (drafting then seldom pays). With a draft model
    (server/draft.py), its forwards' too (second; else None)."""
    times, logits = probe_forwards(runner, pool, device, repeats, attend=True)
    proposer = None
    if drafter is not None:
        p_rows, p_seconds, p_decode, _ = probe_forwards(drafter.runner, drafter.pool, device, repeats)[0]
        proposer = DraftCosts(p_rows, p_seconds, decode=p_decode)  # it proposes by decode steps: its plain()
    rows, seconds, decode, per_token = times
    if logits is None:
        return DraftCosts(rows, seconds, decode=decode, attend=per_token), proposer
    draws = []
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9)):
        batch = SamplingBatch.build([params], [0], [0], None, device=device)
        draws.append(_fastest(lambda: int(sample(logits, batch, runner.ops).tokens[0]), repeats))
    return DraftCosts(rows, seconds, *draws, decode=decode, attend=per_token), proposer


@functools.cache
def source_digest() -> str:
    """A digest of the sources a step's speed depends on: the server's and quant.runtime's Python and C++ (read once
    a process: what it runs does not change under it)."""
    import quant.runtime
    import server

    h = hashlib.sha256()
    for root in (Path(server.__file__).parent, Path(quant.runtime.__file__).parent):
        for p in sorted(root.rglob("*")):
            if p.suffix in _SOURCE_SUFFIXES and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def describe(runner, pool, dtype) -> dict:
    """What a runner's step speed depends on, for an engine's key: its model's config (no paths), dtype, attention
    backend, glue, kernel notes, KV layout and the rows its pool lets :func:`probe_forwards` measure."""
    cfg = runner.model.config
    c = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return {"config": {k: v for k, v in c.items() if not k.startswith("_") and k not in (
            "name_or_path", "transformers_version")}, "dtype": str(dtype), "attention": runner.attention,
            "glue": runner.glue_ops, "notes": runner.kernel_notes(), "rows": probe_rows(pool),
            "layout": [pool.layout.kv_format, pool.layout.block_size, pool.layout.bytes_per_token]}


def _costs_json(c: DraftCosts | None):
    return None if c is None else {"rows": list(c.rows), "seconds": list(c.seconds), "draw": c.draw,
                                   "filtered": c.filtered, "decode": None if c.decode is None else list(c.decode),
                                   "attend": c.attend}


def _costs(d) -> DraftCosts | None:
    if d is None:
        return None
    rows, seconds = tuple(int(r) for r in d["rows"]), tuple(float(s) for s in d["seconds"])
    decode = None if d["decode"] is None else tuple(float(s) for s in d["decode"])
    if not rows or len(rows) != len(seconds) or rows[0] != 1 or list(rows) != sorted(set(rows)) or (
            decode is not None and not 0 < len(decode) <= len(rows)) or min(seconds + (decode or ())) <= 0 or (
            float(d["attend"]) < 0):
        raise ValueError("step costs out of shape")
    return DraftCosts(rows, seconds, float(d["draw"]), float(d["filtered"]), decode, float(d["attend"]))


class CostCache:
    """The step costs measured on one device (a JSON file under ``cache_dir``), by the key of what an engine
    describes of itself (``engine``: any JSON-able value; the sources' digest is added)."""

    def __init__(self, cache_dir: Path | str, device, threads: int | None, engine):
        self.record = DeviceRecord(cache_dir, "step-costs", device_key(device, threads), VERSION, "entries",
                                   "step costs", log)
        self.file = self.record.file
        self.key = hashlib.sha256(json.dumps([source_digest(), engine], sort_keys=True, default=str)
                                  .encode()).hexdigest()[:32]

    def get(self) -> tuple[DraftCosts, DraftCosts | None] | None:
        """The costs kept for this key, or None (none kept, or unreadable: said in one log line)."""
        e = self.record.read().get(self.key)
        if e is None:
            return None
        try:
            return _costs(e["target"]), _costs(e["proposer"])
        except (KeyError, TypeError, ValueError) as err:
            log.warning("step costs in %s unreadable (%s); measuring again", self.file, err)
            return None

    def put(self, costs: DraftCosts, proposer: DraftCosts | None) -> None:
        entries = self.record.read()
        entries.pop(self.key, None)
        entries[self.key] = {"target": _costs_json(costs), "proposer": _costs_json(proposer), "at": time.time()}
        self.record.write(dict(list(entries.items())[-MAX_ENTRIES:]))  # in the order measured: the oldest go first


def costs(runner, pool, device, drafter=None, cache: CostCache | None = None) -> tuple[DraftCosts, DraftCosts | None]:
    """The step's costs: kept in ``cache`` for this engine, else measured (:func:`measure`) and kept there."""
    got = cache.get() if cache is not None else None
    if got is not None:
        return got
    got = measure(runner, pool, device, drafter)
    if cache is not None:
        cache.put(*got)
    return got
