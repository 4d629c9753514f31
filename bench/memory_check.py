"""Predicted vs measured memory on the default model (CPU).

- W: `quant.build.memory.weight_bytes` for each scheme vs the bytes of the tensors in built artifacts
  (bench/out/quality/<scheme>, as built by bench/quality.py) loaded with `quant.load`.
- KV: the formula vs the bytes of a real transformers DynamicCache after a prefill.
- A: `prefill_activation_bytes` vs the peak of live tensor bytes measured op by op
  (`quant.runtime.measure.MemoryTracker`, the allocator's view) for eager and SDPA attention, fp32 and bf16.

    python bench/memory_check.py [--artifacts bench/out/quality]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quant import load
from quant.build.memory import weight_bytes
from quant.format import sources as models
from quant.runtime.measure import MemoryTracker, float_model_bytes, weight_report
from quant.shape.memory import dtype_bytes, kv_bytes_per_token, prefill_activation_bytes
from quant.shape.model import ModelShape

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "memory_check.json"))
    args = ap.parse_args()
    src = models.resolve(None, models.default_cache_dir())
    model, _ = models.load_model(src, torch.float32)
    shape = ModelShape.from_config(model.config)
    rows = {"weights": [], "kv": [], "activations": []}

    for scheme in ("int8-sym", "int8-affine", "w8a8-auto", "rtn-w4", "w4a16"):
        path = Path(args.artifacts) / scheme
        if not (path / "quant_manifest.json").exists():
            continue
        art = load(path)
        manifest = art.manifest
        group = manifest["parameters"].get("group_size") or 128
        pred = weight_bytes(shape, manifest["scheme"], float_bytes=2, group_size=group, served=True)["total"]
        measured = weight_report(art.model)["total"]
        rows["weights"].append({"scheme": scheme, "predicted": pred, "measured": measured, "ratio": pred / measured})
    pred = weight_bytes(shape, "float", float_bytes=4)["total"]
    rows["weights"].append({"scheme": "float32 base", "predicted": pred, "measured": float_model_bytes(model),
                            "ratio": pred / float_model_bytes(model)})

    from transformers import DynamicCache

    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        for s in (128, 1000):
            cache = DynamicCache()
            with torch.inference_mode():
                m(torch.randint(0, 1000, (2, s)), past_key_values=cache, use_cache=True, logits_to_keep=1)
            measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
            pred = 2 * s * kv_bytes_per_token(shape, dtype)
            rows["kv"].append({"dtype": str(dtype), "batch": 2, "tokens": s, "predicted": pred, "measured": measured})
        for attn in ("eager", "sdpa"):
            m.config._attn_implementation = attn
            for batch, s in ((1, 128), (1, 1024), (4, 512), (1, 2048)):
                ids = torch.randint(0, 1000, (batch, s))
                with torch.inference_mode(), MemoryTracker() as tr:
                    m(ids, use_cache=False, logits_to_keep=1)
                pred = prefill_activation_bytes(shape, batch, s, attn, dtype_bytes(dtype))
                rows["activations"].append({"dtype": str(dtype).replace("torch.", ""), "attn": attn, "batch": batch,
                                            "seq": s, "predicted": pred, "measured": tr.peak,
                                            "ratio": pred / tr.peak})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print("| weights | predicted B | measured B | ratio |\n|---|---|---|---|")
    for r in rows["weights"]:
        print(f"| {r['scheme']} | {r['predicted']:,} | {r['measured']:,} | {r['ratio']:.4f} |")
    print("\n| KV cache | batch x tokens | predicted B | measured B |\n|---|---|---|---|")
    for r in rows["kv"]:
        print(f"| {r['dtype']} | {r['batch']} x {r['tokens']} | {r['predicted']:,} | {r['measured']:,} |")
    print("\n| prefill activations | attn | batch x seq | predicted MiB | measured MiB | ratio |\n|---|---|---|---|---|---|")
    for r in rows["activations"]:
        print(f"| {r['dtype']} | {r['attn']} | {r['batch']} x {r['seq']} | {r['predicted'] / 2**20:.2f} | "
              f"{r['measured'] / 2**20:.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
