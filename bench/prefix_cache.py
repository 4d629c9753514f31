"""Shared KV on the default model on this CPU: the prefix cache's TTFT, n samples' capacity, the sweep.

    python bench/prefix_cache.py [--only ttft,capacity,sweep] [--dtype bfloat16] [--artifact DIR]

- ttft: 16 requests share a 1024-token prefix (WikiText-2 test text where it is beside the checkout, else seeded
  ids), each with its own 32-token suffix, sent one after another to one engine with the cache on and to one with
  it off, in the same run. Each request generates one token, so its time is its TTFT: the prefill of what the cache
  did not hold. Reported: mean and median TTFT each way, their ratio, the tokens taken from the cache, and whether
  the first generated tokens agree.
- capacity: one KV budget (540 blocks); 4 requests of n = 8 samples x 128 new tokens after a 1024-token prompt, then
  the same 32 samples as requests of their own (the cache off, so nothing is shared). Reported: the most samples
  running at once each way (polled from the engine's totals), and the KV blocks per sample.
- sweep: `quant-client sweep` over 18 cells x 4 seeds against one `quant serve` of the default model, a cell's seeds
  as one request of n = 4 and as a request per seed, in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]

def prompts(tok, n: int, prefix: int, suffix: int) -> list[list[int]]:
    import torch

    text = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
    g = torch.Generator().manual_seed(0)
    if text.is_file():
        ids = tok(text.read_text()[:200_000]).input_ids
        stem = ids[:prefix]
        tails = [ids[prefix + 1000 * (i + 1): prefix + 1000 * (i + 1) + suffix] for i in range(n)]
    else:
        stem = torch.randint(3, tok.vocab_size, (prefix,), generator=g).tolist()
        tails = [torch.randint(3, tok.vocab_size, (suffix,), generator=g).tolist() for _ in range(n)]
    return [stem + t for t in tails]


def ttft(args) -> dict:
    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams

    rows = {}
    first_tokens = {}
    for cache in (False, True):
        eng = Engine.from_path(args.artifact, EngineConfig(memory_budget="512MiB", dtype=args.dtype,
                                                           max_prefill_tokens=256, prefix_cache=cache),
                               default_cache_dir())
        try:
            ps = prompts(eng.tokenizer, args.requests, args.prefix, args.suffix)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
            eng.complete(list(range(5, 40)), greedy)  # warm: kernels, plans, allocator
            ttft, cached, toks = [], [], []
            for p in ps:
                t = time.perf_counter()
                r = eng.complete(p, greedy)
                ttft.append(time.perf_counter() - t)
                cached.append(r.accounting.prompt_tokens_cached)
                toks.append(r.token_ids[0])
            rows[cache] = {"mean_ttft_ms": 1e3 * statistics.mean(ttft), "median_ttft_ms": 1e3 * statistics.median(ttft),
                           "first_ttft_ms": 1e3 * ttft[0], "cached_tokens": cached,
                           "prompt_tokens": [len(p) for p in ps]}
            first_tokens[cache] = toks
        finally:
            eng.close()
    on, off = rows[True], rows[False]
    out = {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix, "with_cache": on,
           "without_cache": off, "mean_ratio": on["mean_ttft_ms"] / off["mean_ttft_ms"],
           "same_first_tokens": first_tokens[True] == first_tokens[False]}
    print(f"ttft: {args.requests} requests, {args.prefix}-token shared prefix + {args.suffix}-token suffix, one after "
          "another")
    for name, r in (("without the cache", off), ("with the cache", on)):
        print(f"  {name:18s} mean TTFT {r['mean_ttft_ms']:8.1f} ms, median {r['median_ttft_ms']:8.1f} ms, first "
              f"{r['first_ttft_ms']:8.1f} ms, cached tokens {sum(r['cached_tokens'])}")
    print(f"  ratio (with / without): {out['mean_ratio']:.3f}; same first tokens: {out['same_first_tokens']}")
    return out


def capacity(args) -> dict:
    """The most samples running at once under one KV budget: n = 8 samples per request against a request per
    sample (block arithmetic: 72 blocks per lone sample; 72 + 7 x 9 = 135 per request of 8, 16.9 per sample)."""
    import threading

    import torch

    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine
    from server.kv_pool import KVLayout
    from server.sampling_params import SamplingParams

    groups, n, prompt_len, new, blocks = 4, 8, 1024, 128, 540
    probe = Engine.from_path(args.artifact, EngineConfig(memory_budget="64MiB", dtype=args.dtype),
                             default_cache_dir())
    layout: KVLayout = probe.layout
    probe.close()
    out = {}
    for mode in ("n", "separate"):
        eng = Engine.from_path(args.artifact, EngineConfig(memory_budget=str(blocks * layout.bytes_per_block),
                                                           dtype=args.dtype, max_prefill_tokens=256,
                                                           prefix_cache=mode == "n"), default_cache_dir())
        peak, stop = [0], threading.Event()

        def poll(eng=eng, peak=peak, stop=stop):
            while not stop.is_set():
                peak[0] = max(peak[0], eng.totals().running)
                time.sleep(0.002)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, eng.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(groups)]
            params = SamplingParams(temperature=0.8, seed=0, max_new_tokens=new, min_tokens=new, ignore_eos=True)
            done = threading.Semaphore(0)
            t = time.perf_counter()
            for p in prompts:
                if mode == "n":
                    eng.submit(p, params, lambda ev: ev.finished and done.release(), n=n)
                else:
                    for i in range(n):
                        eng.submit(p, params.with_seed(i), lambda ev: ev.finished and done.release())
            for _ in range(groups * n):
                done.acquire()
            out[mode] = {"peak_running_samples": peak[0], "seconds": time.perf_counter() - t,
                         "kv_blocks": eng.pool.num_blocks}
        finally:
            stop.set()
            poller.join()
            eng.close()
    per_sample = {"n": (72 + 7 * 9) / 8, "separate": 72.0}
    out["ratio"] = out["n"]["peak_running_samples"] / out["separate"]["peak_running_samples"]
    out["blocks_per_sample"] = per_sample
    print(f"capacity: {groups} prompts of {prompt_len} tokens x {n} samples x {new} new tokens, a pool of "
          f"{out['n']['kv_blocks']} blocks")
    for mode in ("separate", "n"):
        r = out[mode]
        print(f"  {'a request per sample' if mode == 'separate' else 'n = 8 per request':22s} most samples running "
              f"{r['peak_running_samples']:3d} ({per_sample[mode]:.1f} blocks each), all done in {r['seconds']:.1f} s")
    print(f"  ratio: {out['ratio']:.2f}x")
    return out


def sweep(args) -> dict:
    """quant-client sweep over 18 cells x 4 seeds against one server: a cell's seeds as one request of n = 4 against
    a request per seed (the sweep before n), each at 4 and at 16 requests in flight, in turn, median of 3 each.
    With --dtype float32 the rows of every mode are the same numbers; in bf16 a step's batch composition changes
    where products round, so a sample's tokens can differ from its seed's request alone."""
    import dataclasses

    from quantserve.client import Client
    from quantserve.client.sweep import MAX_N, SweepSpec, run_sweep

    from server.loadgen.drive import ServerProcess

    spec = SweepSpec(prompt="The history of the river valley", temperatures=(0.0, 0.7, 1.0),
                     top_ks=(0, 50), top_ps=(0.9, 0.95, 1.0), seeds=4, max_new_tokens=32, concurrency=4)
    assert len(spec.cells()) == 18
    modes = {"per seed, 4 in flight": (1, 4), "n = 4, 4 in flight": (MAX_N, 4),
             "per seed, 16 in flight": (1, 16), "n = 4, 16 in flight": (MAX_N, 16)}
    srv = ServerProcess(args.artifact, "--dtype", args.dtype, "--memory-budget", "256MiB")
    times: dict[str, list[float]] = {name: [] for name in modes}
    rows = {}
    try:
        with Client(srv.grpc_target) as c:
            run_sweep(c, SweepSpec(spec.prompt, (0.7,), (0,), (1.0,), 2, 8, 2))  # warm
            for _ in range(3):
                for name, (per, conc) in modes.items():
                    t = time.perf_counter()
                    rows[name] = run_sweep(c, dataclasses.replace(spec, concurrency=conc), per_request=per)
                    times[name].append(time.perf_counter() - t)
        srv.sigterm()
        srv.wait(60)
    finally:
        srv.kill()
    base = "per seed, 4 in flight"  # the sweep before n, at its default concurrency
    out = {name: {"seconds": statistics.median(v), "runs": v} for name, v in times.items()}
    for name in modes:
        out[name]["ratio_to_before"] = out[name]["seconds"] / out[base]["seconds"]
        out[name]["same_rows_as_before"] = [r.as_dict() for r in rows[name]] == [r.as_dict() for r in rows[base]]
    print(f"sweep: 18 cells x 4 seeds, 32 new tokens, {args.dtype} (median of 3, seconds; ratio to a request per "
          "seed at 4 in flight)")
    for name in modes:
        r = out[name]
        print(f"  {name:24s} {r['seconds']:6.1f} s  {r['ratio_to_before']:.2f}  same rows: {r['same_rows_as_before']}")
    return out


PARTS = {"ttft": ttft, "capacity": capacity, "sweep": sweep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--artifact", default=None, help="artifact or model dir (default: the embedded model, float)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prefix_cache.json"))
    args = ap.parse_args(argv)
    import torch

    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype}
    print(f"{out['cpu']}, {out['threads']} threads, torch {out['torch']}, {args.dtype}")
    for part in args.only.split(","):
        out[part] = PARTS[part.strip()](args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
