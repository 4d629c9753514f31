"""Time to first token with and without the prefix cache, on the default model on this CPU (#41).

    python bench/prefix_cache.py [--requests 16] [--prefix 1024] [--suffix 32] [--dtype bfloat16] [--artifact DIR]

16 requests share a 1024-token prefix (WikiText-2 test text where it is beside the checkout, else seeded ids), each
with its own 32-token suffix, sent one after another to one engine with the cache on and to one with it off, in
the same run. Each request generates one token, so its time is its TTFT: the prefill of what the cache did not
hold. Reported: mean and median TTFT each way, their ratio, the tokens taken from the cache, and whether the
first generated tokens agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--artifact", default=None, help="artifact or model dir (default: the embedded model, float)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prefix_cache.json"))
    args = ap.parse_args(argv)

    import torch

    from quant.models import default_cache_dir
    from server.engine import Engine, EngineConfig
    from server.sampling import SamplingParams

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
    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype,
           "requests": args.requests, "prefix": args.prefix, "suffix": args.suffix, "with_cache": on,
           "without_cache": off, "mean_ratio": on["mean_ttft_ms"] / off["mean_ttft_ms"],
           "same_first_tokens": first_tokens[True] == first_tokens[False]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{out['cpu']}, {out['threads']} threads, torch {out['torch']}, {args.dtype}: {args.requests} requests, "
          f"{args.prefix}-token shared prefix + {args.suffix}-token suffix, one after another")
    for name, r in (("without the cache", off), ("with the cache", on)):
        print(f"  {name:18s} mean TTFT {r['mean_ttft_ms']:8.1f} ms, median {r['median_ttft_ms']:8.1f} ms, first "
              f"{r['first_ttft_ms']:8.1f} ms, cached tokens {sum(r['cached_tokens'])}")
    print(f"  ratio (with / without): {out['mean_ratio']:.3f}; same first tokens: {out['same_first_tokens']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
