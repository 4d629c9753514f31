"""What a quantized KV cache costs in quality on the default model: every cache format against a bf16 cache.

    python bench/kv_quality.py [--windows 40] [--seqlen 512] [--formats int8,fp8,int4,...] [--models float,w4a16]
                               [--artifacts DIR] [--json]

For the float default model and its w4a16 artifact (built under --artifacts where absent), each evaluated in
float32 on WikiText-2 test windows: the same weights with attention reading K and V back through each cache
format (quant.runtime.kv_quant.round_trip, quant.build.evaluate.KVCacheView) against the same weights with K and V
rounded to bfloat16 (the served default). Reported per format: its bytes per token against bf16's (scales
included; a format with a residual also holds one group per sequence in its residual format, given as the bf16
tokens it would hold), Δppl % with its standard error over the windows, mean KL and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import cpu_name, ensure_artifact

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--formats", default="int8,int8-rotk,int8-plain,fp8,int4-token,int4-token-rot,int4-chan,int4,int4-kres")
    ap.add_argument("--models", default="float,w4a16", help="the float default model and/or its w4a16 artifact")
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from quant.build import calibration
    from quant.build.evaluate import KVCacheView, compare
    from quant.format import sources
    from quant.format.sources import default_cache_dir
    from quant.runtime import loader
    from quant.shape.kv_formats import FORMATS
    from quant.shape.model import ModelShape

    cache = default_cache_dir()
    formats = args.formats.split(",")
    models = {}
    wanted = args.models.split(",")
    float_model, tok = sources.load_model(sources.resolve(None, cache), torch.float32)
    if "float" in wanted:
        models["float"] = float_model
    if "w4a16" in wanted:
        art = loader.load(str(ensure_artifact(Path(args.artifacts), "w4a16", cache)), dtype=torch.float32)
        models["w4a16"] = art.model
    windows = calibration.eval_windows(tok, DATA, args.windows, args.seqlen)
    shape = ModelShape.from_config(float_model.config)
    bf16_token = 2 * shape.head_dim * 2  # K and V
    rows = []
    for name, model in models.items():
        model.eval()
        got = compare(KVCacheView(model, "bfloat16"), {f: KVCacheView(model, f) for f in formats}, windows,
                      progress=False)
        for f, q in got.items():
            fmt = FORMATS[f]
            row = {"model": name, "kv": f, "bytes_x": fmt.bytes_per_token(shape.head_dim) / bf16_token,
                   "residual_tokens_bf16": fmt.residual_bytes(shape.head_dim) / bf16_token, **q.to_dict()}
            rows.append(row)
            if not args.json:
                extra = f" + {row['residual_tokens_bf16']:.1f} bf16 tokens a sequence" if fmt.residual else ""
                print(f"{name:6s} {f:10s} {row['bytes_x']:.3f}x bf16's bytes{extra}  Δppl {q.delta_ppl_pct:+.3f}% "
                      f"± {q.delta_ppl_se_pct:.3f}  KL {q.mean_kl:.5f}  top-1 {q.top1_agreement:.4f}", flush=True)
    report = {"cpu": cpu_name(), "windows": args.windows, "seqlen": args.seqlen, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"CPU: {report['cpu']}; {args.windows} x {args.seqlen} tokens of WikiText-2 test, float32")


if __name__ == "__main__":
    main()
