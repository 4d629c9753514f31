"""The build-to-build spread behind tests/test_default_model.py's quality guards.

GPTQ's builds are float arithmetic in this CPU's kernels' order, and a last-bit difference (thread count, vector
ISA) draws other roundings: a guard holds a scheme to the mean of three builds of its guard config, with 1 thread,
2 threads and AVX2's kernels on 1 thread (ATen, MKL and oneDNN capped, as on an AVX2-only EPYC), each evaluated
as the test evaluates it (4 x 512 of WikiText-2 test, float64). This prints each build's Δppl and KL, and the
guard the test would hold: the mean, 1.5x the half-range (at least 0.25 point), the mean KL.

    python bench/guard_spread.py [--guards w8a8-static,w8a8-dynamic]       (a few minutes per build on 2 cores)

Each build runs in a fresh process (`--one NAME`), its environment set before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads": {"OMP_NUM_THREADS": "2"},
    "AVX2, 1 thread": {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                       "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def one(name: str) -> dict:
    """Build the guard config `name` (tests/test_default_model.py's GUARDS) and evaluate it as the test does."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from test_default_model import GUARDS, TEST_TXT

    from quant import artifact
    from quant.build import build
    from quant.config import BuildConfig, EvalConfig
    from quant.models import default_cache_dir

    fields = GUARDS[name][0]
    with tempfile.TemporaryDirectory() as d:
        cfg = BuildConfig(out=f"{d}/a", eval=EvalConfig(data=str(TEST_TXT), windows=4), **fields)
        q = artifact.verify(build(cfg, default_cache_dir(), progress=False, log=lambda *_: None))["quality"]
    return {"dppl": q["delta_ppl_pct"], "kl": q["mean_kl"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--guards", default="w8a8-static,w8a8-dynamic,w4a16")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    print("| guard | " + " | ".join(VARIANTS) + " | mean Δppl % | margin | mean KL |")
    print("|---|" + "---|" * (len(VARIANTS) + 3))
    for name in args.guards.split(","):
        runs = []
        for env in VARIANTS.values():
            out = subprocess.run([sys.executable, __file__, "--one", name], env={**os.environ, **env}, check=True,
                                 capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        d = [r["dppl"] for r in runs]
        mean, margin = sum(d) / len(d), max(0.25, 1.5 * (max(d) - min(d)) / 2)
        kl = sum(r["kl"] for r in runs) / len(runs)
        cells = " | ".join(f"{r['dppl']:+.3f} / {r['kl']:.5f}" for r in runs)
        print(f"| {name} | {cells} | {mean:+.3f} | {margin:.2f} | {kl:.5f} |", flush=True)


if __name__ == "__main__":
    main()
