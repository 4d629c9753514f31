"""The sdpa backend's C++ decode kernel against its gather + SDPA path, by the number of concurrent decode rows,
through the engine (no transport), on the default model's w4a16 artifact.

    python bench/decode_rows.py [--streams 1,4,8,16] [--rounds 3] [--artifact bench/out/quality/w4a16]

For each stream count, each variant runs in its own fresh process, alternated round by round: N concurrent greedy
requests of 128 new tokens (EOS ignored) after a warm-up request; aggregate tokens/s; the median over rounds.
Variants set ``SdpaBackend.FUSED_DECODE_MAX_ROWS``: ``kernel`` (every decode step through the C++ kernel, the
engine's rule) and ``gather`` (no step through it: the path without the fused ops).

Also reports the resident memory that imports add to a process (``--imports``): triton, building the model
classes on the meta device, ``AutoTokenizer`` after that, and the bare ``tokenizers`` object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {"kernel": 1 << 30, "gather": 0}


def one_run(artifact: str, streams: int, variant: str) -> float:
    """In this process: the engine over ``artifact`` with the variant's rule; aggregate tok/s of ``streams``."""
    import concurrent.futures as cf
    import time

    from quant.format.sources import default_cache_dir
    from server.attention.sdpa import SdpaBackend
    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams

    SdpaBackend.FUSED_DECODE_MAX_ROWS = VARIANTS[variant]
    eng = Engine.from_path(artifact, EngineConfig(threads=2, memory_budget="512MiB"), default_cache_dir())
    try:
        p = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
        prompts = [eng.tokenize(f"Story number {i}: once upon a time") for i in range(streams)]
        eng.complete(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=8))
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(streams) as ex:
            outs = list(ex.map(lambda pr: eng.complete(pr, p), prompts))
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    finally:
        eng.close()


def import_memory(artifact: str) -> dict:
    """RSS (MiB) that each import adds, in this order, in this process."""
    import gc
    import json as js

    import psutil
    import torch  # noqa: F401 - the baseline includes torch

    proc = psutil.Process()
    rss = lambda: proc.memory_info().rss / 2**20  # noqa: E731
    out = {}
    r = rss()
    import triton  # noqa: F401

    out["triton"] = rss() - r
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import server.engine  # noqa: F401

    cfg = js.loads((Path(artifact) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    r = rss()
    with init_empty_weights(include_buffers=False):
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    out["model classes on meta"] = rss() - r
    r = rss()
    AutoTokenizer.from_pretrained(artifact)
    gc.collect()
    out["AutoTokenizer after that"] = rss() - r
    import tokenizers

    r = rss()
    tokenizers.Tokenizer.from_file(str(Path(artifact) / "tokenizer.json"))
    out["bare tokenizers"] = rss() - r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--artifact", default=str(ROOT / "bench" / "out" / "quality" / "w4a16"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "decode_rows.json"))
    ap.add_argument("--imports", action="store_true", help="only the import-memory table")
    ap.add_argument("--one", nargs=2, metavar=("STREAMS", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.artifact, int(args.one[0]), args.one[1])))
        return 0
    if args.imports:
        res = import_memory(args.artifact)
        for k, v in res.items():
            print(f"{k}: +{v:.0f} MiB")
        return 0
    results: dict = {}
    for n in [int(s) for s in args.streams.split(",")]:
        for rnd in range(args.rounds):
            for variant in VARIANTS:  # alternated, each in a fresh process
                r = subprocess.run([sys.executable, __file__, "--artifact", args.artifact, "--one", str(n), variant],
                                   capture_output=True, text=True, check=True)
                tok_s = json.loads(r.stdout.strip().splitlines()[-1])
                results.setdefault(str(n), {}).setdefault(variant, []).append(tok_s)
                print(f"streams {n} round {rnd} {variant}: {tok_s:.1f} tok/s", flush=True)
    table = {n: {v: statistics.median(xs) for v, xs in r.items()} for n, r in results.items()}
    print("| streams | kernel tok/s | gather tok/s | gather / kernel |\n|---|---|---|---|")
    for n, r in table.items():
        print(f"| {n} | {r['kernel']:.1f} | {r['gather']:.1f} | {r['gather'] / r['kernel']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": results, "medians": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
