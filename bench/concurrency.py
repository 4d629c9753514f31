"""Memory for concurrency on the default model on this CPU: chat requests under one KV budget, by admission.

    python bench/concurrency.py [--requests 8,32] [--budget 64MiB] [--max-tokens 2048] [--dtype bfloat16]
                                [--kv-dtypes auto,int8] [--artifact DIR] [--json]

The workload a new user tries: N chat requests sent at once, each asking for an essay on its own topic with
max_tokens 2048, greedy, to one engine with a --memory-budget of 64MiB. As chat clients do, each stops long before
its max_tokens: the client cancels it once it has --tokens 256 (the default model's essays run on past 400 tokens,
and where a stop string or EOS ended them the bf16 outputs, and so the work, would differ between admissions: a
batch of N rows rounds differently from one row). A cancelled request's blocks return at the next step. Each N runs with --kv-admission reserve
(every request holds prompt + max_tokens from its admission: what the engine did before blocks were taken on
demand) and with on-demand (blocks as tokens are written, preemption when the pool runs dry), in the same run;
on-demand runs once more for each further --kv-dtypes entry (int8: half the bytes a token, so twice the tokens
in the same budget).
Reported per cell: requests running at once (the mean over the run, polled every 5 ms while any request is
unfinished, and the most), tokens generated, wall time, tokens/s, preemptions and recomputed tokens, and whether
every output equals the reserve run's token for token (in float32; in bf16 batching alone moves greedy outputs;
a quantized cache's outputs are its own, so they are not compared).
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

from common import cpu_name, greedy

TOPICS = ["the history of the printing press", "how bridges carry their load", "why the sky is blue",
          "the life cycle of stars", "the invention of the telephone", "how vaccines train the immune system",
          "the water cycle", "the causes of the French Revolution", "how airplanes fly", "the rise of the internet",
          "photosynthesis", "the Roman aqueducts", "plate tectonics", "the discovery of penicillin",
          "how computers store numbers", "the migration of birds"]


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}"
                                         f"{'' if i < len(TOPICS) else f', part {i // len(TOPICS) + 1}'}."}]
            for i in range(n)]


def run_cell(eng, prompts: list[list[int]], max_tokens: int, tokens: int) -> dict:
    from server import outputs as out
    from server.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, min_tokens=tokens)
    q: queue.SimpleQueue = queue.SimpleQueue()
    before = eng.totals()
    samples: list[int] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            samples.append(len(eng.scheduler.running))
            time.sleep(0.005)

    got = [0] * len(prompts)

    def sink(i, ev):
        got[i] += len(ev.token_ids)
        if got[i] >= tokens and not ev.finished and got[i] - len(ev.token_ids) < tokens:
            eng.cancel(f"c{i}")  # the client has what it wanted
        q.put((i, ev))

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.submit(p, params, lambda ev, i=i: sink(i, ev), request_id=f"c{i}")
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    events: dict[int, list] = {i: [] for i in range(len(prompts))}
    left = len(prompts)
    while left:
        i, ev = q.get()
        events[i].append(ev)
        left -= ev.finished
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    after = eng.totals()
    results = [out.collect(events[i]) for i in range(len(prompts))]
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "running_mean": sum(samples) / max(1, len(samples)), "running_max": max(samples, default=0),
        "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "preemptions": after.preemptions - before.preemptions,
        "recomputed_tokens": after.recomputed_tokens - before.recomputed_tokens,
        "outputs": [list(r.token_ids) for r in results],
        "finish": [r.finish_reason for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="8,32")
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens a client takes before it cancels")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtypes", default="auto,int8", help="KV cache dtypes: the first serves both admissions, "
                    "each further one on-demand")
    ap.add_argument("--artifact", default=None, help="artifact or model dir (default: the embedded model)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine

    rows = []
    engines = {}
    try:
        first, *more = args.kv_dtypes.split(",")
        for admission, kv in [("reserve", first), ("on-demand", first)] + [("on-demand", k) for k in more]:
            engines[admission, kv] = Engine.from_path(args.artifact, EngineConfig(
                memory_budget=args.budget, dtype=args.dtype, kv_admission=admission, kv_dtype=kv), default_cache_dir())
        base_engine = engines["reserve", first]
        for n in (int(x) for x in args.requests.split(",")):
            prompts = [base_engine.chat_prompt(m) for m in chats(n)]
            cells = {}
            for key, eng in engines.items():
                eng.complete(prompts[0], greedy(4))  # kernels, plans, allocator
                cells[key] = run_cell(eng, prompts, args.max_tokens, args.tokens)
            base = cells["reserve", first]
            for (admission, kv), c in cells.items():
                row = {"requests": n, "admission": admission, "kv_dtype": engines[admission, kv].layout.kv_dtype,
                       "kv_capacity_tokens": engines[admission, kv].pool.capacity_tokens,
                       **{k: v for k, v in c.items() if k != "outputs"},
                       "same_outputs": c["outputs"] == base["outputs"] if kv == first else None,
                       "running_x": c["running_mean"] / base["running_mean"], "tok_s_x": c["tok_s"] / base["tok_s"]}
                rows.append(row)
                if not args.json:
                    print(f"{n:3d} requests, {admission:9s} {row['kv_dtype']:8s}: running {row['running_mean']:5.2f} mean / "
                          f"{row['running_max']:2d} max ({row['running_x']:.2f}x), {row['tokens']} tokens in "
                          f"{row['wall_s']:.1f} s = {row['tok_s']:.1f} tok/s ({row['tok_s_x']:.2f}x), "
                          f"{row['preemptions']} preemptions, {row['recomputed_tokens']} recomputed, "
                          f"same outputs: {row['same_outputs']}", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    kv = base_engine.info
    report = {"cpu": cpu_name(), "dtype": args.dtype, "budget": args.budget, "max_tokens": args.max_tokens,
              "tokens": args.tokens,
              "kv_capacity_bytes": kv.kv_capacity_bytes, "kv_bytes_per_token": kv.kv_bytes_per_token, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"CPU: {report['cpu']}; KV pool {kv.kv_capacity_bytes / 2**20:.1f} MiB, "
              f"{kv.kv_bytes_per_token} bytes / token ({args.dtype}); other KV dtypes: their rows' capacity")


if __name__ == "__main__":
    main()
