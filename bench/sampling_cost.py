"""What the sampling controls cost per decode step, on this CPU: ``server.sampling.sample`` as the engine calls it
(with the fused CPU ops where they build) on the default model's own logits (rows of its forward over a WikiText-2
passage, vocabulary 49152), timed against the sampler of an earlier commit (default: the one before the draw among
each row's top candidates and the fused uniforms) in the same run, interleaved; then each control on, for what
using it costs.

    python bench/sampling_cost.py [--base REV] [--batches 1,8,32] [--reps 30]

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

BASE = "038cf98"  # main before the draw among the top candidates and the fused uniforms


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


def case(mod, params, logits, history_len: int, ops=None):
    """A call of ``mod``'s sampler on ``params`` (one per row), as the engine makes it (``ops``: the glue ops the
    engine passes, where ``mod`` takes them)."""
    n = logits.shape[0]
    hist = [[(7 * i + 3 * b) % logits.shape[1] for i in range(history_len)] for b in range(n)]
    uses = any(p.repetition_penalty != 1.0 or getattr(p, "uses_history", False) for p in params)
    batch = mod.SamplingBatch.build(params, [11 + b for b in range(n)], [5] * n, hist if uses else None,
                                    prompt_lens=[history_len // 2] * n)
    return (lambda: mod.sample(logits, batch, ops)) if ops is not None else (lambda: mod.sample(logits, batch))


def model_logits(rows: int) -> torch.Tensor:
    """(rows, V) fp32: the default model's next-token logits at the last ``rows`` positions of a WikiText-2
    passage (a sampler's real input: a few likely tokens over a long tail)."""
    from common import wikitext_articles

    from quant.format import sources

    model, tok = sources.load_model(sources.resolve(None, sources.default_cache_dir()))
    ids = tok(wikitext_articles(1)[0], return_tensors="pt").input_ids[:, : 256 + rows]
    with torch.no_grad():
        return model(ids).logits[0, -rows:].float().contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help=f"the commit whose sampler is the baseline (default {BASE})")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    base = load_sampler(a.base)
    from server import fastops

    ops = fastops.Ops("fused" if fastops.load() else "eager")
    batches = [int(x) for x in a.batches.split(",")]
    all_logits = model_logits(max(batches))
    plain = {"greedy": dict(temperature=0.0), "T 0.7": dict(temperature=0.7),
             "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9)}
    controls = {"+ min_p 0.05": dict(min_p=0.05),
                "+ presence 0.5, frequency 0.5 (512 ids)": dict(presence_penalty=0.5, frequency_penalty=0.5),
                "+ logit_bias (10 ids)": dict(logit_bias={i * 97: -2.0 for i in range(10)}),
                "+ all three": dict(min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                                    logit_bias={i * 97: -2.0 for i in range(10)})}
    rows = []
    for b in batches:
        logits = all_logits[:b]  # (B, V)
        fns = {}
        for name, kw in plain.items():
            fns[(name, "base")] = case(base, [SamplingParams(**kw)] * b, logits, 512)
            fns[(name, "now")] = case(sampling, [SamplingParams(**kw)] * b, logits, 512, ops)
        for name, kw in controls.items():
            fns[(name, "now")] = case(sampling, [SamplingParams(temperature=0.7, top_p=0.9, **kw)] * b,
                                      logits, 512, ops)
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
    print(f"Sampler cost per call, the default model's logits (vocab {all_logits.shape[1]}), glue ops {ops.kind}, "
          f"{torch.get_num_threads()} threads, {cpu_name()}; median of {a.reps} interleaved rounds; base = "
          f"server/sampling.py at {a.base}. Ratio: now / base for the plain rows, now / the same row without the "
          f"control for the others.\n")
    print("| batch | request | base us | now us | ratio |")
    print("|---|---|---|---|---|")
    for b, name, was, now, r in rows:
        print(f"| {b} | {name} | {'-' if was is None else f'{was:.0f}'} | {now:.0f} | {r:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
