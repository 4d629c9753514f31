"""`quant estimate`: the memory model of quant/shape/memory.py as a planning tool.

Inference: W (weights of the scheme), KV (batch x context tokens of cache), A (prefill activation
peak for batch x context with the chosen attention). Training: W, A, G, O for a step with Adam, in
full fp32 or mixed precision, with 32/8/4-bit optimizer states, LoRA and activation checkpointing.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from quant.build import schemes
from quant.build.memory import TrainSetup, training_bytes, weight_bytes
from quant.errors import ConfigError
from quant.shape.memory import ATTN_IMPLS, kv_bytes_per_token, parse_bytes, prefill_activation_bytes
from quant.shape.model import ModelShape, parse_size, shape_for_params

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _shape(args, cache_dir: Path) -> ModelShape:
    if args.params is not None and args.model is not None:
        raise ConfigError("give --model or --params, not both")
    if args.params is not None:
        try:
            shape = shape_for_params(parse_size(args.params))
        except ValueError as e:
            raise ConfigError(f"--params: {e}") from e
    else:
        from transformers import AutoConfig

        from quant.format import sources as models

        source = models.resolve(args.model, cache_dir)
        shape = ModelShape.from_config(AutoConfig.from_pretrained(source.path))
        shape = replace(shape, name=source.spec)
    overrides = {
        "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "vocab": args.vocab,
    }
    for name, value in overrides.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    changed = {k: v for k, v in overrides.items() if v is not None}
    if changed:
        shape = replace(shape, **changed, name=f"{shape.name} (modified)")
    return shape


def estimate(args, cache_dir: Path) -> dict:
    if args.scheme != "float":
        schemes.get(args.scheme)  # refuses an unknown name
    if args.dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {args.dtype!r}")
    if args.attn not in ATTN_IMPLS:
        raise ConfigError(f"--attn must be one of {', '.join(ATTN_IMPLS)}, got {args.attn!r}")
    for name in ("batch", "context"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.group_size not in (32, 64, 128, 256):
        raise ConfigError(f"--group-size must be one of 32, 64, 128, 256, got {args.group_size}")
    try:
        gpu = parse_bytes(args.gpu_memory)
    except ValueError as e:
        raise ConfigError(f"--gpu-memory: {e}") from e
    if gpu <= 0:
        raise ConfigError(f"--gpu-memory must be positive, got {args.gpu_memory}")
    shape = _shape(args, cache_dir)
    nbytes = DTYPE_BYTES[args.dtype]
    if args.train:
        if args.precision not in ("fp32", "mixed"):
            raise ConfigError(f"--precision must be fp32 or mixed, got {args.precision!r}")
        if args.optimizer_bits not in (32, 8, 4):
            raise ConfigError(f"--optimizer-bits must be 32, 8 or 4, got {args.optimizer_bits}")
        if args.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0, got {args.lora_rank}")
        if args.scheme != "float" and args.lora_rank == 0:
            raise ConfigError("a quantized --scheme can only be trained through LoRA adapters (--lora-rank)")
        setup = TrainSetup(args.precision, args.optimizer_bits, args.lora_rank, args.scheme, args.checkpointing)
        t = training_bytes(shape, setup, args.batch, args.context, args.attn)
        classes = {k: t[k] for k in ("W", "A", "G", "O")}
        desc = (f"train batch {args.batch} x {args.context}, {args.precision}, Adam {args.optimizer_bits}-bit"
                f"{f', LoRA r={args.lora_rank} on {args.scheme}' if args.lora_rank else ''}"
                f"{', checkpointing' if args.checkpointing else ''}, {args.attn}")
        extra = {"trainable_params": t["trainable_params"]}
    else:
        w = weight_bytes(shape, args.scheme, float_bytes=nbytes, group_size=args.group_size, served=True)
        kv = nbytes if getattr(args, "kv_dtype", None) in (None, "auto") else args.kv_dtype
        classes = {
            "W": w["total"],
            "KV": args.batch * args.context * kv_bytes_per_token(shape, kv),
            "A": prefill_activation_bytes(shape, args.batch, args.context, args.attn, nbytes),
        }
        desc = (f"{args.scheme}, batch {args.batch} x {args.context} tokens, {args.dtype}"
                f"{'' if kv == nbytes else f', KV {kv}'}, {args.attn}")
        extra = {"weights_by_class": w, "kv_bytes_per_token": kv_bytes_per_token(shape, kv)}
    total = sum(classes.values())
    return {
        "mode": "training" if args.train else "inference",
        "setup": desc,
        "shape": shape.to_dict(),
        "params": shape.params(),
        "classes": classes,
        "total": total,
        "gpu_memory": gpu,
        "gpus": max(1, math.ceil(total / gpu)),
        **extra,
    }
