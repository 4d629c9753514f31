"""GPTQ build time and peak memory for the default model (and RTN for comparison).

Each build runs as its own `quant build` process (calibration WikiText-2 valid, 128 x 512, seed 0);
wall time is measured around the process, peak RSS comes from the manifest.

    python bench/quant_time.py [--out bench/out/quant_time]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "quant_time"))
    ap.add_argument("--schemes", default="w4a16,rtn-w4")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for scheme in args.schemes.split(","):
        target = out / scheme
        cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", scheme, "--out", str(target), "--force",
               "--calib", str(DATA / "valid.txt"), "--calib-samples", "128", "--calib-seqlen", "512",
               "--seed", "0", "--no-progress"]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        m = json.loads((target / "quant_manifest.json").read_text())
        rows.append({"scheme": scheme, "wall_s": wall, **{k: m["timings"][k] for k in m["timings"]},
                     "peak_rss_bytes": m["memory"]["build_peak_rss_bytes"],
                     "group_size": m["parameters"]["group_size"],
                     "fallbacks": len(m["parameters"]["rtn_fallbacks"])})
    (out / "quant_time.json").write_text(json.dumps(rows, indent=2))
    print("| scheme | wall s | load s | calib data s | quantize s | peak RSS GiB | group | RTN fallbacks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['wall_s']:.1f} | {r['load_s']:.1f} | {r.get('calibration_data_s', 0):.1f} | "
              f"{r['quantize_s']:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['group_size']} | {r['fallbacks']} |")


if __name__ == "__main__":
    main()
