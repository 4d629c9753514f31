"""Where a batch-1 decode step goes, through the engine (no transport): the step (its launch, then the read of its
samples and the requests advanced), the model forward, the sampler and the C++ decode attention per layer, each
timed by wrapping the engine's own calls (no profiler: its hooks cost more than these ops), on the default
model's w4a16 artifact.

    python bench/decode_step.py [--artifact bench/out/quality/w4a16] [--rounds 3] [--threads 2]

One process; a warm-up request, then ``--rounds`` greedy requests of 128 new tokens (EOS ignored); per round the
mean time of each wrapped call and the request's tokens/s. Wrapping adds ~0.2 µs a call.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from common import PROMPT

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default=str(ROOT / "bench" / "out" / "quality" / "w4a16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import server.step as st
    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams

    total: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            if a and a[0] is None:  # the engine's read of no step in flight
                return f(*a, **k)
            t = time.perf_counter()
            r = f(*a, **k)
            total[key] += time.perf_counter() - t
            calls[key] += 1
            return r

        setattr(obj, name, timed)

    eng = Engine.from_path(args.artifact, EngineConfig(threads=args.threads, memory_budget="512MiB"),
                           default_cache_dir())
    try:
        wrap(eng.step, "launch", "step: launch (forward, sampling)")
        wrap(eng, "_read", "step: samples read, requests advanced")
        wrap(eng.runner, "forward", "model forward")
        wrap(st, "sample", "sampling")
        wrap(eng.runner.backend.ops, "decode_attention", "decode attention (one layer)")
        ids = eng.tokenize(PROMPT)
        eng.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=8))
        rounds = []
        for _ in range(args.rounds):
            total.clear()
            calls.clear()
            t = time.perf_counter()
            out = eng.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True))
            wall = time.perf_counter() - t
            rounds.append({"tok_s": round(len(out.token_ids) / wall, 1),
                           **{k: {"mean_us": round(1e6 * total[k] / calls[k], 1), "calls": calls[k]} for k in total}})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        eng.close()
    print(f"\n| call | mean µs per call, rounds {', '.join(str(i + 1) for i in range(len(rounds)))} |\n|---|---|")
    for key in rounds[0]:
        if key != "tok_s":
            print(f"| {key} | {', '.join(str(r[key]['mean_us']) for r in rounds)} |")
    print(f"| request tok/s | {', '.join(str(r['tok_s']) for r in rounds)} |")


if __name__ == "__main__":
    main()
