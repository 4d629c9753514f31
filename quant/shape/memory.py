"""Memory: the one model every part of the project uses (W weights, A activations, KV cache; for
training also G gradients and O optimizer states), and a tracker that measures tensor memory.

Inference prefill activation peak, for a Llama-family decoder as transformers executes it
(b batch, s tokens, H hidden, I intermediate, h / kv heads of size d, V vocab):
- held across the whole forward: the embeddings output and the current layer's input, 2·b·s·H;
- MLP phase: the residual and the normed input (2·b·s·H) plus act(gate), up and their product
  (3·b·s·I), live together when the product is formed;
- attention phase: normed input b·s·H, q/k/v b·s·(h+2kv)·d, rotary outputs and temporaries
  2·b·s·(h+kv)·d, the attention output b·s·h·d; with eager attention also the repeated K/V
  (2·b·s·h·d), the mask b·s² and the scores: quadratic, 8·b·h·s² bytes because the softmax runs in
  fp32 while its input is still alive (for 16-bit: input, fp32 output and the cast back).
  SDPA / FlashAttention never materialise the scores: linear in s;
- the rotary tables 2·s·d and the logits b·keep·V (keep = 1 when only the next token is needed).
Measured peaks (``quant.runtime.measure.MemoryTracker``) hold this to measured peaks (MemoryTracker) within 15%.
"""

from __future__ import annotations

import re

from quant.shape import kv_formats
from quant.shape.model import ModelShape

ATTN_IMPLS = ("eager", "sdpa", "flash_attention_2")


def dtype_bytes(dtype) -> int:
    """Bytes of one element of a torch dtype."""
    return dtype.itemsize


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {text!r} (try 24GiB, 80GB)")
    unit = (m.group(2) or "B").lower()
    mult = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
            "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def kv_bytes_per_token(config_or_shape, dtype) -> int:
    """2 (K and V) · layers · kv_heads · head_dim · bytes(dtype); ``dtype`` may name a KV cache format too ("int8":
    layers · kv_heads · its bytes per token of one head, scales included: quant.shape.kv_formats)."""
    s = config_or_shape if isinstance(config_or_shape, ModelShape) else ModelShape.from_config(config_or_shape)
    if isinstance(dtype, str) and dtype in kv_formats.FORMATS:
        return s.layers * s.kv_heads * kv_formats.token_bytes(dtype, s.head_dim)
    b = dtype if isinstance(dtype, int) else dtype_bytes(dtype)
    return 2 * s.layers * s.kv_heads * s.head_dim * b


def prefill_activation_bytes(shape: ModelShape, batch: int, seq: int, attn: str, dtype_bytes_: int,
                             logits_kept: int = 1) -> int:
    """Peak activation bytes of one inference forward over `batch` x `seq` tokens (module docstring)."""
    if attn not in ATTN_IMPLS:
        raise ValueError(f"unknown attention implementation {attn!r}")
    b, s, H, I = batch, seq, shape.hidden, shape.intermediate
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    held = 2 * b * s * H
    mlp = 2 * b * s * H + 3 * b * s * I
    base = b * s * H + b * s * (h + 2 * kv) * d  # normed input, q/k/v
    att = max(base + 2 * b * s * (h + kv) * d, base + b * s * h * d) * dtype_bytes_  # rotary; output
    if attn == "eager":
        # At the cast after the fp32 softmax three copies of the scores are alive: the masked input
        # (dtype), the softmax output (fp32) and the cast (dtype); for fp32 the cast is a no-op.
        per_score = dtype_bytes_ + 4 + (dtype_bytes_ if dtype_bytes_ != 4 else 0)
        eager = (base + 2 * b * s * h * d + b * s * s) * dtype_bytes_ + b * h * s * s * per_score
        att = max(att, eager)
    peak = held * dtype_bytes_ + max(mlp * dtype_bytes_, att)
    return peak + 2 * s * d * dtype_bytes_ + batch * logits_kept * shape.vocab * dtype_bytes_


DECODE_ATTENTION_PARTS = 4  # server/csrc/attention_ops.cpp's kParts


def decode_attention_scratch(shape: ModelShape, rows: int) -> int:
    """fp32 bytes the CPU decode attention kernel (server/csrc/attention_ops.cpp) keeps for a step of ``rows``
    decode rows beside what :func:`engine_prefill_bytes` counts: each KV head of a row longer than one span of keys
    cut into at most DECODE_ATTENTION_PARTS parts, each (g·d + 2g) floats (g query heads a KV head) until merged."""
    g = shape.heads // shape.kv_heads
    return rows * shape.kv_heads * DECODE_ATTENTION_PARTS * (g * shape.head_dim + 2 * g) * 4


def engine_prefill_bytes(shape: ModelShape, tokens: int, dtype_bytes_: int, glue: str = "fused", past: int = 0,
                         sampled: int = 1, transients: dict | None = None) -> int:
    """Peak activation bytes of one step of the serving engine's model (server/models/base.py) over ``tokens``
    new tokens (after ``past`` cached ones), ``sampled`` of which get logits. The engine runs its own model
    definitions, not transformers' forward, so it has its own model, phase by phase (T tokens, b bytes per
    element):

    - alive throughout: the rotary tables 2·T·d; the residual x, the sub-layer input h and the previous
      sub-layer's output (the residual add is folded into the next norm): X = 3·T·H; eager glue only, for a
      chunk after cached tokens: the attention backend's bool mask T·(past+T), built once per step;
    - attention: q/k/v T·(h+2kv)·d, rotated in place (the eager rotary keeps ~3·T·h·d of temporaries), alive
      until o_proj has run; the attention output and its copy into the step's output (2·T·h·d), and with eager
      glue SDPA's fp32 log-sum-exp T·h·4 (the fused prefill kernel's fp32 tiles, ~110 KiB per thread whatever
      T, are not counted); the o projection's output T·H, then the next norm's two outputs (2·T·H) while the
      old ones live;
    - MLP: gate|up T·2I and silu(gate)·up T·I (fused glue; the eager ops also keep silu(gate), T·I more);
      then the down projection's output T·H;
    - eager glue only: the RMSNorm's fp32 copies (2·T·H·4);
    - the end: x and the pending output for the sampled rows, the logits S·V in the dtype and in fp32.
    ``transients``: bytes a projection allocates while it runs (a weight-only layer dequantizing its
    weight above its kernel's row limit), by role: qkv, o, gate_up, down. bench/engine_memory.py holds
    this to the engine's measured peak.
    """
    if glue not in ("fused", "eager"):
        raise ValueError(f"glue must be 'fused' or 'eager', got {glue!r}")
    tr = {"qkv": 0, "o": 0, "gate_up": 0, "down": 0, **(transients or {})}
    b, T, S = dtype_bytes_, tokens, sampled
    H, I, h, kv, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    eager = glue == "eager"
    base = 2 * T * d * b + 3 * T * H * b + (T * (past + T) if past and eager else 0)
    qkv = T * (h + 2 * kv) * d * b
    rope = qkv + (3 * T * h * d * b if eager else 0)
    attend = qkv + 2 * T * h * d * b + (4 * T * h if eager else 0)
    norm = 3 * T * H * b + (2 * 4 * T * H if eager else 0)
    phases = [
        qkv + tr["qkv"], rope, attend,
        qkv + T * h * d * b + T * H * b + tr["o"],  # q/k/v and the attention output bound while o_proj runs
        norm,
        2 * T * I * b + tr["gate_up"],
        (4 if eager else 3) * T * I * b,
        T * I * b + T * H * b + tr["down"],
    ]
    logits = S * shape.vocab * (b + (4 if b != 4 else 0))  # in the dtype, then the fp32 copy (none for fp32)
    end = 2 * T * H * b + 2 * S * H * b + logits - 3 * T * H * b  # x and delta stay, the last h is gone
    return base + max(max(phases), end)
