"""The w8a8 perplexity of the default model at past commits, each built and evaluated by its own code (#43).

Each commit is checked out in a scratch worktree and runs, with the README's WikiText-2 settings (calibration
128 x 512 of valid, seed 0; evaluation 40 x 512 of test, float32):
    python -m quant.cli build --scheme w8a8 [--act-dynamic] ... --eval-data test.txt
The manifest's quality report is printed as one JSON line per commit; `--bisect GOOD BAD` halves the range
between two commits until the first one whose Δppl is past `--threshold`.

    python bench/quality_bisect.py --commits 4f3b659 HEAD [--static] [--out bench/out/bisect]
    python bench/quality_bisect.py --bisect 4f3b659 HEAD --threshold 0.85
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def measure(commit: str, out: Path, static: bool) -> dict:
    sha = git("rev-parse", "--short", commit)
    done = out / f"{sha}{'-static' if static else ''}.json"
    if done.exists():
        return json.loads(done.read_text())
    tree = out / "trees" / sha
    if not tree.exists():
        git("worktree", "add", "--detach", str(tree), sha)
    art = out / "artifacts" / sha
    cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", "w8a8", *([] if static else ["--act-dynamic"]),
           "--calib", str(DATA / "valid.txt"), "--calib-samples", "128", "--calib-seqlen", "512", "--seed", "0",
           "--eval-data", str(DATA / "test.txt"), "--eval-windows", "40", "--out", str(art), "--force",
           "--no-progress"]
    t = time.perf_counter()
    run = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    if run.returncode:
        result = {"commit": sha, "error": (run.stderr or run.stdout).strip().splitlines()[-1][:300]}
    else:
        q = json.loads((art / "quant_manifest.json").read_text())["quality"]
        result = {"commit": sha, "subject": git("log", "-1", "--format=%s", sha)[:100],
                  **{k: q[k] for k in ("delta_ppl_pct", "mean_kl", "top1_agreement", "ppl", "base_ppl")},
                  "seconds": round(time.perf_counter() - t)}
    done.write_text(json.dumps(result))
    git("worktree", "remove", "--force", str(tree))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", nargs="*", default=[])
    ap.add_argument("--bisect", nargs=2, metavar=("GOOD", "BAD"))
    ap.add_argument("--threshold", type=float, default=0.85, help="Δppl %% past which a commit counts as bad")
    ap.add_argument("--static", action="store_true", help="the static (default) w8a8 instead of --act-dynamic")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "bisect"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for c in args.commits:
        print(json.dumps(measure(c, out, args.static)), flush=True)
    if args.bisect:
        good, bad = args.bisect
        span = git("rev-list", "--reverse", "--first-parent", f"{good}..{bad}").split()  # (good, bad]
        lo, hi = -1, len(span) - 1  # span[lo] good (lo -1: GOOD itself), span[hi] bad
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = measure(span[mid], out, args.static)
            print(json.dumps(r), flush=True)
            bad_mid = "error" in r or r["delta_ppl_pct"] > args.threshold
            lo, hi = (lo, mid) if bad_mid else (mid, hi)
        print(f"first bad: {git('log', '-1', '--format=%h %s', span[hi])[:150]}", flush=True)


if __name__ == "__main__":
    main()
