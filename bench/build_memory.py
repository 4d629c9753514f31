"""Peak memory of a layer-streamed build as the model grows: Llama-3-8B-shaped layers, 2 vs 4 of them.

Each model is written once under --out (random bf16 weights, hidden 4096, MLP 14336, 32 query / 8 KV
heads, the default model's tokenizer and vocabulary, untied head), then built by its own `quant build`
process one after the other (16 x 256 WikiText-2 calibration tokens, seed 0). Peak RSS, the build's own
estimate and the per-layer seconds come from the artifact's manifest.

The limit: going from 2 to 4 layers grows the peak by at most half of those two layers' bf16 bytes (a streamed
build's peak does not grow with the model's depth).

On a GPU (``--device cuda``) the build's time and the CUDA allocator's peak (the manifest's
``build_peak_device_allocated_bytes``) are reported too. ``--tokenizer word`` gives the model a word-level
tokenizer of Llama-3's vocabulary (128256) instead of the default model's (whose GGUF a GPU machine may not have)
and calibrates on random words of it (the weights are random: only the shapes matter to time and memory).

    python bench/build_memory.py [--scheme w4a16] [--layers 2,4] [--device cpu|cuda] [--tokenizer default|word]
                                 [--calib FILE] [--out bench/out/build_memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)


LLAMA3_VOCAB = 128256


def random_words(path: Path, vocab: int, words: int = 200_000, seed: int = 0) -> Path:
    """Calibration text of random words of the word tokenizer, one paragraph per 500 words."""
    if not path.is_file():
        ids = torch.randint(3, vocab, (words,), generator=torch.Generator().manual_seed(seed)).tolist()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(" ".join(f"t{i}" for i in ids[a: a + 500]) for a in range(0, words, 500)))
    return path


def make_model(path: Path, layers: int, seed: int = 0, tokenizer: str = "default") -> Path:
    """An 8B-shaped Llama with `layers` layers of random bf16 weights, written a tensor at a time."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quant.format.shards import ShardWriter, header_reserve

    if (path / "config.json").is_file():
        return path
    if tokenizer == "word":
        from common import word_tokenizer  # token i is the word 't<i>'

        tok = word_tokenizer(LLAMA3_VOCAB)
    else:
        from transformers import AutoTokenizer

        from quant.format.sources import default_gguf_path

        gguf = default_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tok), num_hidden_layers=layers, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, dtype="bfloat16", **SHAPE)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    state = skeleton.state_dict()
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    writer = ShardWriter(path, 2 * 2**30, header_reserve(state, per_name=1))
    for name, meta in state.items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.rand(meta.shape, generator=g)
        else:
            t = torch.randn(meta.shape, generator=g) * (1.0 / meta.shape[-1] ** 0.5)
        writer.add(name, t.to(torch.bfloat16))
    writer.finish()
    config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build(model: Path, out: Path, scheme: str, samples: int, seqlen: int, calib: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", scheme, "--model", str(model), "--out", str(out),
           "--force", "--calib", str(calib), "--calib-samples", str(samples), "--device", device,
           "--calib-seqlen", str(seqlen), "--seed", "0", "--no-progress"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - t
    m = json.loads((out / "quant_manifest.json").read_text())
    return {"wall_s": wall, "peak_rss_bytes": m["memory"]["build_peak_rss_bytes"],
            "peak_device_allocated_bytes": m["memory"].get("build_peak_device_allocated_bytes"),
            "estimate": m["memory"]["build_peak_estimate_bytes"], "layer_seconds": m["build"]["layer_seconds"],
            "streamed": m["build"]["streamed"], "timings": m["timings"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "build_memory"))
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="where calibration and GPTQ run (quant build --device)")
    ap.add_argument("--tokenizer", choices=["default", "word"], default="default")
    ap.add_argument("--calib", type=Path, default=None, help="calibration text (default: WikiText-2 valid, or random "
                                                                 "words with --tokenizer word)")
    args = ap.parse_args()
    out = Path(args.out)
    counts = [int(x) for x in args.layers.split(",")]
    calib = args.calib or (random_words(out / "random_words.txt", LLAMA3_VOCAB) if args.tokenizer == "word"
                           else DATA / "valid.txt")
    tag = "" if args.tokenizer == "default" else f"-{args.tokenizer}"
    rows = {}
    for n in counts:
        model = make_model(out / f"llama8b-shaped-{n}L{tag}", n, tokenizer=args.tokenizer)
        rows[n] = build(model, out / f"llama8b-shaped-{n}L{tag}-{args.scheme}-{args.device.replace(':', '')}",
                        args.scheme, args.samples, args.seqlen, calib, args.device)
        r = rows[n]
        dev = r["peak_device_allocated_bytes"]
        print(f"{n} layers on {args.device}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (estimated "
              f"{r['estimate']['total'] / 2**30:.2f})" + ("" if dev is None else f", peak allocated on the device "
                                                              f"{dev / 2**30:.2f} GiB")
              + f", layers {', '.join(f'{s:.1f}' for s in r['layer_seconds'])} s, wall {r['wall_s']:.0f} s, "
              f"quantize {r['timings'].get('quantize_s', 0):.0f} s", flush=True)
    layer_bf16 = sum(n * k for n, k in [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
                                        (14336, 4096), (14336, 4096), (4096, 14336)]) * 2 + 2 * 4096 * 2
    summary = {"scheme": args.scheme, "calibration": f"{args.samples} x {args.seqlen}", "device": args.device,
               "tokenizer": args.tokenizer, "rows": rows,
               "layer_bf16_bytes": layer_bf16}
    if len(counts) == 2:
        a, b = counts
        growth = rows[b]["peak_rss_bytes"] - rows[a]["peak_rss_bytes"]
        limit = (b - a) * layer_bf16 / 2
        all_s = sorted(s for n in counts for s in rows[n]["layer_seconds"])
        per_layer = all_s[len(all_s) // 2]
        summary.update(growth_bytes=growth, limit_bytes=limit, median_layer_s=per_layer,
                       extrapolated_32_layers_min=32 * per_layer / 60)
        print(f"peak growth {a} -> {b} layers: {growth / 2**30:.3f} GiB (limit {limit / 2**30:.3f} GiB: "
              f"{'within' if growth <= limit else 'PAST IT'}); median layer {per_layer:.0f} s, "
              f"32 layers ~ {32 * per_layer / 60:.1f} min")
    (out / f"build_memory-{args.scheme}-{args.device.replace(':', '')}{tag}.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
