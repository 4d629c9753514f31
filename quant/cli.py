"""`quant`: build, eval, inspect and verify artifacts; `quant serve` and `quant kernels` are handed to the server
(server/cli.py, server/native_build.py).

Errors in the input (`QuantError`) print one line and exit 1; argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quant.build import schemes
from quant.build.config import (
    CALIB_METHODS,
    DTYPES,
    EVAL_DTYPES,
    BuildConfig,
    CalibConfig,
    EvalConfig,
)
from quant.errors import ConfigError, QuantError

EVAL_DTYPE_HELP = (f"{', '.join(EVAL_DTYPES)}: float64 (default) is the reference arithmetic, the same figures on "
                   "every CPU; the others run this CPU's serving kernels (Δppl moves by about 0.1 point between CPUs)")

# Commands that belong to a higher layer: `quant` lists them and hands them their arguments, importing the owner
# only when one runs, so the pipeline never depends on it. `quant serve` is the server's (server/cli.py).
DELEGATED = {"serve": ("server.cli", "serve an artifact (or a plain model) over gRPC and HTTP"),
             "kernels": ("server.native_build", "build this CPU's C++ kernels now (else at their first use)")}
PLAN_OWNER = "server.capacity"  # `quant estimate --requests`: what an idle server would plan (its own code)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quant", description="quantserve offline pipeline")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="quantize a model into an artifact dir")
    b.add_argument("--scheme", required=True, help="; ".join(f"{s.name}: {s.summary}" for s in schemes.REGISTRY.values()))
    b.add_argument("--model", default=None, help="HF model dir, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    b.add_argument("--lora", default=None, help="PEFT LoRA adapter dir merged into the base before quantization")
    b.add_argument("--out", default=None, help="artifact dir (default: artifacts/<model>-<scheme>)")
    b.add_argument("--force", action="store_true", help="replace an existing artifact dir")
    b.add_argument("--calib", default="self", help="calibration text/JSONL file, or 'self' for seeded model-generated text")
    b.add_argument("--calib-samples", type=int, default=128)
    b.add_argument("--calib-seqlen", type=int, default=512)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--calib-method", default="auto", help=f"w8a8 static thresholds: {', '.join(CALIB_METHODS)}")
    b.add_argument("--act-dynamic", action="store_true", help="w8a8: per-token dynamic activation scales")
    b.add_argument("--no-smooth", action="store_true", help="w8a8: disable SmoothQuant-style smoothing")
    b.add_argument("--smooth-alpha", type=float, default=None, help="w8a8: fixed alpha (default: searched per group)")
    b.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=BuildConfig.weight_gptq,
                   help="w8a8: int8 weights by GPTQ on the smoothed calibration inputs, else round to nearest "
                        "(default: on; --no-gptq rounds)")
    b.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=BuildConfig.rotate,
                   help="w8a8: rotate down_proj's input online by a block Hadamard transform (its weight stored "
                        "rotated), which spreads its outlier channels before the int8 rounding")
    b.add_argument("--include-lm-head", action="store_true", help="quantize lm_head too")
    b.add_argument("--group-size", type=int, default=None, help="4-bit: inputs per group (default 128, else 64, else 32)")
    b.add_argument("--asym", action="store_true", help="4-bit: asymmetric zero-points (gptq_v2 format)")
    b.add_argument("--damp", type=float, default=BuildConfig.damp, help="GPTQ: damping as a fraction of mean diag(H)")
    b.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=BuildConfig.act_order,
                   help="GPTQ: process columns by decreasing Hessian diagonal, with static groups (default: on)")
    b.add_argument("--clip-search", action=argparse.BooleanOptionalAction, default=BuildConfig.clip_search,
                   help="w4a16: search each group's range, shrinking it where that rounds the group closer")
    b.add_argument("--dtype", default="bfloat16", help=f"storage dtype of float tensors: {', '.join(DTYPES)}")
    b.add_argument("--device", default="auto", help="where calibration and GPTQ run: auto (cuda if available), cpu, cuda, cuda:N")
    b.add_argument("--matmul-dtype", default="auto",
                   help="dtype of the calibration pass's Linear products: auto (bfloat16 where this device multiplies "
                        "it clearly faster than fp32), float32, bfloat16; weights, Hessians and GPTQ stay fp32")
    b.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors shard (e.g. 5GB, 500MiB)")
    b.add_argument("--eval-data", default=None, help="text file: write a quality report into the manifest")
    b.add_argument("--eval-windows", type=int, default=EvalConfig.windows)
    b.add_argument("--eval-seqlen", type=int, default=EvalConfig.seqlen)
    b.add_argument("--eval-dtype", default=EvalConfig.dtype, help=EVAL_DTYPE_HELP)
    b.add_argument("--max-dppl", type=float, default=None, metavar="PCT",
                   help="quality gate: refuse to publish when perplexity on --eval-data rises more than PCT percent")
    b.add_argument("--max-kl", type=float, default=None, metavar="X",
                   help="quality gate: refuse to publish when the mean KL to the float model exceeds X")
    b.add_argument("--no-progress", action="store_true")

    e = sub.add_parser("eval", help="perplexity, KL and top-1 agreement against the base model")
    e.add_argument("artifact")
    e.add_argument("--data", default=None, help="text file (default: the build's eval data, if any)")
    e.add_argument("--windows", type=int, default=EvalConfig.windows)
    e.add_argument("--seqlen", type=int, default=EvalConfig.seqlen)
    e.add_argument("--dtype", default=EvalConfig.dtype, help=EVAL_DTYPE_HELP)
    e.add_argument("--kv-dtype", default=None, metavar="KV",
                   help="instead: the quality cost of this KV cache format or dtype (int8, int8-rotk, int8-plain, fp8, "
                        "int4, int4-kres, int4-chan, int4-token, bfloat16, float16) on top of the artifact's weights, "
                        "against the same weights with a full-precision cache")
    e.add_argument("--int4-activations", default=None, choices=("int8",),
                   help="instead: the quality cost of serving the artifact's int4 projections on int8 activations "
                        "(quant serve --int4-activations int8), against the same weights on float activations")
    e.add_argument("--json", action="store_true")
    e.add_argument("--no-progress", action="store_true")

    mg = sub.add_parser("merge", help="merge a PEFT LoRA adapter into its base: a plain HF model dir")
    mg.add_argument("--lora", required=True, help="adapter dir (adapter_config.json + adapter_model.safetensors)")
    mg.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    mg.add_argument("--out", required=True)
    mg.add_argument("--force", action="store_true")
    mg.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (default auto: the base's own)")

    es = sub.add_parser("estimate", help="memory plan: weights, KV cache, activations; training W/A/G/O; GPUs")
    es.add_argument("--model", default=None, help="model dir / .gguf / hub id whose config to use (default: embedded)")
    es.add_argument("--params", default=None, help="hub-style size instead of a model: 135M, 7B, 70B ...")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "head-dim", "vocab"):
        es.add_argument(f"--{name}", type=int, default=None, help="override the model shape")
    es.add_argument("--scheme", default="float", help=f"float, {', '.join(schemes.names())}")
    es.add_argument("--group-size", type=int, default=128)
    es.add_argument("--dtype", default="bfloat16", help="dtype of float weights, activations and the KV cache")
    es.add_argument("--batch", type=int, default=1)
    es.add_argument("--context", type=int, default=4096, help="tokens per sequence (prompt + generated)")
    es.add_argument("--attn", default="sdpa", help="eager, sdpa, flash_attention_2")
    es.add_argument("--train", action="store_true", help="estimate a training step instead of inference")
    es.add_argument("--precision", default="mixed", help="training: fp32 or mixed")
    es.add_argument("--optimizer-bits", type=int, default=32, help="training: Adam state bits (32, 8, 4)")
    es.add_argument("--lora-rank", type=int, default=0, help="training: LoRA rank on every block Linear (0: full)")
    es.add_argument("--checkpointing", action="store_true", help="training: activation checkpointing")
    es.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 24GiB")
    es.add_argument("--requests", default=None, metavar="PxN[xC[xS]][~E],...",
                    help="capacity plan instead: what an idle `quant serve` of --model would do with these request "
                         "shapes (prompt x max-new x count x samples, ~ the new tokens expected, e.g. "
                         "512x256x8,200x2048x8~300), as its Plan call answers")
    es.add_argument("--kv-admission", default=None, choices=("on-demand", "reserve"),
                    help="with --requests: the server's KV admission (default: quant serve's)")
    es.add_argument("--kv-dtype", default=None, choices=("auto", "bfloat16", "float16", "float32", "int8", "fp8"),
                    help="what the KV cache holds (default: quant serve's, auto: --dtype)")
    for name, what in (("memory-budget", "KV pool"), ("max-batch", "requests running at once"),
                       ("max-queue", "requests waiting"), ("max-prefill-tokens", "prompt tokens per step")):
        es.add_argument(f"--{name}", default=None, type=str if name == "memory-budget" else int,
                        help=f"with --requests: the server's {what} (default: quant serve's)")
    es.add_argument("--json", action="store_true")

    i = sub.add_parser("inspect", help="show an artifact's manifest")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true")

    v = sub.add_parser("verify", help="check every file's sha256 against the manifest")
    v.add_argument("artifact")

    for name, (_, summary) in DELEGATED.items():  # listed here, parsed by their owner (see main)
        sub.add_parser(name, help=summary, add_help=False)
    return p


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def quality_table(q: dict, title: str = "quality") -> Table:
    t = Table(title=title)
    for col in ("base ppl", "quant ppl", "Δppl %", "mean KL", "top-1 agree", "tokens"):
        t.add_column(col, justify="right")
    se = q.get("delta_ppl_se_pct")
    dppl = f"{q['delta_ppl_pct']:+.2f}" + ("" if se is None else f" ± {se:.2f}")
    t.add_row(
        f"{q['base_ppl']:.3f}", f"{q['ppl']:.3f}", dppl,
        f"{q['mean_kl']:.5f}", f"{100 * q['top1_agreement']:.2f}%", str(q["tokens"]),
    )
    if q.get("dtype"):
        t.caption = (f"{q['dtype']}: the reference arithmetic, the same on every CPU" if q["dtype"] == "float64" else
                     f"{q['dtype']}: this CPU's serving kernels (another CPU's differ by about 0.1 point of Δppl)")
        if se is not None:
            t.caption += "; ± the standard error over the windows (another text sample's spread)"
    return t


def summary(manifest: dict, path: Path) -> list:
    t = Table(title=f"artifact {path}", show_header=False)
    t.add_column("key")
    t.add_column("value")
    mem = manifest["memory"]
    w = mem["weights"]
    t.add_row("scheme", manifest["scheme"])
    t.add_row("source", f"{manifest['source_model']['spec']} ({manifest['source_model']['fingerprint'][:12]})")
    for k, v in manifest["parameters"].items():
        if v is not None and k != "runtime_kernels":
            t.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    for dtype, kernel in manifest["parameters"].get("runtime_kernels", {}).items():
        t.add_row(f"kernel ({dtype})", kernel)
    if manifest.get("calibration"):
        c = manifest["calibration"]
        t.add_row("calibration", f"{c['source']}: {c['windows']} x {c['seqlen']} tokens, seed {c.get('seed')}")
    t.add_row("weights", f"{_fmt_bytes(w['total'])} (int {_fmt_bytes(w['quantized_weights'])}, params "
              f"{_fmt_bytes(w['quant_params'])}, float {_fmt_bytes(w['float_weights'])})")
    t.add_row("base weights", f"{_fmt_bytes(mem['base_weight_bytes'])} ({mem['base_dtype']}), "
              f"compression {mem['compression_ratio']:.2f}x")
    t.add_row("KV per token", ", ".join(f"{k}: {v} B" for k, v in mem["kv_bytes_per_token"].items()))
    t.add_row("timings", ", ".join(f"{k} {v:.1f}" for k, v in manifest.get("timings", {}).items()))
    out = [t]
    if manifest.get("quality"):
        out.append(quality_table(manifest["quality"], f"quality ({manifest['quality']['dtype']}, "
                                 f"{manifest['quality']['data']['windows']} x {manifest['quality']['data']['seqlen']} tokens)"))
    return out


def _size_arg(flag: str, text: str) -> int:
    from quant.shape.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None


def _cmd_build(args, console: Console, cache_dir: Path) -> int:
    from quant.build.pipeline import build

    cfg = BuildConfig(
        scheme=args.scheme, model=args.model, lora=args.lora, out=args.out, force=args.force,
        calib=CalibConfig(source=args.calib, samples=args.calib_samples, seqlen=args.calib_seqlen, seed=args.seed),
        calib_method=args.calib_method, smooth=not args.no_smooth, smooth_alpha=args.smooth_alpha,
        act_dynamic=args.act_dynamic, weight_gptq=args.gptq, rotate=args.rotate, include_lm_head=args.include_lm_head, dtype=args.dtype,
        group_size=args.group_size, asym=args.asym, damp=args.damp, act_order=args.act_order,
        clip_search=args.clip_search,
        max_shard_bytes=_size_arg("--max-shard-size", args.max_shard_size), device=args.device,
        matmul_dtype=args.matmul_dtype,
        max_dppl=args.max_dppl, max_kl=args.max_kl,
        eval=EvalConfig(data=args.eval_data, windows=args.eval_windows, seqlen=args.eval_seqlen,
                        dtype=args.eval_dtype, flag="--eval-"),
    )
    out = build(cfg, cache_dir, progress=not args.no_progress, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    from quant.format.artifact import read_manifest

    for table in summary(read_manifest(out), out):
        console.print(table)
    console.print(f"artifact written to [bold]{out}[/bold]")
    return 0


def _cmd_eval(args, console: Console, cache_dir: Path) -> int:
    from quant.build import calibration, evaluate
    from quant.build.pipeline import (
        reference_model,
        resolve_eval_adapter,
        resolve_eval_source,
    )
    from quant.format import sources as models
    from quant.runtime import loader

    EvalConfig(data=args.data, windows=args.windows, seqlen=args.seqlen, dtype=args.dtype).validate()
    art = loader.load(args.artifact, dtype=models.torch_dtype(args.dtype))
    data = args.data or ((art.manifest.get("quality") or {}).get("data") or {}).get("source")
    if data is None:
        raise QuantError("--data is required: this artifact was built without --eval-data")
    windows = calibration.eval_windows(art.tokenizer, data, args.windows, args.seqlen)
    if args.kv_dtype is not None and args.int4_activations is not None:
        raise QuantError("--kv-dtype and --int4-activations each measure one choice against the artifact: give one")
    if args.int4_activations is not None:  # the same weights, their input quantized in blocks of 32 columns
        from quant.runtime.int4 import int4_modules

        candidate = loader.load(args.artifact, dtype=models.torch_dtype(args.dtype)).model
        try:
            mods = int4_modules(candidate)
        except ValueError as e:
            raise QuantError(str(e)) from None
        for m in mods:
            m.use_int8_activations()
        base, what = art.model, f"int4 projections on int8 activations against {args.dtype} ones"
    elif args.kv_dtype is not None:  # the same weights, attention reading K and V through the cache format
        try:
            view = evaluate.KVCacheView(art.model, args.kv_dtype)
        except ValueError as e:
            raise QuantError(f"--kv-dtype: {e}") from None
        base, candidate, what = art.model, view, f"KV cache {args.kv_dtype} against a {args.dtype} cache"
    else:
        source = resolve_eval_source(art.manifest, cache_dir)
        adapter = resolve_eval_adapter(art.manifest)
        base = reference_model(source, adapter, models.torch_dtype(args.dtype))
        candidate, what = art.model, "against the base model"
    q = evaluate.compare(base, {"quantized": candidate}, windows, progress=not args.no_progress)["quantized"]
    result = {**q.to_dict(), "dtype": args.dtype, "data": windows.describe(), "artifact": str(args.artifact),
              "kv_dtype": args.kv_dtype, "int4_activations": args.int4_activations}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        console.print(quality_table(result, f"{args.artifact}: {args.windows} x {args.seqlen} tokens of {data}, "
                                            f"{what}"))
    return 0


def _cmd_merge(args, console: Console, cache_dir: Path) -> int:
    from quant.build.pipeline import merge

    dtype = None if args.dtype == "auto" else args.dtype
    out = merge(args.model, args.lora, Path(args.out), args.force, cache_dir, dtype)
    console.print(f"merged model written to [bold]{out}[/bold]")
    return 0


def _cmd_estimate(args, console: Console, cache_dir: Path) -> int:
    from quant.build.estimate import estimate

    if args.requests is not None:  # the server's plan, computed offline: its code, imported when it runs
        return importlib.import_module(PLAN_OWNER).estimate_command(args, console, cache_dir)

    result = estimate(args, cache_dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    t = Table(title=f"{result['mode']} memory: {result['shape']['name']} "
                    f"({result['params'] / 1e9:.3g}B params), {result['setup']}")
    t.add_column("class")
    t.add_column("bytes", justify="right")
    t.add_column("", justify="right")
    for k, v in result["classes"].items():
        t.add_row(k, f"{v:,}", _fmt_bytes(v))
    t.add_row("total", f"{result['total']:,}", _fmt_bytes(result["total"]))
    console.print(t)
    console.print(f"GPUs of {_fmt_bytes(result['gpu_memory'])}: {result['gpus']} "
                  f"({'fits on one' if result['gpus'] == 1 else 'tensor parallelism across them'})")
    return 0


def _cmd_inspect(args, console: Console) -> int:
    from quant.format.artifact import read_manifest

    manifest = read_manifest(Path(args.artifact))
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        for table in summary(manifest, Path(args.artifact)):
            console.print(table)
    return 0


def _cmd_verify(args, console: Console) -> int:
    from quant.format.artifact import verify

    manifest = verify(Path(args.artifact))
    console.print(f"ok: {len(manifest['files'])} files match their sha256 in {args.artifact}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:])
    from quant.format.sources import default_cache_dir

    args = _build_parser().parse_args(argv)
    console = Console(stderr=False)
    try:
        if args.cmd == "build":
            return _cmd_build(args, console, default_cache_dir())
        if args.cmd == "eval":
            return _cmd_eval(args, console, default_cache_dir())
        if args.cmd == "merge":
            return _cmd_merge(args, console, default_cache_dir())
        if args.cmd == "estimate":
            return _cmd_estimate(args, console, default_cache_dir())
        if args.cmd == "inspect":
            return _cmd_inspect(args, console)
        return _cmd_verify(args, console)
    except QuantError as e:
        print(f"quant {args.cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
