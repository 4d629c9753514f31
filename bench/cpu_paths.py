"""Every scheme against the bf16 base on the CPUs users have: batch-1 decode and a 512-token prefill.

    python bench/cpu_paths.py [--capabilities native,avx2] [--kernels measure] [--rounds 3]

For each CPU capability (``native``: what this CPU dispatches to; ``avx2``: a CPU without AVX-512 imitated by
``ATEN_CPU_CAPABILITY=avx2`` for ATen's kernels (the int4pack layout included), ``ONEDNN_MAX_CPU_ISA=AVX2`` for
oneDNN's (bf16 and int8 GEMMs: without it they still use AVX-512 bf16/VNNI) and ``MKL_ENABLE_INSTRUCTIONS=AVX2``) and each of the default model's
artifacts (bf16 base served unquantized, int8-sym, int8-affine, w8a8, w4a16), a fresh process loads the engine
(``--kernels``: measured per-CPU plans, cached, or the static rules), runs a warm-up, then:
- decode: batch-1 greedy, 128 new tokens (EOS suppressed), tokens/s of the whole request, best of 2;
- prefill: a 512-token prompt and one new token, ms to the first token (chunked prefill as served), best of 5
  (session 17 and before: best of 2).
Cases alternate scheme by scheme within each round; the median over ``--rounds`` is kept. The plans each
process used (``ModelInfo.kernels``) are recorded beside its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMES = ("bf16 base", "int8-sym", "int8-affine", "w8a8", "w4a16")
NEW = 128
PREFILL = 512
DECODES = 2  # decode requests per process (~0.6 s each), the best kept
PREFILLS = 5  # prefills per process (~0.25 s each), the best kept: with 2, a process's best spread by ~10% run to run


def case(spec: str, threads: int, kernels: str) -> dict:
    import torch

    from bench.decode import PROMPT, greedy
    from quant.models import default_cache_dir
    from server.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    t0 = time.perf_counter()
    eng = Engine.from_path(spec or None, EngineConfig(memory_budget="256MiB", threads=threads, kernels=kernels),
                           cache)
    load_s = time.perf_counter() - t0
    try:
        long_ids = (eng.tokenize(PROMPT * 60))[:PREFILL]
        assert len(long_ids) == PREFILL
        eng.complete(PROMPT, greedy(8))
        eng.complete(long_ids, greedy(1))
        dec, pre = [], []
        for i in range(PREFILLS):
            if i < DECODES:
                t = time.perf_counter()
                c = eng.complete(PROMPT, greedy(NEW))
                dec.append(time.perf_counter() - t)
                assert len(c.token_ids) == NEW
            t = time.perf_counter()
            eng.complete(long_ids, greedy(1))
            pre.append(time.perf_counter() - t)
        return {"decode_tok_s": NEW / min(dec), "prefill_ms": 1000 * min(pre), "load_s": load_s,
                "kernels": list(eng.info.kernels), "capability": torch.backends.cpu.get_cpu_capability()}
    finally:
        eng.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--capabilities", default="native,avx2")
    ap.add_argument("--kernels", default="measure", choices=("measure", "static"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu_paths.json"))
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(case(a.case[1], a.threads, a.case[0])))
        return 0
    from bench.decode import ensure_artifact
    from quant.models import default_cache_dir

    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    schemes = a.schemes.split(",")
    specs = {s: "" if s == "bf16 base" else str(ensure_artifact(Path(a.artifacts), s, cache)) for s in schemes}
    res: dict = {"date": time.strftime("%Y-%m-%d"), "threads": a.threads, "kernels": a.kernels, "results": {}}
    for cap in a.capabilities.split(","):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(var, None)
        if cap != "native":
            env.update(ATEN_CPU_CAPABILITY=cap, ONEDNN_MAX_CPU_ISA=cap.upper(), MKL_ENABLE_INSTRUCTIONS=cap.upper())
        runs: dict[str, list[dict]] = {s: [] for s in schemes}
        for _ in range(a.rounds):
            for s in schemes:
                p = subprocess.run([sys.executable, __file__, "--case", a.kernels, specs[s], "--threads",
                                    str(a.threads)], capture_output=True, text=True, env=env, cwd=ROOT)
                if p.returncode:
                    raise RuntimeError(f"{cap} {s} failed:\n{p.stderr[-3000:]}")
                runs[s].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(cap, s, {k: v for k, v in runs[s][-1].items() if k != "kernels"}, flush=True)
        table = {}
        for s, rs in runs.items():
            table[s] = {"decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rs), 1),
                        "prefill_ms": round(statistics.median(r["prefill_ms"] for r in rs), 1),
                        "load_s": round(statistics.median(r["load_s"] for r in rs), 2),
                        "capability": rs[0]["capability"], "kernels": rs[-1]["kernels"]}
        base = table.get("bf16 base")
        for s, r in table.items():
            if base:
                r["decode_vs_base"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
                r["prefill_speedup_vs_base"] = round(base["prefill_ms"] / r["prefill_ms"], 3)
        res["results"][cap] = table
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    for cap, table in res["results"].items():
        print(f"\n{cap}:")
        for s, r in table.items():
            print(f"  {s:12s} decode {r['decode_tok_s']:7.1f} tok/s ({r.get('decode_vs_base', 1):.2f}x base)  "
                  f"prefill {r['prefill_ms']:8.1f} ms ({r.get('prefill_speedup_vs_base', 1):.2f}x base)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
