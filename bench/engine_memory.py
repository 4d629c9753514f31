"""The engine's memory accounting against measurement on CPU.

    python bench/engine_memory.py [--out bench/out/engine_memory.json]

- KV: the pool's bytes vs 2 * layers * kv_heads * head_dim * bytes(dtype) * tokens, and the resident memory the
  pool's allocation added to the process (RSS before/after creating the engine's pool).
- Activations: for prefill chunks of several lengths (with and without cached past), the engine's estimate
  (``Engine.activation_estimate``: quant.shape.memory.engine_prefill_bytes, the runner's own model) vs the peak of
  live tensor bytes created during the runner's forward, tracked op by op (``quant.runtime.measure.MemoryTracker``),
  for the bf16 base and the int8-sym and w4a16 artifacts, with the fused and with the eager glue ops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]


def activation_rows(eng) -> list[dict]:
    from quant.runtime.measure import MemoryTracker
    from server.runner import build_step

    rows = []
    g = torch.Generator().manual_seed(0)
    for chunk, past in ((1, 0), (16, 0), (64, 0), (256, 0), (512, 0), (256, 256), (512, 512)):
        table = eng.pool.try_reserve("m", past + chunk)
        ids = torch.randint(0, 49152, (past + chunk,), generator=g).tolist()
        if past:
            eng.runner.forward(build_step([], [(ids[:past], 0, table, False)], eng.layout.block_size, eng.device))
        step = build_step([], [(ids[past:], past, table, True)], eng.layout.block_size, eng.device)
        with MemoryTracker().exclude(eng.pool.storage) as mt:  # the pool existed before: not an activation
            eng.runner.forward(step)
        est = eng.activation_estimate(chunk, past)
        rows.append({"chunk": chunk, "past": past, "estimate": est, "measured": mt.peak, "ratio": est / mt.peak})
        eng.pool.release("m")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "engine_memory.json"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    args = ap.parse_args(argv)
    from quant.format.sources import default_cache_dir, load_model, resolve
    from quant.shape.memory import kv_bytes_per_token
    from server.config import EngineConfig
    from server.engine import Engine
    from server.loading import load_for_serving

    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(resolve(None, cache), dtype=dtype)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    budget = 512 * 2**20
    eng = Engine(model, tok, EngineConfig(memory_budget=str(budget), dtype=args.dtype))
    rss1 = proc.memory_info().rss
    bpt = kv_bytes_per_token(model.config, dtype)
    res = {
        "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
        "kv": {"bytes_per_token_formula": bpt, "bytes_per_token_engine": eng.layout.bytes_per_token,
               "pool_capacity_bytes": eng.pool.capacity_bytes,
               "pool_tokens_x_formula": eng.pool.capacity_tokens * bpt,
               "pool_storage_bytes": eng.pool.storage.untyped_storage().nbytes(),
               "rss_added_by_pool": rss1 - rss0},
        "activations": [],
    }
    print(res["kv"], flush=True)
    del eng
    specs = {"bf16 base": None, **{s: str(Path(args.artifacts) / s) for s in ("int8-sym", "w4a16")}}
    for name, spec in specs.items():
        if spec is not None and not (Path(spec) / "quant_manifest.json").is_file():
            print(f"skipping {name}: no artifact at {spec} (bench/quality.py builds it)")
            continue
        m, t, _, _ = load_for_serving(spec, dtype, "cpu", cache) if spec else (model, tok, None, None)
        for fused in (True, False):
            eng = Engine(m, t, EngineConfig(memory_budget="256MiB", dtype=args.dtype, fused_ops=fused))
            for row in activation_rows(eng):
                row.update(model=name, glue=eng.runner.glue_ops)
                res["activations"].append(row)
                print(row, flush=True)
            del eng
    worst = max(abs(math.log(r["ratio"])) for r in res["activations"])
    res["worst_ratio"] = math.exp(worst)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
