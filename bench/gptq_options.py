"""What act-order and asymmetric zero-points buy GPTQ on the default model, against RTN.

Smaller than bench/quality.py so that it runs in ~8 minutes: calibration WikiText-2 valid 32 x 512
(seed 0), evaluation WikiText-2 test 10 x 512, group size 64 (the largest that divides the default model's
hidden size 576; `--group-size 32` for the finer grid, 128 does not divide it), each option a separate
`quant build` process, all evaluated against the fp32 base in one pass.

    python bench/gptq_options.py [--out bench/out/gptq_options] [--group-size 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
CONFIGS = {
    "gptq": ["--scheme", "w4a16", "--no-act-order"],
    "gptq-act": ["--scheme", "w4a16", "--act-order"],
    "gptq-asym": ["--scheme", "w4a16", "--no-act-order", "--asym"],
    "gptq-act-asym": ["--scheme", "w4a16", "--act-order", "--asym"],
    "rtn": ["--scheme", "rtn-w4"],
    "rtn-asym": ["--scheme", "rtn-w4", "--asym"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gptq_options"))
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from quant import load
    from quant.build import calibration, evaluate
    from quant.format import sources as models

    for name, extra in CONFIGS.items():
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quant.cli", "build", *extra, "--out", str(out / name), "--force",
                        "--calib", str(DATA / "valid.txt"), "--calib-samples", "32", "--calib-seqlen", "512",
                        "--group-size", str(args.group_size),
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{name}: built in {time.perf_counter() - t:.1f} s", flush=True)
    src = models.resolve(None, models.default_cache_dir())
    base, tok = models.load_model(src)
    windows = calibration.eval_windows(tok, DATA / "test.txt", 10, 512)
    res = evaluate.compare(base, {n: load(out / n, dtype=torch.float32).model for n in CONFIGS}, windows,
                           progress=False)
    print(f"group size {args.group_size}; base ppl {next(iter(res.values())).base_ppl:.3f}")
    print("| config | ppl | Δppl % | mean KL | recovers of RTN's increase (same grid) |\n|---|---|---|---|---|")
    for n, q in res.items():
        rtn = res["rtn-asym" if "asym" in n else "rtn"].delta_ppl_pct
        rec = "" if n.startswith("rtn") else f"{100 * (rtn - q.delta_ppl_pct) / rtn:.0f}%"
        print(f"| {n} | {q.ppl:.3f} | {q.delta_ppl_pct:+.2f} | {q.mean_kl:.4f} | {rec} |")


if __name__ == "__main__":
    main()
