"""The int4 KV pool (``int4``, quant/shape/kv_formats.py): what its tensors hold and the plain PyTorch
reference of each op on them, the contract the C++ ops are held to.

A block holds ``block_size`` (= the format's key group, 32) tokens. Per layer:

- ``codes`` (2, slots, Hkv, D / 2) uint8: K and V as 4-bit codes, channel 2i in the low nibble, 2i + 1 in the high;
- ``kparams`` (blocks, Hkv, 2, D) float16: the keys' scale and minimum per channel over the block (KIVI);
- ``vparams`` (slots, Hkv, 2) float16: each value's scale and minimum; values are held rotated (H v, the
  Walsh-Hadamard transform over head_dim), so attention's output is rotated back;
- ``tail`` (2, tails * block_size, Hkv, D) int8 and ``tail_scales`` (2, tails * block_size, Hkv) float16: each
  running sequence's incomplete block in the residual format (int8-rotv: keys as they are, values rotated, a
  scale per token per KV head).

A step writes in two parts around attention, so that a prefill chunk reads what token-by-token decode reads:
``store_blocks`` (before) makes the int4 codes of every block the step completes from its residual values (the
tail's for its positions before the step, the step's own K/V rounded to the residual for the rest); attention
reads a query's own block from the residual (tail before the step, the step's rows after) and every earlier block
from int4; :func:`store_tail` (after) writes the rows of each sequence's last, incomplete block into its tail (the
int8 pool's ``store_kv_quant``, keys unrotated, values rotated).
quant/runtime/kv_quant.py's ``held`` / ``attend_held`` are the same reads over a whole sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quant.runtime import hadamard, kv_quant
from quant.shape.kv_formats import FORMATS

FORMAT = FORMATS["int4"]
RESIDUAL = FORMATS[FORMAT.residual]


def value_block(head_dim: int) -> int:
    """The values' rotation block (the largest power of two dividing head_dim)."""
    return FORMAT.value_block(head_dim)


def residual(x: Tensor, key: bool) -> tuple[Tensor, Tensor]:
    """Rows x (..., D) in the residual format: (int8 codes, float16 scales); values rotated first."""
    if not key:
        x = kv_quant.rotate(x, value_block(x.shape[-1]))
    return kv_quant.quantize(RESIDUAL, x)


def residual_values(x: Tensor, key: bool) -> Tensor:
    """What the residual holds of rows x, dequantized in fp32 (values in the rotated space)."""
    return kv_quant.dequantize(*residual(x, key))


def pack(q: Tensor) -> Tensor:
    """4-bit codes (..., D) -> (..., D / 2) bytes, channel 2i low."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(b: Tensor) -> Tensor:
    """(..., D / 2) bytes -> (..., D) codes as float32."""
    return torch.stack([b & 15, b >> 4], -1).flatten(-2).float()


def int4_block(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One block's residual values k, v (bs, Hkv, D) fp32 (v rotated) -> (K codes (bs, Hkv, D / 2), K params
    (Hkv, 2, D), V codes, V params (bs, Hkv, 2))."""
    kq, ks, kmin = kv_quant.asym_codes(k, 4, 0)  # per channel over the block's tokens
    vq, vs, vmin = kv_quant.asym_codes(v, 4, -1)  # per token per KV head
    return pack(kq), torch.cat([ks, kmin], 0).transpose(0, 1), pack(vq), torch.cat([vs, vmin], -1)


def dequant_keys(codes: Tensor, kparams: Tensor) -> Tensor:
    """A block's K codes (bs, Hkv, D / 2) and params (Hkv, 2, D) -> keys (bs, Hkv, D) fp32."""
    return unpack(codes) * kparams[:, 0].float() + kparams[:, 1].float()


def dequant_values(codes: Tensor, vparams: Tensor) -> Tensor:
    """V codes (..., Hkv, D / 2) and params (..., Hkv, 2) -> values (rotated) fp32."""
    return unpack(codes) * vparams[..., 0:1].float() + vparams[..., 1:2].float()


def ref_store_blocks_int4(k: Tensor, v: Tensor, tail: Tensor, tail_scales: Tensor, codes: Tensor, kparams: Tensor,
                          vparams: Tensor, completed: Tensor, block_size: int) -> None:
    """One layer's int4 codes of the blocks a step completes (the layer's tensors as in the module's docstring).
    completed (N, 4) int64: (block, tail, from_tail, row): the block's first ``from_tail`` positions are in the
    tail's slots tail * bs + i, the rest are this step's rows k[row:], v[row:] (T, Hkv, D), rounded to the residual
    as the tail would hold them."""
    bs = block_size
    for block, t, from_tail, row in completed.tolist():
        parts = []
        for which, x in ((0, k), (1, v)):
            held = kv_quant.dequantize(tail[which, t * bs: t * bs + from_tail],
                                       tail_scales[which, t * bs: t * bs + from_tail])
            parts.append(torch.cat([held, residual_values(x[row: row + bs - from_tail], which == 0)], 0))
        kc, kp, vc, vp = int4_block(*parts)
        sl = slice(block * bs, (block + 1) * bs)
        codes[0, sl], codes[1, sl], kparams[block], vparams[sl] = kc, vc, kp, vp


def ref_attention_int4(q: Tensor, k: Tensor, v: Tensor, tail: Tensor, tail_scales: Tensor, codes: Tensor,
                       kparams: Tensor, vparams: Tensor, chunks: Tensor, tables: Tensor, block_size: int, window: int,
                       scale: float, softcap: float) -> Tensor:
    """One layer's attention for a step's rows q (T, H, D), k, v (T, Hkv, D), after :func:`ref_store_blocks_int4`:
    chunks (N, 4) int64 (row, n, start, tail): rows [row, row + n) are a sequence's positions [start, start + n)
    (a decode row is a chunk of one), its block table tables[i] (N, blocks) and its tail. Query p reads the
    positions of its own block from the residual (the tail before ``start``, the chunk's rows rounded after) and
    earlier blocks from int4; it attends to positions [max(0, p - window + 1), p] (window <= 0: from 0), scores
    soft-capped when softcap > 0. Returns (T, H, D) in q's dtype."""
    out = torch.empty_like(q)
    for i, (row, n, start, t) in enumerate(chunks.tolist()):
        rows = slice(row, row + n)
        out[rows] = _chunk_attention(q[rows], k[rows], v[rows], tail, tail_scales, codes, kparams, vparams,
                                     tables[i], start, t, block_size, window, scale, softcap)
    return out


def _chunk_attention(q, k, v, tail, tail_scales, codes, kparams, vparams, table, start, t, bs, window, scale,
                     softcap) -> Tensor:
    C, H, D = q.shape
    L = start + C
    first = start // bs * bs  # the chunk's first block starts here
    done_k = torch.zeros(L, k.shape[1], D)
    done_v = torch.zeros_like(done_k)
    for b in range(L // bs):  # the blocks complete after store_blocks
        blk = int(table[b])
        sl = slice(blk * bs, (blk + 1) * bs)
        done_k[b * bs: (b + 1) * bs] = dequant_keys(codes[0, sl], kparams[blk])
        done_v[b * bs: (b + 1) * bs] = dequant_values(codes[1, sl], vparams[sl])
    own = []
    for which, x in ((0, k), (1, v)):
        before = kv_quant.dequantize(tail[which, t * bs: t * bs + start - first],
                                     tail_scales[which, t * bs: t * bs + start - first])
        own.append(torch.cat([torch.zeros(first, k.shape[1], D), before, residual_values(x, which == 0)], 0))
    pos = torch.arange(L)
    qpos = torch.arange(start, L)
    visible = pos[None, :] <= qpos[:, None]
    if window > 0:
        visible &= pos[None, :] > qpos[:, None] - window

    def heads(x):  # (L, Hkv, D) -> (Hkv, L, D)
        return x.transpose(0, 1)

    out = kv_quant.attend_held(q.float().transpose(0, 1), (heads(done_k), heads(own[0])),
                               (heads(done_v), heads(own[1])), bs, qpos, visible, scale, softcap)
    return hadamard.rotate(out.transpose(0, 1), value_block(D)).to(q.dtype)


def chunk_writes(start: int, n: int, row: int, table: list[int], tail: int, block_size: int
                 ) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """What a sequence's ``n`` rows at positions [start, start + n), rows ``row``.. of the step, write: the blocks
    they complete as (block, tail, from_tail, row) for :func:`ref_store_blocks_int4`, and each row's tail slot for
    :func:`store_tail` (-1 where its block completes in this step)."""
    bs, end = block_size, start + n
    completed = [(table[b], tail, max(0, start - b * bs), row + max(0, b * bs - start))
                 for b in range(start // bs, end // bs)]
    done_until = end // bs * bs
    return completed, [-1 if p < done_until else tail * bs + p % bs for p in range(start, end)]


def store_tail(ops, k: Tensor, v: Tensor, tail: Tensor, tail_scales: Tensor, slots: list[int]) -> None:
    """Rows k, v (T, Hkv, D) into their tail slots in the residual format through ``ops.store_kv_quant`` (one
    layer's tail and scales); a slot of -1: the row is not written."""
    rows = [i for i, s in enumerate(slots) if s >= 0]
    if rows:
        idx = torch.tensor(rows, device=k.device)
        ops.store_kv_quant(k.index_select(0, idx), v.index_select(0, idx), tail, tail_scales,
                           torch.tensor([slots[i] for i in rows], device=k.device), 0, value_block(k.shape[-1]))


def allocate(layers: int, blocks: int, tails: int, block_size: int, kv_heads: int, head_dim: int,
             device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The pool's tensors (see the module's docstring), zeroed."""
    slots, ts = blocks * block_size, tails * block_size
    return {
        "codes": torch.zeros(layers, 2, slots, kv_heads, head_dim // 2, dtype=torch.uint8, device=device),
        "kparams": torch.zeros(layers, blocks, kv_heads, 2, head_dim, dtype=torch.float16, device=device),
        "vparams": torch.zeros(layers, slots, kv_heads, 2, dtype=torch.float16, device=device),
        "tail": torch.zeros(layers, 2, ts, kv_heads, head_dim, dtype=torch.int8, device=device),
        "tail_scales": torch.zeros(layers, 2, ts, kv_heads, dtype=torch.float16, device=device),
    }
