"""Every scheme against the bf16 base on the CPUs users have: batch-1 decode and a 512-token prefill.

    python bench/cpu_paths.py [--capabilities native,avx2] [--kernels measure] [--rounds 3]

For each CPU capability (``native``: what this CPU dispatches to; ``avx2``: a CPU without AVX-512 imitated by
``ATEN_CPU_CAPABILITY=avx2`` for ATen's kernels (the int4pack layout included), ``ONEDNN_MAX_CPU_ISA=AVX2`` for
oneDNN's (bf16 and int8 GEMMs: without it they still use AVX-512 bf16/VNNI) and ``MKL_ENABLE_INSTRUCTIONS=AVX2``) and each of the default model's
artifacts (bf16 base served unquantized, int8-sym, int8-affine, w8a8, w4a16), a fresh process loads the engine
(``--kernels``: measured per-CPU plans, cached, or the static rules), runs a warm-up, then:
- decode: batch-1 greedy, 128 new tokens (EOS suppressed), tokens/s of the whole request, best of 2;
- prefill: a 512-token prompt and one new token, ms to the first token (chunked prefill as served), best of 5.
Cases alternate scheme by scheme within each round; the median over ``--rounds`` is kept. The plans each
process used (``ModelInfo.kernels``) are recorded beside its figures.

The prefill ratio against the base is also measured paired: per scheme and round, two worker
processes, one serving the base and one the scheme, time their prefills in turn (A B B A, :data:`PAIRS` pairs), the
ratio of each pair being kept. On a shared 2-vCPU VM the machine's speed moved by ~12% between processes, for
tens of seconds at a time (the base's best-of-5 prefill ranged 355-407 ms over 9 processes, 2026-11-25), which
decided ratios of schemes whose prefill does the base's multiply-adds; two prefills 0.4 s apart see the same
machine. Reported: the median of each process's median pair ratio, and the medians of both sides' times.
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

from common import NEW, PREFILL, PREFILLS, PROMPT, ensure_artifact, greedy

ROOT = Path(__file__).resolve().parents[1]

SCHEMES = ("bf16 base", "int8-sym", "int8-affine", "w8a8", "w4a16")
DECODES = 2  # decode requests per process (~0.6 s each), the best kept
PAIRS = 12  # paired prefills (base, scheme) per process, in A B B A order


def _engine(spec: str, threads: int, kernels: str):
    """(an engine as `quant serve` runs it, its load seconds, a 512-token prompt), warmed up."""
    import torch

    from quant.format.sources import default_cache_dir
    from server.config import EngineConfig
    from server.engine import Engine

    torch.set_num_threads(threads)
    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    t0 = time.perf_counter()
    eng = Engine.from_path(spec or None, EngineConfig(memory_budget="256MiB", threads=threads, kernels=kernels),
                           cache)
    load_s = time.perf_counter() - t0
    long_ids = (eng.tokenize(PROMPT * 60))[:PREFILL]
    assert len(long_ids) == PREFILL
    eng.complete(PROMPT, greedy(8))
    eng.complete(long_ids, greedy(1))
    return eng, load_s, long_ids


def case(spec: str, threads: int, kernels: str) -> dict:
    import torch

    eng, load_s, long_ids = _engine(spec, threads, kernels)
    try:
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


def prefill_worker(spec: str, threads: int, kernels: str) -> None:
    """One engine in this process, timing a 512-token prefill per line read from stdin (ms, one line each): the
    paired measurement's two sides (module docstring) each have a process of their own, as served. Two engines in
    one process are not that: the second engine thread's OpenMP pool ran this model's W8A8 prefill 1.6x slower."""
    eng, _, long_ids = _engine(spec, threads, kernels)
    try:
        print("ready", flush=True)
        for _ in sys.stdin:
            t = time.perf_counter()
            eng.complete(long_ids, greedy(1))
            print(1000 * (time.perf_counter() - t), flush=True)
    finally:
        eng.close()


def paired(spec: str, threads: int, kernels: str, env: dict) -> dict:
    """The base's and the scheme's 512-token prefill, ms, timed in turn (A B B A, :data:`PAIRS` pairs) in two
    worker processes started side by side; the median of each and of the pairs' ratios (base / scheme)."""
    def start(s: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--prefill-worker", kernels, s, "--threads",
                                 str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                cwd=ROOT)

    workers = [start(""), start(spec)]  # base, scheme
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"prefill worker for {spec or 'the base'} failed (exit {w.wait()})")

        def once(w: subprocess.Popen) -> float:
            w.stdin.write("go\n")
            w.stdin.flush()
            return float(w.stdout.readline())

        got: list[list[float]] = [[], []]
        for i in range(PAIRS):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                got[j].append(once(workers[j]))
        return {"base_prefill_ms": statistics.median(got[0]), "prefill_ms": statistics.median(got[1]),
                "prefill_ratio": statistics.median(b / q for b, q in zip(*got))}
    finally:
        for w in workers:
            w.stdin.close()
        for w in workers:
            w.wait()


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
    ap.add_argument("--prefill-worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(case(a.case[1], a.threads, a.case[0])))
        return 0
    if a.prefill_worker:
        prefill_worker(a.prefill_worker[1], a.threads, a.prefill_worker[0])
        return 0
    from quant.format.sources import default_cache_dir

    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    schemes = a.schemes.split(",")
    specs = {s: "" if s == "bf16 base" else str(ensure_artifact(Path(a.artifacts), s, cache)) for s in schemes}
    res: dict = {"date": time.strftime("%Y-%m-%d"), "threads": a.threads, "kernels": a.kernels, "results": {}}
    for cap in a.capabilities.split(","):
        env = dict(os.environ)
        for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(var, None)
        if cap != "native":
            env.update(ATEN_CPU_CAPABILITY=cap, ONEDNN_MAX_CPU_ISA=cap.upper(), MKL_ENABLE_INSTRUCTIONS=cap.upper())
        runs: dict[str, list[dict]] = {s: [] for s in schemes}
        pairs: dict[str, list[dict]] = {s: [] for s in schemes if s != "bf16 base" and "bf16 base" in schemes}

        for _ in range(a.rounds):
            for s in schemes:
                p = subprocess.run([sys.executable, __file__, "--case", a.kernels, specs[s], "--threads",
                                    str(a.threads)], capture_output=True, text=True, env=env, cwd=ROOT)
                if p.returncode:
                    raise RuntimeError(f"{cap} {s} failed:\n{p.stderr[-3000:]}")
                runs[s].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(cap, s, {k: v for k, v in runs[s][-1].items() if k != "kernels"}, flush=True)
                if s in pairs:
                    pairs[s].append(paired(specs[s], a.threads, a.kernels, env))
                    print(cap, s, "paired with the base", pairs[s][-1], flush=True)
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
            if pairs.get(s):
                ps = pairs[s]
                r["paired"] = {"prefill_ms": round(statistics.median(q["prefill_ms"] for q in ps), 1),
                               "base_prefill_ms": round(statistics.median(q["base_prefill_ms"] for q in ps), 1),
                               "prefill_ratio": round(statistics.median(q["prefill_ratio"] for q in ps), 3),
                               "ratios": [round(q["prefill_ratio"], 3) for q in ps]}
        res["results"][cap] = table
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    for cap, table in res["results"].items():
        print(f"\n{cap}:")
        for s, r in table.items():
            print(f"  {s:12s} decode {r['decode_tok_s']:7.1f} tok/s ({r.get('decode_vs_base', 1):.2f}x base)  "
                  f"prefill {r['prefill_ms']:8.1f} ms ({r.get('prefill_speedup_vs_base', 1):.2f}x base)"
                  + (f"  paired: {r['paired']['prefill_ms']:.1f} vs base {r['paired']['base_prefill_ms']:.1f} ms, "
                     f"ratio {r['paired']['prefill_ratio']:.3f} {r['paired']['ratios']}" if "paired" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
