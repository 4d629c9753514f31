"""The ``sdpa`` backend, the CPU backend and the reference path on any device: with the fused CPU ops, C++ kernels
that read the paged pool in place through the block tables; otherwise PyTorch's scaled_dot_product_attention over
the pool, gathering each request's slots (or taking a view of them when its blocks are consecutive).

KV layout: (layers, 2, blocks, block_size, kv_heads, head_dim), read as one flat run of slots per layer.

- Decode rows with the fused CPU ops: one ``decode_attention`` call per layer over the block tables
  (server/csrc/attention_ops.cpp), no gather, mask or SDPA call (whose fixed cost was a sixth of a batch-1 step);
  measured ahead of the gather path below at every row count tried, 1 to 64 (bench/decode_rows.py).
- Decode rows otherwise: one query each, so the g query heads sharing a KV head stand in for the query axis,
  (Bd, Hkv, g, D) against (Bd, Hkv, L, D): no K/V repetition for GQA, one SDPA call for every row. A lone
  row whose blocks are consecutive attends to a view of the cache (no gather, no mask).
- Prefill chunks: one call each, causal over the request's past plus the chunk (bottom-right aligned). With the
  fused CPU ops, the ``prefill_attention`` kernel (server/csrc/attention_ops.cpp) reads the chunk's keys through
  its block table in place, key tiles with an online softmax, windows and soft-capping included: no gather, mask
  or score matrix (PyTorch's SDPA was 100 of the 263 ms of a 512-token prefill: bench/RESULTS.md#cpu-prefill-attention-benchattention_cpupy).
- Sliding windows: the keys a window hides are cut from the view or masked; masks are built once per step per
  distinct window (Gemma alternates two).
- Soft-capping: SDPA cannot express it, so those layers run the eager masked softmax of
  ``server.attention.reference`` in the same shapes.
- A quantized cache (``kv_scales``: int8 or fp8 codes with a float16 scale per token per KV head): written through
  ``store_kv_quant``; the fused kernels dequantize each row as they load it (server/csrc/kv_rows.h), so no
  full-precision copy of the cache exists; the SDPA path (no C++ compiler) dequantizes the keys it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from quant.runtime.kv_quant import dequantize, rotate
from server.attention.base import AttentionBackend, AttentionSpec
from server.attention.reference import visible
from server.batch import StepInputs, StepInt


def _slots(table: list[int], lo: int, end: int, bs: int) -> list[int]:
    """Slot indices of positions [lo, end) for a request whose blocks are ``table``."""
    return [table[p // bs] * bs + p % bs for p in range(lo, end)]


def _as_range(table: list[int], lo: int, end: int, bs: int) -> slice | None:
    """The slots of positions [lo, end) as one slice when the blocks they use are consecutive (a fresh pool
    hands them out that way), else None. Decided on the block table, not per position."""
    used = table[lo // bs : -(-end // bs)]
    if used != list(range(used[0], used[0] + len(used))):
        return None
    a = used[0] * bs + lo % bs
    return slice(a, a + end - lo)


@dataclass
class _Chunk:
    t0: int
    length: int
    start: int  # the position of the chunk's first token (fused: a StepInt, which a recorded program reads per step)
    table: Tensor | None  # fused: (blocks,) the request's block table, through the chunk's last position
    keys: dict  # not fused: window -> (slots: slice | Tensor, mask: Tensor | None); mask None means square causal


@dataclass
class SdpaMeta:
    slots: Tensor  # (T,) where each token's K/V goes
    num_decode: int
    decode_range: dict = field(default_factory=dict)  # window -> slice: the lone contiguous decode row's keys
    decode_slots: Tensor | None = None  # (Bd, Lmax) every cached slot of each decode row, padded with 0
    decode_mask: dict = field(default_factory=dict)  # window -> (Bd, 1, 1, Lmax) bool
    decode_tables: tuple[Tensor, Tensor] | None = None  # fused: (Bd, blocks) block tables, (Bd,) key counts
    chunks: list[_Chunk] = field(default_factory=list)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    features = frozenset({"window", "softcap"})
    # The C++ decode kernel takes decode steps of at most this many rows: on all threads (built with OpenMP, see
    # quant/runtime/kernels/native.py) it is ahead of the SDPA path at every row count measured through the engine
    # (bench/RESULTS.md#cpu-decode-attention-by-decode-rows-benchdecode_rowspy), so every decode step takes it;
    # benches lower this to compare the two.
    FUSED_DECODE_MAX_ROWS = 1 << 30
    # Prefill chunks through the C++ kernel when the fused ops are on (False: SDPA; benches compare the two with it).
    FUSED_PREFILL = True

    @staticmethod
    def kv_shape(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (layers, 2, blocks, block_size, kv_heads, head_dim)

    def __init__(self, kv_storage: Tensor, block_size: int, specs: list[AttentionSpec], ops,
                 kv_scales: Tensor | None = None, kv_rotation: tuple[int, int] = (0, 0)):
        layers, two, blocks, bs, kvh, d = kv_storage.shape
        assert (layers, two, bs) == (len(specs), 2, block_size), "KV storage does not match the model"
        self.kv = kv_storage.view(layers, 2, blocks * bs, kvh, d)  # (L, 2, slots, Hkv, D)
        self.scales = None if kv_scales is None else kv_scales.view(layers, 2, blocks * bs, kvh)  # (L, 2, slots, Hkv)
        # each layer's view, made once (indexing self.kv in a step would add an op a layer to its program)
        self.layer_kv = self.kv.unbind(0)
        self.layer_scales = None if self.scales is None else self.scales.unbind(0)
        self.rotation = kv_rotation  # keys' and values' rotation blocks (int8), 0 where not rotated
        self.specs = specs
        self.windows = list(dict.fromkeys(s.window for s in specs))  # distinct, in layer order
        self.ops = ops
        self.block_size = block_size

    # ------------------------------------------------------------------------------------ per step

    def prepare(self, step: StepInputs) -> SdpaMeta:
        bs, dev = step.block_size, step.input_ids.device
        meta = SdpaMeta(slots=step.slots, num_decode=step.num_decode)
        i64 = dict(dtype=torch.int64, device=dev)
        if step.decode and self.ops.fused and len(step.decode) <= self.FUSED_DECODE_MAX_ROWS:
            width = max(len(table) for _, table in step.decode)
            tables = torch.tensor([table + [0] * (width - len(table)) for _, table in step.decode], **i64)
            meta.decode_tables = (tables, torch.tensor([p + 1 for p, _ in step.decode], **i64))  # (Bd, NB), (Bd,)
        elif len(step.decode) == 1 and (r := _as_range(step.decode[0][1], 0, step.decode[0][0] + 1, bs)) is not None:
            p = step.decode[0][0]
            for w in self.windows:  # a window keeps the last w keys of the view
                meta.decode_range[w] = r if w is None or w > p else slice(r.stop - w, r.stop)
        elif step.decode:
            rows = [_slots(table, 0, p + 1, bs) for p, table in step.decode]
            width = max(len(r) for r in rows)
            meta.decode_slots = torch.tensor([r + [0] * (width - len(r)) for r in rows], **i64)  # (Bd, Lmax)
            pos = torch.tensor([p for p, _ in step.decode], **i64)  # (Bd,)
            j = torch.arange(width, device=dev)[None, :]  # (1, Lmax): key j sits at position j
            for w in self.windows:
                m = j <= pos[:, None]
                if w is not None:
                    m &= j > pos[:, None] - w
                meta.decode_mask[w] = m[:, None, None, :]  # (Bd, 1, 1, Lmax)
        for t0, c, start, table in step.chunks:
            if self.ops.fused and self.FUSED_PREFILL:
                meta.chunks.append(_Chunk(t0, c, StepInt(start), torch.tensor(table[: -(-(start + c) // bs)], **i64),
                                          {}))
                continue
            keys = {}
            for w in self.windows:
                lo = 0 if w is None else max(0, start - w + 1)  # the first query's window starts here
                span = _as_range(table, lo, start + c, bs)
                sl = span if span is not None else torch.tensor(_slots(table, lo, start + c, bs), **i64)
                square = lo == start and (w is None or c <= w)
                mask = None if square else visible(torch.arange(start, start + c, device=dev),
                                                   torch.arange(lo, start + c, device=dev), w)  # (C, past + C)
                keys[w] = (sl, mask)
            meta.chunks.append(_Chunk(t0, c, start, None, keys))
        return meta

    def programmable(self, meta: SdpaMeta) -> bool:
        """The C++ kernels' paths: decode rows over the block tables, chunks through theirs (a chunk's first position
        a StepInt); the SDPA paths' masks and views follow the positions in Python."""
        return (self.ops.fused and (meta.num_decode == 0 or meta.decode_tables is not None)
                and all(ch.table is not None for ch in meta.chunks))

    # ------------------------------------------------------------------------------------ per layer

    def decode_qkv(self, qkv: Tensor, heads: int, cos: Tensor, sin: Tensor, layer: int,
                   meta: SdpaMeta) -> Tensor | None:
        """The C++ kernels' whole decode step of a layer in one call (``rotary_decode_attention``: the rotary, the
        cache write and the decode attention, the functions :meth:`forward_rotary` calls one by one, so the same
        bits) where they run this step's decode rows and no chunk is in it."""
        if meta.decode_tables is None or meta.chunks or meta.num_decode != qkv.shape[0]:
            return None
        spec = self.specs[layer]
        tables, lens = meta.decode_tables
        sc = None if self.layer_scales is None else self.layer_scales[layer]
        return self.ops.rotary_decode_attention(qkv, cos, sin, self.layer_kv[layer], sc, meta.slots, tables, lens,
                                                heads, self.block_size, spec.window or 0, spec.scale,
                                                spec.softcap or 0.0, *self.rotation)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: int, meta: SdpaMeta) -> Tensor:
        spec = self.specs[layer]
        kv = self.layer_kv[layer]  # (2, slots, Hkv, D)
        sc = None if self.layer_scales is None else self.layer_scales[layer]  # (2, slots, Hkv)
        if sc is None:
            self.ops.store_kv(k, v, kv, meta.slots)
        else:
            self.ops.store_kv_quant(k, v, kv, sc, meta.slots, *self.rotation)

        def rows(which: int, idx) -> Tensor:  # K (0) or V (1) of slots idx, in q's dtype (rotated back)
            if sc is None:
                return kv[which][idx]
            return rotate(dequantize(kv[which][idx], sc[which][idx]), self.rotation[which]).to(q.dtype)

        T, H, D = q.shape
        out = q.new_empty(T, H, D)  # (T, H, D)
        bd, w = meta.num_decode, spec.window
        if meta.decode_tables is not None:
            tables, lens = meta.decode_tables
            args = (tables, lens, self.block_size, w or 0, spec.scale, spec.softcap or 0.0)
            out[:bd] = (self.ops.decode_attention(q[:bd], kv, *args) if sc is None else
                        self.ops.decode_attention_quant(q[:bd], kv, sc, *args, *self.rotation))
        elif meta.decode_range:
            rng = meta.decode_range[w]
            qd = q[:1].reshape(1, spec.kv_heads, spec.group, D)  # (1, Hkv, g, D)
            kd = rows(0, rng).transpose(0, 1)[None]  # (1, Hkv, L, D)
            vd = rows(1, rng).transpose(0, 1)[None]
            out[:1] = _attend(qd, kd, vd, None, False, spec).reshape(1, H, D)
        elif bd:
            qd = q[:bd].reshape(bd, spec.kv_heads, spec.group, D)  # (Bd, Hkv, g, D)
            kd = rows(0, meta.decode_slots).transpose(1, 2)  # (Bd, Hkv, L, D)
            vd = rows(1, meta.decode_slots).transpose(1, 2)
            out[:bd] = _attend(qd, kd, vd, meta.decode_mask[w], False, spec).reshape(bd, H, D)
        for ch in meta.chunks:
            if ch.table is not None:
                qc = q[ch.t0 : ch.t0 + ch.length]
                args = (ch.table, ch.start, self.block_size, w or 0, spec.scale, spec.softcap or 0.0)
                out[ch.t0 : ch.t0 + ch.length] = (self.ops.prefill_attention(qc, kv, *args) if sc is None else
                                                  self.ops.prefill_attention_quant(qc, kv, sc, *args, *self.rotation))
                continue
            sl, mask = ch.keys[w]
            qc = q[ch.t0 : ch.t0 + ch.length].transpose(0, 1)[None]  # (1, H, C, D)
            kk = rows(0, sl).transpose(0, 1)[None]  # (1, Hkv, past + C, D)
            vv = rows(1, sl).transpose(0, 1)[None]
            out[ch.t0 : ch.t0 + ch.length] = _attend(qc, kk, vv, mask, mask is None, spec)[0].transpose(0, 1)
        return out


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, spec: AttentionSpec) -> Tensor:
    """q (B, Hq, Tq, D) against k, v (B, Hk, Tk, D), Hq a multiple of Hk; mask broadcastable to (B, Hq, Tq, Tk),
    True where visible; causal: square and causal. SDPA, or the eager masked softmax for soft-capped layers."""
    gqa = q.shape[1] != k.shape[1]
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=spec.scale,
                                              enable_gqa=gqa)
    if gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * spec.scale  # (B, Hq, Tq, Tk)
    s = torch.tanh(s / spec.softcap) * spec.softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
