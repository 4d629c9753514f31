"""Fused CPU ops for the engine's per-layer glue, and the plain PyTorch reference of each.

A batch-1 decode step of the default model runs ~40 small tensor ops per layer around the four matmuls; on
CPU each costs a few microseconds of dispatch however small it is, which added up to a third of the step
(bench/RESULTS.md#cpu-decode-step-benchdecode_steppy). ``server/csrc/decode_ops.cpp`` does the same arithmetic in a few calls per
layer: the residual add with the next RMSNorm, rotary embedding in place (partial rotary included), the K/V
cache write of the sdpa backend, and the gated activations (SiLU·up, GELU-tanh·up).

The C++ source is compiled on first use (``quant.runtime.kernels.native``: needs a C++ compiler; ~15 s, cached under torch's
extensions dir). Where it cannot be built, :func:`load` says why and the runner uses the references below,
which are the eager ops it replaces; tests hold the two to each other. ``server/csrc/attention_ops.cpp``, in the
same library, has the sdpa backend's attention over the paged cache in place: decode rows, and prefill chunks
(flash-style, key tiles with an online softmax); their references are the fp32 masked softmaxes beside them (the
sdpa backend's own SDPA path remains the unfused one). ``server/csrc/sampling_ops.cpp`` has the sampler's uniforms
(server/random_stream.py is their reference).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from quant.runtime import kv_quant
from quant.runtime.kernels.native import Extension
from quant.shape.kv_formats import FORMATS
from server import kv_int4
from server.batch import StepInt
from server.random_stream import random_uniform as ref_random_uniform

_CSRC = Path(__file__).with_name("csrc")
EXTENSION = Extension([_CSRC / "decode_ops.cpp", _CSRC / "attention_ops.cpp", _CSRC / "kv_cache_ops.cpp",
                  _CSRC / "kv_int4_ops.cpp", _CSRC / "sampling_ops.cpp", _CSRC / "graph_ops.cpp"],
                 "quantserve_decode_ops")
load = EXTENSION.load  # compile (once per machine) and register torch.ops.quantserve; False where that fails
unavailable_reason = EXTENSION.unavailable_reason
build_directory = EXTENSION.build_directory


# ---------------------------------------------------------------------------------------- references

def ref_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: normalise in fp32, cast back, then the weight."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def ref_add_rms_norm(x: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = x + delta
    return x, ref_rms_norm(x, w, eps)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """In place: q (T, H, D), k (T, Hkv, D), cos/sin (T, R), R <= D: rotate the first R dims of every head
    (HF's rotate-half convention; R < D is partial rotary) and leave the rest."""
    R = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]  # (T, 1, R)
    for x in (q, k):
        r = x[..., :R]
        r.copy_(r * c + rotate_half(r) * s)


def ref_store_kv(k: Tensor, v: Tensor, kv: Tensor, slots: Tensor) -> None:
    """k, v (T, Hkv, D) into their slots of one layer's cache kv (2, slots, Hkv, D)."""
    kv[0].index_copy_(0, slots, k)
    kv[1].index_copy_(0, slots, v)


def ref_store_kv_quant(k: Tensor, v: Tensor, codes: Tensor, scales: Tensor, slots: Tensor, key_block: int,
                       value_block: int) -> None:
    """k, v (T, Hkv, D) quantized into their slots of one layer's quantized cache: codes (2, slots, Hkv, D) (int8
    or float8_e4m3fn), scales (2, slots, Hkv) float16 (quant.runtime.kv_quant.quantize); key_block (value_block)
    > 0: the keys (values) rotated first (kv_quant.rotate)."""
    fmt = FORMATS["fp8" if codes.dtype == torch.float8_e4m3fn else "int8-plain"]
    for i, x in enumerate((kv_quant.rotate(k, key_block), kv_quant.rotate(v, value_block))):
        c, s = kv_quant.quantize(fmt, x)
        codes[i].view(torch.uint8).index_copy_(0, slots, c.view(torch.uint8))  # (no index_copy_ of float8)
        scales[i].index_copy_(0, slots, s)


def ref_silu_mul(gate_up: Tensor) -> Tensor:
    g, u = gate_up.chunk(2, dim=-1)  # (T, I) each
    return F.silu(g) * u


def ref_gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    g, u = gate_up.chunk(2, dim=-1)  # (T, I) each
    return F.gelu(g, approximate="tanh") * u


def ref_decode_attention(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, block_size: int, window: int,
                         scale: float, softcap: float) -> Tensor:
    """Decode rows' attention over one layer's paged cache, row by row in fp32: q (B, H, D), kv (2, slots, Hkv, D),
    block_table (B, blocks), lens (B,): row b attends to its keys at positions [max(0, len - window), len)
    (window <= 0: all), scores soft-capped when softcap > 0; the output rounded once to q's dtype."""
    B, H, D = q.shape
    Hkv = kv.shape[2]
    out = q.new_empty(B, H, D)
    for b in range(B):
        L = int(lens[b])
        pos = torch.arange(max(0, L - window) if window > 0 else 0, L)
        slots = block_table[b, pos // block_size] * block_size + pos % block_size
        k = kv[0, slots].float().repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        v = kv[1, slots].float().repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # (H, n)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def ref_prefill_attention(q: Tensor, kv: Tensor, block_table: Tensor, start: int, block_size: int, window: int,
                          scale: float, softcap: float) -> Tensor:
    """A prefill chunk's attention over one layer's paged cache in fp32: q (C, H, D) at positions [start, start + C),
    kv (2, slots, Hkv, D), block_table (blocks,); query i attends to positions [max(0, start + i - window + 1),
    start + i] (window <= 0: from 0), scores soft-capped when softcap > 0; the output rounded once to q's dtype."""
    C, H, D = q.shape
    Hkv = kv.shape[2]
    pos = torch.arange(start + C)
    slots = block_table[pos // block_size] * block_size + pos % block_size
    k = kv[0, slots].float().repeat_interleave(H // Hkv, dim=1)  # (L, H, D)
    v = kv[1, slots].float().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("chd,lhd->hcl", q.float(), k) * scale  # (H, C, L)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(start, start + C)[:, None]  # (C, 1)
    seen = pos[None, :] <= qpos  # (C, L)
    if window > 0:
        seen &= pos[None, :] > qpos - window
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hcl,lhd->chd", p, v).to(q.dtype)


def ref_decode_attention_quant(q: Tensor, codes: Tensor, scales: Tensor, block_table: Tensor, lens: Tensor,
                               block_size: int, window: int, scale: float, softcap: float, key_block: int,
                               value_block: int) -> Tensor:
    """:func:`ref_decode_attention` over a quantized cache, its values code * scale in fp32; with key_block > 0 the
    keys are stored rotated and q is rotated to match, with value_block > 0 the values are and the fp32 output is
    rotated back."""
    out = ref_decode_attention(kv_quant.rotate(q.float(), key_block), kv_quant.dequantize(codes, scales),
                               block_table, lens, block_size, window, scale, softcap)
    return kv_quant.rotate(out, value_block).to(q.dtype)


def ref_prefill_attention_quant(q: Tensor, codes: Tensor, scales: Tensor, block_table: Tensor, start: int,
                                block_size: int, window: int, scale: float, softcap: float, key_block: int,
                                value_block: int) -> Tensor:
    """:func:`ref_prefill_attention` over a quantized cache, as :func:`ref_decode_attention_quant`."""
    out = ref_prefill_attention(kv_quant.rotate(q.float(), key_block), kv_quant.dequantize(codes, scales),
                                block_table, start, block_size, window, scale, softcap)
    return kv_quant.rotate(out, value_block).to(q.dtype)


def ref_rotary_decode_attention(qkv: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, scales: Tensor | None,
                                slots: Tensor, block_table: Tensor, lens: Tensor, heads: int, block_size: int,
                                window: int, scale: float, softcap: float, key_block: int, value_block: int) -> Tensor:
    """A decode step's attention of one layer from the fused qkv output (B, (H + 2 Hkv) D): the rotary on its q and
    k in place, k and v stored to their slots (quantized where ``scales`` is given), and the decode rows' attention:
    (B, H * D). The composition of the references above, which the one C++ call is held to."""
    B, (Hkv, D) = qkv.shape[0], kv.shape[2:]
    q, k, v = qkv.split([heads * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, heads, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    ref_rope_(q, k, cos, sin)
    if scales is None:
        ref_store_kv(k, v, kv, slots)
        out = ref_decode_attention(q, kv, block_table, lens, block_size, window, scale, softcap)
    else:
        ref_store_kv_quant(k, v, kv, scales, slots, key_block, value_block)
        out = ref_decode_attention_quant(q, kv, scales, block_table, lens, block_size, window, scale, softcap,
                                         key_block, value_block)
    return out.reshape(B, heads * D)


def fused_random_uniform(seeds: Tensor, steps: Tensor, ids: int | Tensor) -> Tensor:
    """``quantserve::random_uniform``: the bits of :func:`server.random_stream.random_uniform`, on CPU tensors."""
    if isinstance(ids, int):
        return torch.ops.quantserve.random_uniform(seeds, steps, None, ids)
    return torch.ops.quantserve.random_uniform(seeds, steps, ids, 0)


# The activation model's glue kind per Ops kind: the Triton kernels allocate what the fused CPU ones do.
MEMORY_KIND = {"fused": "fused", "triton": "fused", "eager": "eager"}


def kind_of(choice: str) -> str:
    """The Ops kind of a glue choice (server.runner.glue_ops_choice: "fused", "triton" or "eager (why)")."""
    return choice if choice in MEMORY_KIND else "eager"


def _start_as_tensor(op, op_at, i: int):
    """A prefill attention op taking the chunk's first position as its argument ``i`` (an int), that passes a
    ``server.batch.StepInt``'s tensor to the op's ``_at`` form instead: a recorded step program (server/cpu_graphs.py)
    then reads the position per step."""
    def call(*args):
        if isinstance(args[i], StepInt):
            return op_at(*args[:i], args[i].tensor, *args[i + 1:])
        return op(*args)

    return call


class Ops:
    """The glue ops: "fused" (the C++ CPU kernels above), "triton" (server/glue_triton.py, the CUDA kernels) or
    "eager" (the references); the layers and the attention backends call these and do not care which.

    ``fused`` says the C++ library is loaded (the sdpa backend's CPU attention kernels come with it); ``memory``
    is the glue's kind for the activation model (quant.shape.memory.engine_prefill_bytes): the Triton kernels allocate
    what the fused CPU ones do, the references keep temporaries."""

    def __init__(self, kind: str):
        if kind not in MEMORY_KIND:
            raise ValueError(f"glue ops kind must be one of {', '.join(MEMORY_KIND)}, got {kind!r}")
        self.kind = kind
        self.fused = kind == "fused"
        self.memory = MEMORY_KIND[kind]
        self.decode_attention = ref_decode_attention
        self.prefill_attention = ref_prefill_attention
        # over a quantized cache (int8 / fp8 codes and float16 scales); the Triton backend reads none yet
        self.store_kv_quant = ref_store_kv_quant
        self.decode_attention_quant = ref_decode_attention_quant
        self.prefill_attention_quant = ref_prefill_attention_quant
        self.rotary_decode_attention = ref_rotary_decode_attention
        self.store_blocks_int4 = kv_int4.ref_store_blocks_int4  # the int4 pool (server/kv_int4.py)
        self.store_tail_int4 = kv_int4.ref_store_tail_int4
        self.attention_int4 = kv_int4.ref_attention_int4
        self.random_uniform = ref_random_uniform  # the sampler's uniforms (server/random_stream.py)
        if kind == "fused":
            ops = torch.ops.quantserve
            self.rms_norm = ops.rms_norm.default
            self.add_rms_norm = ops.add_rms_norm.default
            self.rope_ = ops.rope_.default
            self.store_kv = ops.store_kv.default
            self.silu_mul = ops.silu_mul.default
            self.gelu_tanh_mul = ops.gelu_tanh_mul.default
            self.decode_attention = ops.decode_attention.default
            self.prefill_attention = _start_as_tensor(ops.prefill_attention.default, ops.prefill_attention_at.default,
                                                      3)
            self.store_kv_quant = ops.store_kv_quant.default
            self.decode_attention_quant = ops.decode_attention_quant.default
            self.prefill_attention_quant = _start_as_tensor(ops.prefill_attention_quant.default,
                                                            ops.prefill_attention_quant_at.default, 4)
            self.rotary_decode_attention = ops.rotary_decode_attention.default
            self.store_blocks_int4 = ops.store_blocks_int4.default
            self.store_tail_int4 = ops.store_tail_int4.default
            self.attention_int4 = ops.attention_int4.default
            self.random_uniform = fused_random_uniform
        elif kind == "triton":
            from server import glue_triton as g

            self.rms_norm, self.add_rms_norm, self.rope_ = g.rms_norm, g.add_rms_norm, g.rope_
            self.store_kv, self.silu_mul, self.gelu_tanh_mul = g.store_kv, g.silu_mul, g.gelu_tanh_mul
            self.rope_store_kv_ = g.rope_store_kv_  # the triton attention backend's fused rotary + cache write
        else:
            self.rms_norm = ref_rms_norm
            self.add_rms_norm = ref_add_rms_norm
            self.rope_ = ref_rope_
            self.store_kv = ref_store_kv
            self.silu_mul = ref_silu_mul
            self.gelu_tanh_mul = ref_gelu_tanh_mul
