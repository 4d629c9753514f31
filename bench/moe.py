"""MoE experts under every scheme: how much of the expert bytes each leaves float, and build time against the
expert count (tiny random-weight Mixtral and Qwen2-MoE; correctness and cost, not quality).

Each model: hidden 256, 2 layers, 4/2 heads, top-2 routing, the default model's tokenizer (49152-token vocab,
tied embeddings, bf16). Mixtral experts have MLP 512; Qwen2-MoE experts 256 plus a shared expert of 512. Each
build is `quant build --calib valid.txt --calib-samples 8 --calib-seqlen 64 --eval-data test.txt
--eval-windows 4 --eval-seqlen 64` in its own process. Expert bytes are read from the artifact's safetensors
(every tensor under `.experts.`); "experts bf16" is the source's expert weights in bf16. The time rows build
w4a16 (GPTQ) and w8a8 of Mixtral with 4, 8 and 16 experts: a MoE layer is calibrated in four stages (q/k/v, o,
every expert's gate/up, every down), so the time grows with the expert weights, not with a pass per expert.

    python bench/moe.py [--out bench/out/moe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "I32": 4, "U8": 1}


def make(kind: str, experts: int, out: Path, tok) -> Path:
    import transformers

    common = dict(vocab_size=len(tok), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.05,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=experts, num_experts_per_tok=2, intermediate_size=512,
                                         **common)
    else:
        cfg = transformers.Qwen2MoeConfig(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=256,
                                          shared_expert_intermediate_size=512, intermediate_size=512, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def expert_bytes(art: Path) -> tuple[int, int, int]:
    """(int, params, float) bytes of the tensors under `.experts.` of an artifact."""
    from safetensors import safe_open

    ints = params = floats = 0
    for f in sorted(art.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                if ".experts." not in k:
                    continue
                sl = s.get_slice(k)
                n = BYTES[sl.get_dtype()]
                for d in sl.get_shape():
                    n *= d
                if k.endswith((".qweight",)) or (k.endswith(".weight") and sl.get_dtype() == "I8"):
                    ints += n
                elif k.endswith(".weight"):
                    floats += n
                else:
                    params += n
    return ints, params, floats


def build(src: Path, art: Path, scheme: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", scheme, "--model", str(src), "--out", str(art),
           "--force", "--calib", str(DATA / "valid.txt"), "--calib-samples", "8", "--calib-seqlen", "64",
           "--eval-data", str(DATA / "test.txt"), "--eval-windows", "4", "--eval-seqlen", "64", "--no-progress"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t, json.loads((art / "quant_manifest.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "moe"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from quant.format import sources as models

    _, tok = models.load_model(models.resolve(None, models.default_cache_dir()))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    print("| model | scheme | expert tensors int / params / float (KiB) | experts bf16 (KiB) | expert bytes ratio "
          "| float share | Δppl % | mean KL | streamed |\n|---|---|---|---|---|---|---|---|---|")
    for kind in ("mixtral", "qwen2_moe"):
        src = make(kind, 4, out / f"{kind}-4", tok)
        bf16 = expert_bytes(src)[2]
        for scheme in ("int8-sym", "w4a16", "w8a8"):
            _, m = build(src, out / f"{kind}-4-{scheme}", scheme)
            i, p, f = expert_bytes(out / f"{kind}-4-{scheme}")
            q = m["quality"]
            print(f"| tiny {kind} | {scheme} | {i / 1024:.0f} / {p / 1024:.1f} / {f / 1024:.0f} | {bf16 / 1024:.0f} | "
                  f"{bf16 / (i + p + f):.2f}x | {100 * f / max(i + f, 1):.1f}% | {q['delta_ppl_pct']:+.2f} | "
                  f"{q['mean_kl']:.4f} | {m['build']['streamed']} |", flush=True)
    print("\n| tiny mixtral experts | scheme | build process s | quantize s |\n|---|---|---|---|")
    for experts in (4, 8, 16):
        src = make("mixtral", experts, out / f"mixtral-{experts}", tok)
        for scheme in ("w4a16", "w8a8"):
            wall, m = build(src, out / f"mixtral-{experts}-{scheme}", scheme)
            print(f"| {experts} | {scheme} | {wall:.1f} | {m['timings']['quantize_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
