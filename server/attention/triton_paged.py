"""The ``triton`` backend: paged attention in one Triton kernel that reads K/V through the block tables in
place (no gather of a request's cache, no mask tensors), for decode rows and prefill chunks alike. The CUDA
backend; on a CPU it runs under ``TRITON_INTERPRET=1`` (how the tests hold it to ``server.attention.reference``).

KV layout: the sdpa backend's, (layers, 2, blocks, block_size, kv_heads, head_dim), so the pool is the same.

The kernel (vLLM's unified Triton attention has the same shape): a step is S sequences, each with q_len query
tokens at the end of its ctx_len keys (a decode row: q_len 1; a prefill chunk: its length, after its past).
One program takes one sequence, one KV head and BLOCK_M query rows, where a row is (token, query head of the
group): the g query heads sharing a KV head share every K/V load (GQA without repetition) and fill the rows a
lone decode token would leave empty. It walks the sequence's keys [lo, hi), BLOCK_N keys (several pages of
block_size, each key's slot read from the block table) per iteration: causal (key position <= the row's
position), a sliding window (> position - window) and soft-capping are applied to the fp32 scores, then an
online softmax (fp32) accumulates P·V.

Decode steps over long contexts with few sequences also split the key range (``splits`` programs per sequence
and head; each writes its partial max, sum and output, and the last of them to finish merges them, in split order,
within the same launch), so that a batch-1 step still occupies more than H_kv of the GPU's multiprocessors.

A step of one token per sequence (every decode step, and so every CUDA graph) norms each head of q and k (where the
model has such norms: Qwen3, Gemma 3), rotates them in the attention kernel and writes k and v to the cache there
(the program whose keys hold the token's position writes them, then reads them through the table like any other
key), so a decode layer's attention is one launch; prefill chunks take the glue's rope_store_kv_ launch first.

Per step, ``prepare`` packs the sequences' starts, lengths and block tables into one int32 buffer and sends it
in one non-blocking copy (pinned staging on CUDA): nothing per layer touches the host.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from quant.errors import UnsupportedModelError
from quant.runtime.kernels.triton_ops import multiprocessors, split_counters
from server.attention.base import AttentionBackend, AttentionSpec
from server.batch import StepInputs, stage


def available() -> str | None:
    """None when the kernels can run here, else why not (looked up without importing triton: the kernels are
    imported on the first launch, from server/attention/triton_kernels.py)."""
    return None if importlib.util.find_spec("triton") is not None else "triton is not installed"


@dataclass
class TritonMeta:
    slots: Tensor  # (T,) where each token's K/V goes
    meta: Tensor  # (3, S) int32: q_start, q_len, ctx_len per sequence
    tables: Tensor  # (S, width) int32 block tables, padded with 0
    seqs: int
    max_q: int  # the longest q_len (host-known: sets the grid)
    max_ctx: int
    splits: int  # split-K factor (decode-only steps)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _flat(rows: list[tuple[int, int, int, list[int]]], width: int, fill: int) -> list[int]:
    """(q_start, q_len, ctx_len, block table) per sequence -> TritonMeta's int32 layout, as one list for one copy:
    the three (S,) columns, then the tables padded to ``width`` with block ``fill``."""
    flat = [r[0] for r in rows] + [r[1] for r in rows] + [r[2] for r in rows]
    for *_, table in rows:
        flat.extend(table)
        flat.extend([fill] * (width - len(table)))
    return flat


class TritonBackend(AttentionBackend):
    name = "triton"
    features = frozenset({"window", "softcap"})
    # A decode-only step splits each sequence's keys when it has fewer sequences x KV heads than PROGRAMS_PER_SM
    # programs per multiprocessor of the device, keeping at least MIN_SPLIT_KEYS keys per part.
    PROGRAMS_PER_SM = 2
    MIN_SPLIT_KEYS = 256
    keys_per_step: int | None = None  # keys per iteration of the kernel's loop; None: step_keys()'s rule

    @staticmethod
    def kv_shape(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (layers, 2, blocks, block_size, kv_heads, head_dim)

    @classmethod
    def unsupported(cls, specs: list[AttentionSpec]) -> str | None:
        return available() or super().unsupported(specs)

    @staticmethod
    def unsupported_block_size(block_size: int) -> str | None:
        if block_size < 16 or block_size & (block_size - 1):
            return f"the triton backend reads whole pages per step of its loop: block size {block_size} must be a " \
                   "power of two >= 16"
        return None

    def __init__(self, kv_storage: Tensor, block_size: int, specs: list[AttentionSpec], ops,
                 kv_scales: Tensor | None = None, kv_rotation: tuple[int, int] = (0, 0)):
        layers, two, blocks, bs, kvh, d = kv_storage.shape
        assert (layers, two, bs) == (len(specs), 2, block_size), "KV storage does not match the model"
        if kv_scales is not None:
            raise UnsupportedModelError(f"the {self.name} backend does not read a quantized KV cache yet; serve with "
                                        f"--kv-dtype auto on this device")
        why = self.unsupported_block_size(block_size)
        if why:
            raise UnsupportedModelError(why)
        if kv_storage.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise UnsupportedModelError(f"the triton backend runs on CUDA tensors (or on any device under Triton's "
                                        f"interpreter, TRITON_INTERPRET=1), not on {kv_storage.device}")
        self.kv = kv_storage.view(layers, 2, blocks * bs, kvh, d)  # (L, 2, slots, Hkv, D)
        self.specs = specs
        self.ops = ops
        self.block_size = block_size
        self.device = kv_storage.device

    # ------------------------------------------------------------------------------------ per step

    def _splits(self, seqs: int, most: int) -> int:
        """The split-K factor: enough programs for the device with ``seqs`` sequences, at most ``most``, a power of
        two (tl.arange in the merge)."""
        target = self.PROGRAMS_PER_SM * multiprocessors(self.device)
        splits = max(1, min(target // max(1, seqs * self.specs[0].kv_heads), most))
        return 1 << (splits.bit_length() - 1)

    def _staged(self, rows, width: int, fill: int) -> tuple[Tensor, Tensor]:
        """The rows' metadata (3, S) and tables (S, width) on the device, from one staged copy."""
        s = len(rows)
        dev = stage(_flat(rows, width, fill), torch.int32, self.device)
        return dev[: 3 * s].view(3, s), dev[3 * s:].view(s, width)

    def prepare(self, step: StepInputs) -> TritonMeta:
        rows = [(i, 1, p + 1, table) for i, (p, table) in enumerate(step.decode)]
        rows += [(t0, c, start + c, table) for t0, c, start, table in step.chunks]
        meta, tables = self._staged(rows, max(1, max(len(r[3]) for r in rows)), 0)
        max_ctx = max(r[2] for r in rows)
        # decode only: split long contexts when the step has few programs
        splits = 1 if step.chunks else self._splits(len(rows), max_ctx // self.MIN_SPLIT_KEYS)
        return TritonMeta(slots=step.slots, meta=meta, tables=tables, seqs=len(rows), max_q=max(r[1] for r in rows),
                          max_ctx=max_ctx, splits=splits)

    def graph_meta(self, seqs: int, width: int, slots: Tensor, pad_block: int) -> TritonMeta:
        """Static metadata for a CUDA graph of decode steps of ``seqs`` rows (server.cuda_graphs), every row
        attending to the first key of ``pad_block`` until ``update_graph_meta`` fills it in before a replay. The
        split-K factor is fixed for the bucket (the kernel skips the splits a short context leaves empty)."""
        meta, tables = self._staged([(i, 1, 1, [pad_block]) for i in range(seqs)], width, pad_block)
        return TritonMeta(slots=slots, meta=meta, tables=tables, seqs=seqs, max_q=1, max_ctx=width * self.block_size,
                          splits=self._splits(seqs, 16))

    def update_graph_meta(self, meta: TritonMeta, step: StepInputs, pad_block: int) -> None:
        """Write a decode step's rows into a graph's static metadata, the bucket's spare rows on ``pad_block``;
        only the table columns this step uses are copied."""
        rows = [(i, 1, p + 1, table) for i, (p, table) in enumerate(step.decode)]
        rows += [(i, 1, 1, [pad_block]) for i in range(len(rows), meta.seqs)]
        w = max(len(r[3]) for r in rows)
        m, t = self._staged(rows, w, pad_block)
        meta.meta.copy_(m)
        meta.tables[:, :w].copy_(t)

    # ------------------------------------------------------------------------------------ per layer

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: int, meta: TritonMeta) -> Tensor:
        spec = self.specs[layer]
        kv = self.kv[layer]  # (2, slots, Hkv, D)
        self.ops.store_kv(k, v, kv, meta.slots)
        return paged_attention(q, kv[0], kv[1], meta, spec, self.block_size, self.keys_per_step)

    def forward_rotary(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, layer: int,
                       meta: TritonMeta, norms: tuple | None = None) -> Tensor:
        """One token per sequence (decode steps, every CUDA graph's): the attention kernel norms each head of q and k
        (where the model has such norms), rotates them and writes k and v before reading the cache, one launch per
        layer. Otherwise the rotary and the cache write are one glue launch (with the triton glue) before the
        attention's, after the norms' own."""
        kv = self.kv[layer]  # (2, slots, Hkv, D)
        fused_norms = norms is not None and meta.max_q == 1 and norms[0].eps == norms[1].eps  # (one eps in the kernel)
        if norms is not None and not fused_norms:
            q, k = norms[0](q), norms[1](k)
        if meta.max_q == 1:
            qk_norm = (norms[0].weight, norms[1].weight, norms[0].eps) if fused_norms else None
            return paged_attention(q, kv[0], kv[1], meta, self.specs[layer], self.block_size, self.keys_per_step,
                                   rope=(k, v, cos, sin), qk_norm=qk_norm)
        if self.ops.kind != "triton":
            return super().forward_rotary(q, k, v, cos, sin, layer, meta)
        self.ops.rope_store_kv_(q, k, v, cos, sin, kv, meta.slots)  # the rotary and the cache write: one launch
        return paged_attention(q, kv[0], kv[1], meta, self.specs[layer], self.block_size, self.keys_per_step)


def _check_rope(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, meta: TritonMeta) -> None:
    T, H, D = q.shape
    hkv = kc.shape[1]
    if meta.max_q != 1:
        raise ValueError(f"paged_attention: the rotary is fused only for one token per sequence, not {meta.max_q}")
    for name, t, heads in (("q", q, H), ("k", k, hkv), ("v", v, hkv)):
        if t.shape != (T, heads, D) or t.stride(2) != 1 or t.stride(1) != D or t.dtype != kc.dtype:
            raise ValueError(f"paged_attention: {name} must be (T, {heads}, {D}) with contiguous heads in {kc.dtype}")
    R = cos.shape[1]
    if R % 2 or R > D or cos.shape != (T, R) or sin.shape != cos.shape or cos.stride(1) != 1 \
            or sin.stride() != cos.stride():
        raise ValueError(f"paged_attention: cos and sin must be (T, R) rows with an even R <= {D}")


def step_keys(block_size: int, head_dim: int, rows: int) -> int:
    """Keys per iteration of the kernel's loop: whole pages, 128 keys for decode rows (few query rows: the (rows,
    keys) scores are small) and 64 for prefill chunks, halved for heads over 128 (bench/sass.py: none spills)."""
    keys = (128 if rows <= 16 else 64) // (2 if head_dim > 128 else 1)
    return max(block_size, keys)


def paged_attention(q: Tensor, kc: Tensor, vc: Tensor, meta: TritonMeta, spec: AttentionSpec,
                    block_size: int, keys: int | None = None,
                    rope: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
                    qk_norm: tuple[Tensor, Tensor, float] | None = None) -> Tensor:
    """q (T, H, D) against the paged cache kc, vc (slots, Hkv, D) as ``meta`` describes -> (T, H, D); ``keys`` per
    step of the key loop (whole pages, a power of two) overrides :func:`step_keys`.

    ``rope``: (k, v, cos, sin), the step's k and v (T, Hkv, D, heads contiguous) and its rotary tables (T, R): q and
    k are then rotated in the kernel (q is left as given) and k and v written to meta.slots first. Only for steps of
    one token per sequence (meta.max_q == 1), where one program holds each token's rows. ``qk_norm``: (q's weight,
    k's weight (D,) each, eps) of an RMSNorm over each head that q and k take before the rotary (Qwen3, Gemma 3),
    applied in the kernel too (with ``rope`` only)."""
    from server.attention.triton_kernels import paged_attention as kernel

    T, H, D = q.shape
    if keys is not None and (keys % block_size or keys & (keys - 1)):
        raise ValueError(f"paged_attention: keys per step must be whole pages of {block_size}, a power of two; "
                         f"got {keys}")
    if rope is not None:
        k, v, cos, sin = rope
        _check_rope(q, k, v, cos, sin, kc, meta)
    if qk_norm is not None and (rope is None or any(w.shape != (D,) or w.dtype != q.dtype for w in qk_norm[:2])):
        raise ValueError(f"paged_attention: the q/k norms are fused with the rotary only, weights ({D},) in {q.dtype}")
    g = spec.group
    out = q.new_empty(T, H, D)
    rows = meta.max_q * g
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    splits = meta.splits
    mblocks = -(-rows // block_m)
    block_d = _pow2(D)
    if splits > 1:
        m_part = torch.empty(meta.seqs * H * splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty(meta.seqs * H * splits, D, dtype=torch.float32, device=q.device)
        locks = split_counters(q.device, meta.seqs * spec.kv_heads * mblocks)
    else:
        m_part = l_part = o_part = locks = out  # unused
    grid = (mblocks * splits, meta.seqs, spec.kv_heads)
    k, v, cos, sin = rope or (q, q, q, q)  # (unused without rope)
    qw, kw, qk_eps = qk_norm or (q, q, 0.0)  # (unused without qk_norm)
    kernel[grid](
        q, kc, vc, out, m_part, l_part, o_part, locks, meta.meta, meta.tables, k, v, cos, sin,
        meta.slots if rope else meta.meta, qw, kw, qk_eps, meta.seqs, meta.tables.shape[1], kc.shape[0],
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), out.stride(0), out.stride(1), k.stride(0), v.stride(0),
        cos.stride(0), spec.scale, spec.softcap or 0.0, spec.window or 0,
        G=g, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=keys or step_keys(block_size, D, rows),
        PAGE=block_size, SPLITS=splits, SOFTCAP=spec.softcap is not None, WINDOW=spec.window is not None,
        ROPE=rope is not None, HALF=cos.shape[1] // 2 if rope else 0, QK_NORM=qk_norm is not None,
        # 64 query rows by a head of 128 or more in 4 warps spill on an A100 (bench/sass.py --arch 80): 8 warps
        num_warps=8 if block_m == 64 and block_d >= 128 else 4,
    )
    return out
