"""Model-generated calibration text (`quant build --calib self`, the default): our generator against transformers'
`generate` on the default model in fp32, the same samples, sequence length and seed, one process, in turn.

- "transformers generate, batch 16": what the build ran before (sampling at temperature 1 with `min_new_tokens`
  holding end of sequence off, 16 sequences at a time, the torch global generator);
- "ours, batch B": `quant.build.calibration.self_generated` (a generator per sequence, so its text does not depend
  on B), at 16 and at the batch the build picks on this machine (`generation_batch`: free memory, up to 128).

    python bench/calib_generation.py [--samples 64] [--seqlen 128] [--rounds 1]
Nothing else may run meanwhile (generation uses every core).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import cpu_name

from quant.build import calibration
from quant.format import sources
from quant.runtime import measure


@torch.inference_mode()
def transformers_generate(model, tok, samples: int, seqlen: int, seed: int, batch: int = 16) -> torch.Tensor:
    """The build's former generator: transformers' `generate`, sampling, `batch` sequences at a time."""
    g = torch.Generator().manual_seed(seed)
    special = set(tok.all_special_ids)
    firsts = [t for t in torch.randperm(model.config.vocab_size, generator=g).tolist() if t not in special][:samples]
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, samples, batch):
            start = torch.tensor(firsts[i : i + batch])[:, None]
            out = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=seqlen - 1, min_new_tokens=seqlen - 1,
                                 pad_token_id=tok.eos_token_id)
            rows.append(out[:, :seqlen])
    return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cache", type=Path, default=sources.default_cache_dir())
    args = ap.parse_args()
    model, tok = sources.load_model(sources.resolve(None, args.cache, fingerprint=False), dtype=torch.float32,
                                    device="cpu")
    model.eval()
    free = measure.available_bytes(torch.device("cpu")) // 2 - measure.float_model_bytes(model, torch.float32)
    picked = calibration.generation_batch(model.config, args.samples, args.seqlen, free)
    runs = {"transformers generate, batch 16": lambda: transformers_generate(model, tok, args.samples, args.seqlen, 0),
            "ours, batch 16": lambda: calibration.self_generated(model, tok, args.samples, args.seqlen, 0, 16).ids,
            f"ours, batch {picked} (the build's)": lambda: calibration.self_generated(
                model, tok, args.samples, args.seqlen, 0, picked).ids}
    times: dict[str, list[float]] = {k: [] for k in runs}
    texts = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            texts[name] = fn()
            times[name].append(time.perf_counter() - t)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {args.samples} x {args.seqlen} tokens, "
          f"median of {args.rounds} round(s)")
    base = statistics.median(times["transformers generate, batch 16"])
    print("| generator | s | tok/s | against transformers |\n|---|---|---|---|")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {name} | {s:.1f} | {args.samples * args.seqlen / s:.0f} | {base / s:.2f}x |")
    ours = [v for k, v in texts.items() if k.startswith("ours")]
    print("ours: the same text at both batches:", all(torch.equal(t, ours[0]) for t in ours))


if __name__ == "__main__":
    main()
