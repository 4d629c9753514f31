"""Where a batch-1 decode step goes, through the engine (no transport): the step (its launch, then the read of its
samples and the requests advanced), the model forward and inside it each layer's calls (projections, attention,
activation, residual norms), the head, the embedding lookup, the rotary tables and the sampler, each timed by
wrapping the engine's own calls (no profiler: its hooks cost more than these ops), on the default model's w4a16
artifact, speculation off (every step one token's forward), eagerly (``cpu_graphs=False``: a replayed step calls
none of the Python it wraps; what replay gains is ``bench/decode.py --only versus``). With ``--replayed``, the step
as served instead: replayed from C++ (server/cpu_graphs.py) with each op it calls timed there
(``CpuGraphs.set_profile``), beside the forward, the sampling and the engine's reads wrapped as above; a request's
replayed steps are its decode steps and its prompt's chunk.

    python bench/decode_step.py [--artifact bench/out/quality/w4a16] [--rounds 3] [--threads 2]
                                [--int4-activations float|int8] [--replayed]

One process; a warm-up request, then ``--rounds`` greedy requests of 128 new tokens (EOS ignored); per round each
wrapped call's time a step (its calls a step in brackets) and the request's tokens/s. Wrapping adds ~0.2 µs a call.
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
    ap.add_argument("--int4-activations", default="float", choices=("float", "int8"))
    ap.add_argument("--replayed", action="store_true", help="the replayed step's ops, timed in C++ (as served)")
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

    eng = Engine.from_path(args.artifact, EngineConfig(threads=args.threads, memory_budget="512MiB",
                                                       speculate="off", int4_activations=args.int4_activations,
                                                       cpu_graphs=args.replayed),
                             default_cache_dir())
    graphs = eng.runner.cpu_graphs
    try:
        if args.replayed and graphs is None:
            raise SystemExit("--replayed: this engine does not replay its steps (its C++ ops are not loaded)")
        wrap(eng.step, "launch", "step: launch (forward, sampling)")
        wrap(eng, "_read", "step: samples read, requests advanced")
        wrap(eng.runner, "forward", "model forward")
        wrap(st, "sample", "sampling")
        model = eng.runner.model
        if not args.replayed:  # (a replayed step calls none of these)
            wrap(eng.runner.backend, "decode_qkv", "attention: rotary, cache write, decode attention")
            for layer in model.layers:
                for name in ("qkv", "o"):
                    wrap(layer, name, f"{name} projection")
                wrap(layer.mlp, "gate_up", "gate_up projection")
                wrap(layer.mlp, "down", "down projection")
                wrap(layer.mlp, "act_mul", "activation")
                for norm in (layer.attn_in, layer.mlp_in):
                    if norm is not None:
                        wrap(norm, "add", "residual add + norm")
            wrap(model, "head", "head")
            wrap(model, "lookup", "embedding lookup")
            for rotary in model.rotaries:
                wrap(rotary, "cos_sin", "rotary tables")
        ids = eng.tokenize(PROMPT)
        eng.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=8))
        if args.replayed:
            from server.cpu_graphs import RUNS_BEFORE_REPLAY

            for _ in range(RUNS_BEFORE_REPLAY - 1):  # until the prompt's chunk replays too
                eng.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=8))
            graphs.set_profile(True)
        rounds = []
        for _ in range(args.rounds):
            total.clear()
            calls.clear()
            replays = graphs.replays if graphs is not None else 0
            if args.replayed:
                graphs.take_profile()
            t = time.perf_counter()
            out = eng.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True))
            wall = time.perf_counter() - t
            steps = calls["model forward"]
            if args.replayed:
                if graphs.replays - replays != steps:
                    raise SystemExit(f"--replayed: {graphs.replays - replays} of {steps} steps were replayed")
                for name, (n, sec) in graphs.take_profile().items():
                    total[f"op {name}"], calls[f"op {name}"] = sec, n
            rounds.append({"tok_s": round(len(out.token_ids) / wall, 1), "step_us": round(1e6 * wall / steps, 1),
                           **{k: {"us_a_step": round(1e6 * total[k] / steps, 1), "calls_a_step": calls[k] / steps}
                              for k in sorted(total, key=lambda k: -total[k])}})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        eng.close()
    numbers = ", ".join(str(i + 1) for i in range(len(rounds)))
    print(f"\n| call (calls a step) | µs a step, rounds {numbers} |\n|---|---|")
    for key, v in rounds[0].items():
        if isinstance(v, dict):
            print(f"| {key} ({v['calls_a_step']:g}) | {', '.join(str(r[key]['us_a_step']) for r in rounds)} |")
    print(f"| request wall time a step | {', '.join(str(r['step_us']) for r in rounds)} |")
    print(f"| request tok/s | {', '.join(str(r['tok_s']) for r in rounds)} |")


if __name__ == "__main__":
    main()
