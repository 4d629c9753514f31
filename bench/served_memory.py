"""Served memory: what a loaded engine holds against what its artifact stores, and what the process's RSS grows by.

    python bench/served_memory.py [--big] [--out bench/out/served_memory.json]

Each case runs in a fresh process (``--case``): imports and the fused glue ops first, RSS read, then the engine
loads the model (same KV budget for every case), serves one short greedy request, hands freed heap back, and RSS
is read again (``/proc/self/status``: VmRSS, RssAnon, RssFile). Reported per case:

- ``weight_bytes`` (what ``/v1/info`` reports) and the artifact's safetensors bytes, and their ratio;
- the RSS growth over an engine with no model: the same process on a tiny random model of the same architecture
  and tokenizer (hidden 64, 2 layers), minus that model's own weights. It holds what every engine holds
  whatever its size: the tokenizer, the KV pool, the rotary tables, the modules the load imports (the engine
  loads without transformers' modeling and config classes: quant.runtime.loader.load_for_engine). ``growth / file
  bytes`` is held to at most 1.1;
- load time (load + repack + fuse), the startup a user waits for. A config seen for the first time is
  normalised by transformers in a child process (quant.format.model_config, ~3.5 s on the developers' CPU) and cached;
  each case here is loaded once untimed first, so load time is that of a server starting on a known config.

Cases: the default model's bf16 base, its int8-sym and w4a16 artifacts (from ``bench/out/quality`` or built).
``--big`` adds a 1.1B-shaped random Llama (hidden 2048, 22 layers, MLP 5632, 32/4 heads, the default model's
tokenizer), built here and served as bf16 and as a 4-bit artifact. The 4-bit artifact is built with ``rtn-w4``:
the same GPTQ checkpoint format and runtime module as ``w4a16`` (so the same served bytes) without a GPTQ pass
of 1.1B parameters on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ensure_artifact

ROOT = Path(__file__).resolve().parents[1]

BUDGET = "64MiB"
BIG = dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
           num_key_value_heads=4)
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def rss() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) / 1024
    return out


def run_case(spec: str, threads: int, cache: str) -> dict:
    import torch

    from server import fastops
    from server.config import EngineConfig
    from server.engine import Engine
    from server.loading import release_freed_memory
    from server.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    fastops.load()
    release_freed_memory()
    before = rss()
    t0 = time.perf_counter()
    eng = Engine.from_path(spec, EngineConfig(memory_budget=BUDGET, threads=threads), Path(cache))
    load_s = time.perf_counter() - t0
    loaded = rss()
    try:
        eng.complete("The history of the city", SamplingParams(temperature=0.0, max_new_tokens=8))
        release_freed_memory()
        after = rss()
    finally:
        eng.close()
    files = sum(f.stat().st_size for f in Path(spec).glob("*.safetensors"))
    return {"spec": spec, "load_s": round(load_s, 2), "weight_bytes": eng.weight_bytes, "file_bytes": files,
            "kv_pool_bytes": eng.pool.capacity_bytes, "rss_before": before, "rss_loaded": loaded, "rss_after": after}


def warm_config(spec: str, cache: Path) -> None:
    """Normalise the case's config into the cache (what the first serve of a config does, in a child)."""
    from quant.format import model_config

    model_config.read(spec, cache, in_process=False)


def child(spec: str, threads: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--case", spec, "--threads", str(threads)], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"case {spec} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def random_llama(path: Path, tokenizer_dir: Path, shape: dict, dtype) -> Path:
    """A random-weight Llama of `shape` with the default model's tokenizer, saved in `dtype`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def quant_build(model_dir: Path, scheme: str, out: Path) -> Path:
    if not (out / "quant_manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "quant.cli", "build", "--model", str(model_dir), "--scheme", scheme,
                        "--out", str(out), "--no-progress"], cwd=ROOT, check=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "served_memory.json"))
    ap.add_argument("--work", default=str(ROOT / "bench" / "out" / "served_memory"))
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--big", action="store_true", help="also the 1.1B-shaped random Llama, bf16 vs 4-bit")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from quant.format.sources import default_cache_dir, resolve

    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    if args.case:
        print(json.dumps(run_case(args.case, args.threads, str(cache))))
        return 0
    import torch

    work = Path(args.work)
    base = Path(resolve(None, cache).path)
    tiny = random_llama(work / "tiny-bf16", base, TINY, torch.bfloat16)
    cases = {
        "no model (tiny, rtn-w4)": quant_build(tiny, "rtn-w4", work / "tiny-rtn-w4"),
        "bf16 base": base,
        "int8-sym": ensure_artifact(Path(args.artifacts), "int8-sym", cache),
        "w4a16": ensure_artifact(Path(args.artifacts), "w4a16", cache),
    }
    if args.big:
        big = random_llama(work / "llama-1.1b-bf16", base, BIG, torch.bfloat16)
        cases["1.1B bf16"] = big
        cases["1.1B rtn-w4"] = quant_build(big, "rtn-w4", work / "llama-1.1b-rtn-w4")
    res = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "kv_budget": BUDGET, "cases": {}}
    for name, spec in cases.items():
        warm_config(str(spec), cache)
        r = res["cases"][name] = child(str(spec), args.threads)
        print(name, json.dumps(r), flush=True)
    empty = res["cases"]["no model (tiny, rtn-w4)"]
    fixed = empty["rss_after"]["VmRSS"] - empty["rss_before"]["VmRSS"] - empty["weight_bytes"] / 2**20
    res["engine_without_weights_MiB"] = round(fixed, 1)
    rows = []
    for name, r in res["cases"].items():
        grown = r["rss_after"]["VmRSS"] - r["rss_before"]["VmRSS"]
        r["growth_over_empty_MiB"] = round(grown - fixed, 1)
        r["weight_over_file"] = round(r["weight_bytes"] / r["file_bytes"], 3)
        r["growth_over_file"] = round((grown - fixed) * 2**20 / r["file_bytes"], 3)
        rows.append(f"| {name} | {r['file_bytes'] / 2**20:.1f} | {r['weight_bytes'] / 2**20:.1f} | "
                    f"{r['weight_over_file']:.3f} | {r['rss_after']['VmRSS']:.0f} | {grown - fixed:.1f} | "
                    f"{r['growth_over_file']:.3f} | {r['load_s']:.2f} |")
    if args.big:
        b, q = res["cases"]["1.1B bf16"], res["cases"]["1.1B rtn-w4"]
        res["big_rss_ratio"] = round(q["rss_after"]["VmRSS"] / b["rss_after"]["VmRSS"], 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"engine without weights: {fixed:.1f} MiB over the imports (KV pool {BUDGET} included)")
    print("| case | safetensors MiB | weight_bytes MiB | weight / file | RSS MiB | RSS growth over no model MiB | "
          "growth / file | load s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.big:
        print(f"1.1B: RSS of the 4-bit server / the bf16 server = {res['big_rss_ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
