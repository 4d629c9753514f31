"""What the sampling controls cost per decode step, on this CPU: ``server.sampling.sample`` on one batch of
logits at the default model's vocabulary, timed against the sampler of an earlier commit (default: the one before
min_p, the presence / frequency penalties and logit_bias) in the same run, interleaved, so a request that uses none
of the controls can be seen to pay nothing for them; then each control on, for what using it costs.

    python bench/sampling_cost.py [--base REV] [--vocab 49152] [--batches 1,8,32] [--reps 30]

Prints a markdown table (median microseconds per call over --reps interleaved rounds) for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import cpu_name

from server import sampling
from server.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

BASE = "a461a2a"  # main before min_p, the presence / frequency penalties and logit_bias


def load_sampler(rev: str):
    """server/sampling.py as it was at ``rev``, imported under another name (it imports server.batch, unchanged)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:server/sampling.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sampling_base"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def case(mod, params, logits, history_len: int):
    """A call of ``mod``'s sampler on ``params`` (one per row), as the engine makes it."""
    n = logits.shape[0]
    hist = [[(7 * i + 3 * b) % logits.shape[1] for i in range(history_len)] for b in range(n)]
    uses = any(p.repetition_penalty != 1.0 or getattr(p, "uses_history", False) for p in params)
    kw = {"prompt_lens": [history_len // 2] * n} if mod is sampling else {}
    batch = mod.SamplingBatch.build(params, [11 + b for b in range(n)], [5] * n, hist if uses else None, **kw)
    return lambda: mod.sample(logits, batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help=f"the commit whose sampler is the baseline (default {BASE})")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    base = load_sampler(a.base)
    g = torch.Generator().manual_seed(0)
    plain = {"greedy": dict(temperature=0.0), "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9)}
    controls = {"+ min_p 0.05": dict(min_p=0.05),
                "+ presence 0.5, frequency 0.5 (512 ids)": dict(presence_penalty=0.5, frequency_penalty=0.5),
                "+ logit_bias (10 ids)": dict(logit_bias={i * 97: -2.0 for i in range(10)}),
                "+ all three": dict(min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                                    logit_bias={i * 97: -2.0 for i in range(10)})}
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        logits = torch.randn(b, a.vocab, generator=g) * 3  # (B, V)
        fns = {}
        for name, kw in plain.items():
            fns[(name, "base")] = case(base, [base.SamplingParams(**kw)] * b, logits, 512)
            fns[(name, "now")] = case(sampling, [SamplingParams(**kw)] * b, logits, 512)
        for name, kw in controls.items():
            fns[(name, "now")] = case(sampling, [SamplingParams(temperature=0.7, top_p=0.9, **kw)] * b,
                                      logits, 512)
        for fn in fns.values():  # warm up
            fn()
        times = {k: [] for k in fns}
        for _ in range(a.reps):  # interleaved rounds: drift on a noisy machine hits every case alike
            for k, fn in fns.items():
                times[k].append(timed(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = med[("T 0.7, top-p 0.9", "now")]
        for name in plain:
            rows.append((b, name, med[(name, "base")], med[(name, "now")], med[(name, "now")] / med[(name, "base")]))
        for name in controls:
            rows.append((b, f"T 0.7, top-p 0.9 {name}", None, med[(name, "now")], med[(name, "now")] / ref))
    print(f"Sampler cost per call, vocab {a.vocab}, {torch.get_num_threads()} threads, {cpu_name()}; median of "
          f"{a.reps} interleaved rounds; base = server/sampling.py at {a.base}. Ratio: now / base for the plain "
          f"rows, now / the same row without the control for the others.\n")
    print("| batch | request | base us | now us | ratio |")
    print("|---|---|---|---|---|")
    for b, name, was, now, r in rows:
        print(f"| {b} | {name} | {'-' if was is None else f'{was:.0f}'} | {now:.0f} | {r:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
