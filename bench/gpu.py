"""The GPU check and benchmarks (run by scripts/gpu_check.sh on a machine with a CUDA device).

    python bench/gpu.py [--out DIR] [--quick] [--only PARTS] [--deadline SECONDS]
    python bench/gpu.py --render DIR/gpu.json          # a saved run's report again (no GPU needed)
    python bench/gpu.py --record SECTION.md            # that report into bench/RESULTS.md (no GPU needed)

Parts, in the order a lease runs them (PARTS): headline, bf16, attention, linear, gemv, engine, default; a part's
timings stop at PART_S seconds (what was cut is reported) so that each ends within two minutes.

1. Kernels vs their plain PyTorch references on the GPU, at the default model's shapes and an 8B model's
   (Llama-3-8B: hidden 4096, MLP 14336, 32/8 heads of 128): the Triton W4A16 and int8 GEMMs, the Triton paged
   attention (decode with split-K, prefill with past). Any mismatch past tolerance fails the run
   (bench/gpu_kernels.py).
2. Kernel timings (CUDA graph replays, median of repeats), the peers in the same run: W4A16 Triton vs tinygemm
   (``_weight_int4pack_mm``) vs GemLite (its wheel from scripts/gpu_wheels.sh) vs bf16 cuBLAS; int8 Triton vs
   ``_weight_int8pack_mm`` vs bf16; paged decode attention (Triton) vs the sdpa backend's gather path
   (bench/gpu_kernels.py).
3. The engine on the GPU over random-weight models of the default model's shape and an 8B shape, w4a16 (random
   codes: the speed does not depend on the values), and a bf16 8B beside it: batch-1 greedy decode tok/s and its
   share of the bandwidth limit (weight bytes / peak bandwidth), TTFT of a 512-token prompt, 64 streams' aggregate
   tok/s with the triton backend vs the sdpa backend, host syncs per decode step (torch.cuda.set_sync_debug_mode),
   and the accounting (weights, KV pool, activation estimate) against the CUDA allocator (bench/gpu_engine.py).

Writes DIR/gpu.json and DIR/gpu.md (bench/RESULTS.md's GPU check section, bench/gpu_report.py). Exit status 1 when
a correctness check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


PARTS = ("headline", "bf16", "attention", "linear", "gemv", "engine", "default")  # by priority: a lease's order
HELP_PARTS = {
    "headline": "the 8B w4a16 engine: batch 1, TTFT, syncs, accounting, 64 x 256 streams",
    "bf16": "the same rows for a bf16 8B engine (the float peer)",
    "attention": "paged attention vs its reference, timed beside sdpa",
    "linear": "W4A16 and int8 products vs their references, timed beside tinygemm, int8pack and cuBLAS",
    "gemv": "the one-row kernels' launch sweeps at the 8B shapes",
    "engine": "the 135M and 8B w4a16 engines: backends, eager glue, built-in rules",
    "default": "the default model built with --device cuda and served",
}


def parts(text: str) -> list[str]:
    """--only's value: known part names, in the order given."""
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(bad) or '(none)'}; parts: {', '.join(PARTS)}")
    return chosen


def record(section: str, results_md: Path) -> None:
    """Put ``section`` (a report: its first line is its heading) into ``results_md`` in place of the section of the
    same heading, up to the next ``## `` heading; appended where there is none."""
    heading = section.splitlines()[0].rstrip()
    lines = results_md.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        text = "".join(lines).rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        text = "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n" + "".join(lines[end:])
                                                                       if end < len(lines) else "")
    results_md.write_text(text)


def git_commit() -> str | None:
    """The checkout's commit (with ``+`` where its tracked files differ from it), where git can say."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return sha + ("+" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def installed(package: str) -> str | None:
    """The installed version of ``package`` (a peer's wheel), None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu"))
    ap.add_argument("--quick", action="store_true", help="fewer row counts and shorter streams")
    ap.add_argument("--only", default=None, type=parts,
                    help="comma-separated parts, run in the order given (default: all, in this order): "
                         + "; ".join(f"{k}: {v}" for k, v in HELP_PARTS.items()))
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: start no part after this many (a lease's budget); what ran is written")
    ap.add_argument("--default-model", type=Path, default=None, help="the default model's GGUF: build + serve it")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2")
    ap.add_argument("--render", type=Path, metavar="GPU_JSON",
                    help="print the report of a saved run (its gpu.json) and exit; needs no GPU")
    ap.add_argument("--record", type=Path, metavar="SECTION_MD",
                    help="put this report section into --results in place of the section of the same heading (or "
                         "append it) and exit; needs no GPU")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md", help="the file --record writes")
    args = ap.parse_args(argv)
    if args.render or args.record:
        if args.render:
            from gpu_report import markdown

            saved = json.loads(args.render.read_text())
            print(markdown(saved["results"], saved["failures"]), end="")
        if args.record:
            record(args.record.read_text(), args.results)
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here", file=sys.stderr)
        return 2
    import triton
    from gpu_engine import default_model_check, engine_bench
    from gpu_kernels import Clock, attention_checks, gemv_sweep, kernel_checks
    from gpu_report import markdown

    results = {"env": {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
                       "gemlite": installed("gemlite")}}
    failures: list[str] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "gpu.json").write_text(json.dumps({"results": results, "failures": failures}, indent=1))
        (out / "gpu.md").write_text(markdown(results, failures))

    if args.default_model is None:  # the embedded default model, where its package is installed
        try:
            from quant.format.sources import default_gguf_path

            args.default_model = default_gguf_path()
        except Exception as e:  # noqa: BLE001 - said in the report, not a failure of the GPU path
            results["default_model_skipped"] = f"{e} (pass --default-model GGUF)"
    run = {
        "headline": [("engine 8B, headline", lambda: engine_bench(results, failures, "8B", args.quick, headline=True))],
        "bf16": [("engine 8B bf16, headline", lambda: engine_bench(results, failures, "8B", args.quick, headline=True,
                                                                   scheme="bf16"))],
        "linear": [("linear", lambda: kernel_checks(results, failures, args.quick, Clock()))],
        "attention": [("attention", lambda: attention_checks(results, failures, args.quick))],
        "gemv": [("gemv sweep", lambda: gemv_sweep(results, failures, Clock()))],
        "default": [("default model", lambda: default_model_check(results, failures, args.default_model, args.data,
                                                                  out / "work"))] if args.default_model else [],
        "engine": [(f"engine {s}", lambda s=s: engine_bench(results, failures, s, args.quick)) for s in ("135M", "8B")],
    }
    chosen = args.only or [p for p in PARTS if not (p == "gemv" and args.quick)]
    t_start = time.perf_counter()
    for name, fn in (step for part in chosen for step in run[part]):
        if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            results.setdefault("skipped", []).append(name)
            print(f"[gpu] {name}: skipped, past the {args.deadline:.0f} s deadline", flush=True)
            save()
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a step that breaks is a failure to report, and the others still run
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(e).__name__}: {e}")
        print(f"[gpu] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    print(markdown(results, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
