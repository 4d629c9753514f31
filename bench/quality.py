"""Quality, memory, build time and batch-1 latency of every INT8 scheme on the default model.

Reproduce (about 90 minutes on 2 cores; every figure in one run):
    python bench/quality.py --out bench/out/quality
Calibration: WikiText-2 valid, 128 x 512 tokens, seed 0. Evaluation: WikiText-2 test, 40 windows of
512 tokens spread evenly over the file. Every quantized model is compared with the float base on the same
windows in one pass, in float64 (`quant eval`'s reference arithmetic: the same figures on every CPU); the bf16
base and the bitsandbytes rows (LLM.int8 and NF4, CPU backend: what a user would otherwise pick) compute in
their own dtypes, so theirs are this CPU's. Δppl's ± is its standard error over the windows. Latency: batch-1
decode, 32-token prompt then 64 steps, bf16 activations, median ms per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

CONFIGS = {
    "int8-sym": ["--scheme", "int8-sym"],
    "int8-affine": ["--scheme", "int8-affine"],
    "w8a8-auto": ["--scheme", "w8a8", "--calib-method", "auto"],
    "w8a8-minmax": ["--scheme", "w8a8", "--calib-method", "minmax"],
    "w8a8-percentile": ["--scheme", "w8a8", "--calib-method", "percentile"],
    "w8a8-kl": ["--scheme", "w8a8", "--calib-method", "kl"],
    "w8a8-dynamic": ["--scheme", "w8a8", "--act-dynamic"],
    "w8a8-auto-rtn": ["--scheme", "w8a8", "--calib-method", "auto", "--no-gptq"],  # what GPTQ's weights buy
    "w8a8-dynamic-rtn": ["--scheme", "w8a8", "--act-dynamic", "--no-gptq"],
    "w8a8-auto-norot": ["--scheme", "w8a8", "--calib-method", "auto", "--no-rotate"],  # what down_proj's rotation buys
    "w8a8-dynamic-norot": ["--scheme", "w8a8", "--act-dynamic", "--no-rotate"],
    "w8a8-dynamic-a0.5": ["--scheme", "w8a8", "--act-dynamic", "--smooth-alpha", "0.5"],
    "w8a8-auto-nosmooth": ["--scheme", "w8a8", "--calib-method", "auto", "--no-smooth"],
    "w8a8-minmax-nosmooth": ["--scheme", "w8a8", "--calib-method", "minmax", "--no-smooth"],
    "w8a8-percentile-nosmooth": ["--scheme", "w8a8", "--calib-method", "percentile", "--no-smooth"],
    "w8a8-kl-nosmooth": ["--scheme", "w8a8", "--calib-method", "kl", "--no-smooth"],
    "w8a8-dynamic-nosmooth": ["--scheme", "w8a8", "--act-dynamic", "--no-smooth"],
    "rtn-w4": ["--scheme", "rtn-w4"],
    "w4a16": ["--scheme", "w4a16"],
    "w4a16-noclip": ["--scheme", "w4a16", "--no-clip-search"],  # what the groups' range search buys
}


def build_all(names, out: Path, samples: int, seqlen: int, reuse: bool) -> dict:
    results = {}
    for name in names:
        target = out / name
        if reuse and (target / "quant_manifest.json").exists():
            print(f"[build] {name}: reusing {target}", flush=True)
        else:
            cmd = [sys.executable, "-m", "quant.cli", "build", *CONFIGS[name], "--out", str(target), "--force",
                   "--calib", str(DATA / "valid.txt"), "--calib-samples", str(samples),
                   "--calib-seqlen", str(seqlen), "--seed", "0", "--no-progress"]
            t = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"[build] {name}: {time.perf_counter() - t:.1f} s", flush=True)
        manifest = json.loads((target / "quant_manifest.json").read_text())
        t = manifest["timings"]
        results[name] = {
            "build_s": t["total_s"],
            "quantize_s": t["quantize_s"],
            "weight_bytes": manifest["memory"]["weights"]["total"],
            "summary": manifest["parameters"].get("calibration_summary"),
        }
    return results


def load_bnb(path: str, kind: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = (BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else
         BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    m = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu", dtype=torch.bfloat16)
    return m.eval()


@torch.inference_mode()
def decode_latency(model, steps: int = 64, prompt: int = 32, repeats: int = 3) -> float:
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (1, prompt), generator=torch.Generator().manual_seed(0))
    per_token = []
    for _ in range(repeats):
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        per_token.append((time.perf_counter() - t) / steps * 1000)
    return statistics.median(per_token)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--reuse", action="store_true", help="reuse artifacts already built in --out")
    ap.add_argument("--no-bnb", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.configs.split(",") if n]

    from quant import load
    from quant.build import calibration, evaluate
    from quant.format import sources as models
    from quant.runtime import measure

    builds = build_all(names, out, args.calib_samples, args.calib_seqlen, args.reuse)

    src = models.resolve(None, models.default_cache_dir())
    base64, tok = models.load_model(src, torch.float64)
    base16, _ = models.load_model(src, torch.bfloat16)
    windows = calibration.eval_windows(tok, DATA / "test.txt", args.windows, args.seqlen)
    cands = {"bf16 base": base16}
    for n in names:
        cands[n] = load(out / n, dtype=torch.float64).model
    if not args.no_bnb:
        cands["bnb LLM.int8"] = load_bnb(src.path, "int8")
        cands["bnb NF4"] = load_bnb(src.path, "nf4")
    t = time.perf_counter()
    quality = evaluate.compare(base64, cands, windows)
    print(f"[eval] {len(cands)} candidates, {time.perf_counter() - t:.0f} s", flush=True)

    # Latency with bf16 activations (the serving dtype on CPU): reload quantized models in bf16.
    base32 = base64.float()
    lat = {"fp32 base": decode_latency(base32), "bf16 base": decode_latency(base16)}
    for n in names:
        lat[n] = decode_latency(load(out / n, dtype=torch.bfloat16).model)
    if not args.no_bnb:
        lat["bnb LLM.int8"] = decode_latency(cands["bnb LLM.int8"])
        lat["bnb NF4"] = decode_latency(cands["bnb NF4"])

    rows = []
    base_ppl = next(iter(quality.values())).base_ppl
    rows.append({"name": "fp32 base", "ppl": base_ppl, "delta_ppl_pct": 0.0, "se": None, "mean_kl": 0.0, "top1": 1.0,
                 "weight_bytes": measure.float_model_bytes(base32), "build_s": None, "ms_per_token": lat["fp32 base"]})
    for name, q in quality.items():
        if name in builds:
            wbytes, build_s = builds[name]["weight_bytes"], builds[name]["build_s"]
        elif name == "bf16 base":
            wbytes, build_s = measure.float_model_bytes(base16), None
        else:
            wbytes, build_s = cands[name].get_memory_footprint(), None
        rows.append({"name": name, "ppl": q.ppl, "delta_ppl_pct": q.delta_ppl_pct, "se": q.delta_ppl_se_pct,
                     "mean_kl": q.mean_kl,
                     "top1": q.top1_agreement, "weight_bytes": wbytes, "build_s": build_s,
                     "ms_per_token": lat[name],
                     "calibration": builds.get(name, {}).get("summary")})
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "calibration": f"wikitext-2 valid, {args.calib_samples} x {args.calib_seqlen}, seed 0",
        "evaluation": windows.describe(),
        "rows": rows,
    }
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    bf16_ms = lat["bf16 base"]
    print(f"\nevaluation: {windows.ids.shape[0]} x {windows.ids.shape[1]} tokens of WikiText-2 test; "
          f"float64 base ppl {base_ppl:.3f}; {result['machine']}")
    print("| model | ppl | Δppl % | ± se | mean KL | top-1 | weight MiB | build s | decode ms/tok | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = "" if r["build_s"] is None else f"{r['build_s']:.0f}"
        se = "" if r["se"] is None else f"{r['se']:.2f}"
        print(f"| {r['name']} | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f} | {se} | {r['mean_kl']:.4f} | "
              f"{100 * r['top1']:.1f}% | {r['weight_bytes'] / 2**20:.1f} | {b} | {r['ms_per_token']:.1f} | "
              f"{bf16_ms / r['ms_per_token']:.2f}x |")


if __name__ == "__main__":
    main()
