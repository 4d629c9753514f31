"""Build time of w8a8 against w4a16 (GPTQ) on the default model, same calibration, one run.

The limit: a w8a8 build costs at most 2x a w4a16 build of the same model and calibration, on this
CPU and on an AVX2-only one (where `torch._int_mm` is ~25x slower than fp32, so calibration must not run it).
Calibration: WikiText-2 valid, 128 x 512 tokens, seed 0. Each build is its own `quant build` process, timed
whole (load, calibration, quantization, writing); the manifest's phase timings are printed beside it.
The "-fp32" builds stand in for an AVX2-only CPU's choices: both once-per-process probes are fixed to what such a
CPU answers, calibration's int8 products on the fp32 path (`primitives.int_mm_is_faster`) and the calibration
pass's Linear products in fp32 (`primitives.bf16_matmul_is_faster`, behind `--matmul-dtype auto`). Their time
here stands in for that machine's choices, not for that machine; "w8a8-fp32" is compared with "w4a16-fp32".
Quality: each artifact against the fp32 base on WikiText-2 test windows, in one pass (`--eval-windows 0` skips
it).

    python bench/build_time.py [--out bench/out/build_time] [--samples 128] [--schemes w4a16 w8a8 ...]
Nothing else may run meanwhile (every build uses every core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
CONFIGS = {
    "w4a16": ["--scheme", "w4a16"],
    "w8a8": ["--scheme", "w8a8"],  # static input scales, calib-method auto, alpha searched: the default
    "w8a8-dynamic": ["--scheme", "w8a8", "--act-dynamic"],
    "w8a8-kl": ["--scheme", "w8a8", "--calib-method", "kl"],
    "w4a16-fp32": ["--scheme", "w4a16"],
    "w8a8-fp32": ["--scheme", "w8a8"],
}
# Runs `quant build` with the probes' answers fixed to "fp32 is faster" (see the docstring).
FP32_PRODUCTS = ("import sys; from quant.runtime import primitives as P; P._INT_MM_FASTER['cpu'] = False; "
                 "P._BF16_FASTER['cpu'] = False; from quant.cli import main; sys.exit(main(sys.argv[1:]))")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "build_time"))
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--schemes", nargs="+", default=["w4a16", "w8a8", "w4a16-fp32", "w8a8-fp32"],
                    choices=list(CONFIGS))
    ap.add_argument("--eval-windows", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from quant.runtime.primitives import int_mm_is_faster

    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"torch {torch.__version__}; int8 products in calibration: "
          f"{'_int_mm' if int_mm_is_faster(torch.device('cpu')) else 'fp32 matmul'}", flush=True)
    rows = {}
    for name in args.schemes:
        entry = ["-c", FP32_PRODUCTS] if name.endswith("-fp32") else ["-m", "quant.cli"]
        cmd = [sys.executable, *entry, "build", *CONFIGS[name], "--out", str(out / name), "--force",
               "--calib", str(DATA / "valid.txt"), "--calib-samples", str(args.samples),
               "--calib-seqlen", str(args.seqlen), "--seed", "0", "--no-progress"]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        wall = time.perf_counter() - t
        timings = json.loads((out / name / "quant_manifest.json").read_text())["timings"]
        rows[name] = (wall, timings)
        print(f"{name}: {wall:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in timings.items())})", flush=True)
    quality = {}
    if args.eval_windows:
        from quant import load
        from quant.build import calibration, evaluate
        from quant.format import sources as models

        base, tok = models.load_model(models.resolve(None, models.default_cache_dir()))
        windows = calibration.eval_windows(tok, DATA / "test.txt", args.eval_windows, args.seqlen)
        quality = evaluate.compare(base, {n: load(out / n, dtype=torch.float32).model for n in rows}, windows,
                                   progress=False)
    print(f"\n| build ({args.samples} x {args.seqlen}) | process s | quantize s | vs its w4a16 | Δppl % | mean KL |"
          "\n|---|---|---|---|---|---|")
    for name, (wall, timings) in rows.items():
        ref = rows.get("w4a16-fp32" if name.endswith("-fp32") else "w4a16")  # the same machine's choices
        ratio = f"{wall / ref[0]:.2f}x" if ref else ""
        q = quality.get(name)
        qual = f"{q.delta_ppl_pct:+.2f} | {q.mean_kl:.4f}" if q else " | "
        print(f"| {name} | {wall:.1f} | {timings['quantize_s']:.1f} | {ratio} | {qual} |")


if __name__ == "__main__":
    main()
