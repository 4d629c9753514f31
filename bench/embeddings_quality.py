"""What 8-bit embeddings and head cost in quality: the same per-row symmetric int8 the engine serves with
``--embeddings int8`` (server/layers/embedding.py), applied to the tied embedding of the default model's bf16 base
and of its w4a16 artifact, compared with each one without it (and with the fp32 base) on wikitext-2 test windows.

    python bench/embeddings_quality.py [--windows 40] [--seqlen 512]

The engine's int8 embedding dequantizes the looked-up rows (exactly these values) and multiplies the head with
``_weight_int8pack_mm`` (these values, accumulated in fp32); evaluating through transformers' forward with the
dequantized values in place of the float ones measures the same model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from common import ensure_artifact

ROOT = Path(__file__).resolve().parents[1]


def with_int8_embeddings(model):
    """A copy of `model` whose (tied) embedding and head hold the per-row int8 values, dequantized."""
    from server.layers.embedding import quantize_rows

    m = copy.deepcopy(model)
    emb = m.get_input_embeddings().weight
    q, s = quantize_rows(emb.data)
    emb.data = (q.float() * s.float()[:, None]).to(emb.dtype)
    head = m.get_output_embeddings()
    if head is not None and head.weight is not emb:
        q, s = quantize_rows(head.weight.data)
        head.weight.data = (q.float() * s.float()[:, None]).to(head.weight.dtype)
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"))
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "embeddings_quality.json"))
    args = ap.parse_args(argv)
    from quant.build import calibration, evaluate
    from quant.format import sources as models
    from quant.runtime import loader

    torch.manual_seed(0)
    cache = Path(os.environ.get("QUANTSERVE_CACHE") or models.default_cache_dir())
    src = models.resolve(None, cache)
    base, tok = models.load_model(src, torch.float32)
    windows = calibration.eval_windows(tok, args.data, args.windows, args.seqlen)
    w4 = loader.load(ensure_artifact(Path(args.artifacts), "w4a16", cache), dtype=torch.float32).model
    bf16 = copy.deepcopy(base).to(torch.bfloat16).float()  # the bf16 base's values, evaluated in fp32
    cands = {"bf16 base": bf16, "bf16 base + int8 embeddings": with_int8_embeddings(bf16),
             "w4a16": w4, "w4a16 + int8 embeddings": with_int8_embeddings(w4)}
    res = evaluate.compare(base, cands, windows, progress=False)
    out = {"date": time.strftime("%Y-%m-%d"), "windows": windows.describe(),
           "vs fp32 base": {k: v.to_dict() for k, v in res.items()}}
    # Against the same scheme without it: the cost of the option itself.
    for name in ("bf16 base", "w4a16"):
        r = evaluate.compare(cands[name], {"+ int8 embeddings": cands[f"{name} + int8 embeddings"]}, windows,
                             progress=False)["+ int8 embeddings"]
        out[f"{name} + int8 embeddings vs {name}"] = r.to_dict()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
