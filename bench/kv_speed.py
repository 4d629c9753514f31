"""Batch-1 decode speed by KV cache dtype on this CPU: the default model decoding after a long and a short context.

    python bench/kv_speed.py [--contexts 4096,128] [--kv-dtypes auto,int8] [--new 64] [--rounds 5]
                             [--artifact DIR] [--dtype bfloat16] [--json]

For each context length, one engine per KV dtype holds the same WikiText-2 prompt of that many tokens (prefilled
once; later requests map it from the prefix cache and prefill only its last block) and decodes --new greedy tokens
from it, the engines taking turns for --rounds rounds. A decode step's time is the time between streamed tokens
(the first token, which carries the prefill, excluded); reported per cell: the median over rounds of the mean step
time, tokens/s, and each dtype's ratio to the first one's; and the time of each engine's first request, the whole
prompt prefilled with nothing cached (one run). At a 4k context a step of the default model reads
~94 MB of bf16 K/V (23,040 bytes a token) beside ~270 MB of weights; int8 reads 0.516x of that K/V.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
from pathlib import Path

from common import cpu_name, greedy

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def decode_step_s(eng, prompt: list[int], new: int) -> float:
    """Mean seconds between streamed tokens of one greedy request (the first token excluded)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(prompt, greedy(new), lambda ev: q.put((time.perf_counter(), ev)))
    stamps: list[float] = []
    while True:
        t, ev = q.get(timeout=600)
        stamps.extend([t] * len(ev.token_ids))
        if ev.finished:
            break
    assert len(stamps) == new, len(stamps)
    return (stamps[-1] - stamps[0]) / (new - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,128")
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--artifact", default=None, help="artifact or model dir (default: the embedded model)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine

    kvs = args.kv_dtypes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    # speculation off: a step here is one token's forward (with n-gram drafts on, as each engine's start-up timing
    # decides, a greedy WikiText continuation drafts, and one engine's "step" carried several tokens)
    engines = {kv: Engine.from_path(args.artifact, EngineConfig(memory_budget="384MiB", dtype=args.dtype, kv_dtype=kv,
                                                                max_batch=4, speculate="off"), default_cache_dir())
               for kv in kvs}
    rows = []
    try:
        text = DATA.read_text()
        ids = engines[kvs[0]].tokenizer(text[: 20 * max(contexts)])["input_ids"]
        for ctx in contexts:
            prompt = ids[:ctx]
            assert len(prompt) == ctx, (len(prompt), ctx)
            prefill = {}
            for kv, eng in engines.items():  # the prompt's blocks into the prefix cache; kernels warmed
                t0 = time.perf_counter()
                eng.complete(prompt, greedy(1))
                prefill[kv] = time.perf_counter() - t0
            steps: dict[str, list[float]] = {kv: [] for kv in kvs}
            for _ in range(args.rounds):
                for kv, eng in engines.items():
                    steps[kv].append(decode_step_s(eng, prompt, args.new))
            base = statistics.median(steps[kvs[0]])
            for kv in kvs:
                s = statistics.median(steps[kv])
                row = {"context": ctx, "kv_dtype": engines[kv].layout.kv_dtype, "step_ms": 1000 * s,
                       "tok_s": 1 / s, "speed_x": base / s, "kv_bytes_per_token": engines[kv].layout.bytes_per_token,
                       "prefill_s": prefill[kv],
                       "rounds_ms": [round(1000 * x, 3) for x in steps[kv]]}
                rows.append(row)
                if not args.json:
                    print(f"context {ctx:5d}, KV {row['kv_dtype']:8s} ({row['kv_bytes_per_token']:5d} B/token): "
                          f"{row['step_ms']:6.2f} ms/step = {row['tok_s']:6.1f} tok/s ({row['speed_x']:.3f}x); "
                          f"prefill {row['prefill_s']:.2f} s",
                          flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    report = {"cpu": cpu_name(), "dtype": args.dtype, "new": args.new, "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"CPU: {report['cpu']}; {args.dtype} default model, batch 1, {args.new} new tokens, median of "
              f"{args.rounds} rounds")


if __name__ == "__main__":
    main()
