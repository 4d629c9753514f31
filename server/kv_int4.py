"""The int4 KV pool (``int4``, quant/shape/kv_formats.py): what its storage holds and the plain PyTorch reference
of each op on it, the contract the C++ ops (server/csrc/kv_int4_ops.cpp) are held to.

The pool is one run of equal *units* per layer, ``units`` (units, unit bytes) uint8, numbered as the block pool
numbers its blocks (server/kv_pool.py), so that a sequence's int4 blocks and its residual tail come out of one
budget. A unit holds either

- an int4 block of ``block_size`` (= the format's key group, 32) tokens: K codes (bs, Hkv, D / 2) uint8 (channel 2i
  in the low nibble, 2i + 1 in the high), V codes likewise, the keys' scale and minimum per channel over the block
  (Hkv, 2, D) float16 (KIVI), each value's scale and minimum (bs, Hkv, 2) float16; values are held rotated (H v,
  the Walsh-Hadamard transform over head_dim), so attention's output is rotated back;
- or half of a running sequence's tail, its incomplete block in the residual format (int8-rotv): the keys' (or the
  values', rotated) int8 codes (bs, Hkv, D) and a float16 scale per token per KV head (bs, Hkv). A tail is two
  units, (K unit, V unit), taken with the sequence's first block and given back with its blocks.

A unit's bytes are exactly the format's bytes of ``block_size`` tokens (:func:`unit_bytes`); a tail half fits in one.

A step writes in two parts around attention, so that a prefill chunk reads what token-by-token decode reads:
``store_blocks`` (before) makes the int4 codes of every block the step completes from their residual values (the
tail's for its positions before the step, the step's own K/V rounded to the residual for the rest); attention
reads a query's own block from the residual (tail before the step, the step's rows after) and every earlier block
from int4; ``store_tail`` (after) writes the rows of each sequence's last, incomplete block into its tail.
quant/runtime/kv_quant.py's ``held`` / ``attend_held`` are the same reads over a whole sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quant.runtime import hadamard, kv_quant
from quant.shape.kv_formats import FORMATS

FORMAT = FORMATS["int4"]
RESIDUAL = FORMATS[FORMAT.residual]
BLOCK_SIZE = FORMAT.key_group  # a block is one key group
TAIL_UNITS = 2  # a sequence's tail: its K half and its V half


def value_block(head_dim: int) -> int:
    """The values' rotation block (the largest power of two dividing head_dim)."""
    return FORMAT.value_block(head_dim)


def unit_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one unit of one layer: an int4 block's codes and parameters (a tail half needs fewer)."""
    return block_size * kv_heads * (head_dim + 4) + 4 * kv_heads * head_dim


def views(units: Tensor, block_size: int, kv_heads: int, head_dim: int) -> dict[str, Tensor]:
    """One layer's units (units, unit bytes) read as each part a unit can hold (views: writing them writes the
    units): ``kcodes``, ``vcodes`` (units, bs, Hkv, D / 2) uint8, ``kparams`` (units, Hkv, 2, D) float16,
    ``vparams`` (units, bs, Hkv, 2) float16; a tail half's ``tail`` (units, bs, Hkv, D) int8 and ``tail_scales``
    (units, bs, Hkv) float16."""
    bs, h, d = block_size, kv_heads, head_dim
    if units.dim() != 2 or units.dtype != torch.uint8 or units.shape[1] != unit_bytes(bs, h, d):
        raise ValueError(f"int4 units must be (units, {unit_bytes(bs, h, d)}) uint8, got {tuple(units.shape)} "
                         f"{units.dtype}")

    def part(offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        return units[:, offset: offset + n].view(dtype).unflatten(1, shape)

    codes = bs * h * d // 2
    return {
        "kcodes": part(0, torch.uint8, (bs, h, d // 2)),
        "vcodes": part(codes, torch.uint8, (bs, h, d // 2)),
        "kparams": part(2 * codes, torch.float16, (h, 2, d)),
        "vparams": part(2 * codes + 4 * h * d, torch.float16, (bs, h, 2)),
        "tail": part(0, torch.int8, (bs, h, d)),
        "tail_scales": part(2 * codes, torch.float16, (bs, h)),
    }


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
    """A block's K codes (bs, Hkv, D / 2) and params (Hkv, 2, D) -> keys (bs, Hkv, D) fp32 (or blocks of them: codes
    (n, bs, Hkv, D / 2), params (n, 1, Hkv, 2, D))."""
    return unpack(codes) * kparams[..., 0, :].float() + kparams[..., 1, :].float()


def dequant_values(codes: Tensor, vparams: Tensor) -> Tensor:
    """V codes (..., Hkv, D / 2) and params (..., Hkv, 2) -> values (rotated) fp32."""
    return unpack(codes) * vparams[..., 0:1].float() + vparams[..., 1:2].float()


def _tail_values(u: dict, unit: int, n: int) -> Tensor:
    """The first n rows a tail half holds, dequantized (n, Hkv, D) fp32."""
    return kv_quant.dequantize(u["tail"][unit, :n], u["tail_scales"][unit, :n])


def ref_store_blocks_int4(k: Tensor, v: Tensor, units: Tensor, completed: Tensor, block_size: int) -> None:
    """One layer's int4 codes of the blocks a step completes. completed (N, 5) int64: (block, K tail unit, V tail
    unit, from_tail, row): the block's first ``from_tail`` positions are in its sequence's tail, the rest are this
    step's rows k[row:], v[row:] (T, Hkv, D), rounded to the residual as the tail would hold them."""
    bs = block_size
    u = views(units, bs, k.shape[1], k.shape[2])
    for block, tk, tv, from_tail, row in completed.tolist():
        parts = [torch.cat([_tail_values(u, t, from_tail), residual_values(x[row: row + bs - from_tail], key)], 0)
                 for t, x, key in ((tk, k, True), (tv, v, False))]
        u["kcodes"][block], u["kparams"][block], u["vcodes"][block], u["vparams"][block] = int4_block(*parts)


def ref_attention_int4(q: Tensor, k: Tensor, v: Tensor, units: Tensor, chunks: Tensor, tables: Tensor,
                       block_size: int, window: int, scale: float, softcap: float) -> Tensor:
    """One layer's attention for a step's rows q (T, H, D), k, v (T, Hkv, D), after :func:`ref_store_blocks_int4`:
    chunks (N, 5) int64 (row, n, start, K tail unit, V tail unit): rows [row, row + n) are a sequence's positions
    [start, start + n) (a decode row is a chunk of one), its block table tables[i] (N, blocks). Query p reads the
    positions of its own block from the residual (the tail before ``start``, the chunk's rows rounded after) and
    earlier blocks from int4; it attends to positions [max(0, p - window + 1), p] (window <= 0: from 0), scores
    soft-capped when softcap > 0. Returns (T, H, D) in q's dtype."""
    u = views(units, block_size, k.shape[1], k.shape[2])
    out = torch.empty_like(q)
    for i, (row, n, start, tk, tv) in enumerate(chunks.tolist()):
        rows = slice(row, row + n)
        out[rows] = _chunk_attention(q[rows], k[rows], v[rows], u, tables[i], start, (tk, tv), block_size, window,
                                     scale, softcap)
    return out


def _chunk_attention(q, k, v, u, table, start, tail, bs, window, scale, softcap) -> Tensor:
    C, H, D = q.shape
    L = start + C
    first = start // bs * bs  # the chunk's first block starts here
    blocks = table[: L // bs].tolist()  # the blocks complete after store_blocks
    done_k = torch.zeros(L, k.shape[1], D)
    done_v = torch.zeros_like(done_k)
    if blocks:
        done_k[: len(blocks) * bs] = dequant_keys(u["kcodes"][blocks], u["kparams"][blocks][:, None]).flatten(0, 1)
        done_v[: len(blocks) * bs] = dequant_values(u["vcodes"][blocks], u["vparams"][blocks]).flatten(0, 1)
    own = [torch.cat([torch.zeros(first, k.shape[1], D), _tail_values(u, t, start - first), residual_values(x, key)])
           for t, x, key in ((tail[0], k, True), (tail[1], v, False))]
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


def ref_store_tail_int4(k: Tensor, v: Tensor, units: Tensor, slots: Tensor, block_size: int) -> None:
    """Rows k, v (T, Hkv, D) into their sequences' tails in the residual format: slots (T, 2) int64, the row's
    place in its K and its V tail half as unit * block_size + offset; -1: the row is not written (its block
    completes in this step)."""
    u = views(units, block_size, k.shape[1], k.shape[2])
    for row, (sk, sv) in enumerate(slots.tolist()):
        for s, x, key in ((sk, k, True), (sv, v, False)):
            if s >= 0:
                u["tail"][s // block_size, s % block_size], u["tail_scales"][s // block_size, s % block_size] = \
                    residual(x[row], key)


def chunk_writes(start: int, n: int, row: int, table: list[int], tail: tuple[int, int], block_size: int
                 ) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """What a sequence's ``n`` rows at positions [start, start + n), rows ``row``.. of the step, write with its tail
    (K unit, V unit): the blocks they complete as (block, K unit, V unit, from_tail, row) for
    :func:`ref_store_blocks_int4`, and each row's (K, V) tail slots for :func:`ref_store_tail_int4` ((-1, -1) where
    its block completes in this step)."""
    bs, end = block_size, start + n
    tk, tv = tail
    completed = [(table[b], tk, tv, max(0, start - b * bs), row + max(0, b * bs - start))
                 for b in range(start // bs, end // bs)]
    done_until = end // bs * bs
    return completed, [(-1, -1) if p < done_until else (tk * bs + p % bs, tv * bs + p % bs) for p in range(start, end)]


def allocate(layers: int, units: int, block_size: int, kv_heads: int, head_dim: int,
             device: torch.device | str = "cpu") -> Tensor:
    """The pool's storage (layers, units, unit bytes) uint8, zeroed."""
    if head_dim % 8:
        raise ValueError(f"the int4 KV cache's kernels read head_dim in runs of 8 channels: {head_dim} is not a "
                         f"multiple of 8")
    return torch.zeros(layers, units, unit_bytes(block_size, kv_heads, head_dim), dtype=torch.uint8, device=device)
