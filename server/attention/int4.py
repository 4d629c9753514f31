"""The ``int4`` backend: attention over the int4 KV pool (``--kv-dtype int4``; its layout, references and the
reasons for the two writes in server/kv_int4.py), on the CPU through the C++ ops of server/csrc/kv_int4_ops.cpp
(the references where they are not built).

Per step, ``prepare`` turns the batch into three tables, built once for every layer:

1. ``completed`` (N, 5): the blocks this step's rows complete (block, K tail, V tail, from_tail, row), which
   ``store_blocks_int4`` makes int4 from the residual values before attention;
2. ``chunks`` (N, 5) and ``tables``: each sequence's rows (a decode row is a chunk of one), positions, tail and
   block table, for ``attention_int4``: a query reads its own block from the residual, earlier blocks from int4;
3. ``slots`` (T, 2): where each row's K and V go in its sequence's tail (-1 where its block completed), for
   ``store_tail_int4`` after attention.

Every layer of a model shares one KV head count and head_dim (the pool's units are one size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from server import kv_int4
from server.attention.base import AttentionBackend, AttentionSpec
from server.batch import StepInputs


@dataclass
class Int4Meta:
    completed: Tensor  # (N, 5) int64
    chunks: Tensor  # (N, 5) int64
    tables: Tensor  # (N, blocks) int64
    slots: Tensor  # (T, 2) int64


class Int4Backend(AttentionBackend):
    name = "int4"
    features = frozenset({"window", "softcap"})

    @staticmethod
    def kv_shape(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (layers, blocks, kv_int4.unit_bytes(block_size, kv_heads, head_dim))

    def __init__(self, kv_storage: Tensor, block_size: int, specs: list[AttentionSpec], ops,
                 kv_scales: Tensor | None = None, kv_rotation: tuple[int, int] = (0, 0)):
        if kv_scales is not None or kv_rotation != (0, 0):
            raise ValueError("the int4 backend reads the int4 pool's units; it takes no scales or rotation")
        shapes = {(s.kv_heads, s.head_dim) for s in specs}
        if len(shapes) != 1:
            raise ValueError(f"an int4 KV pool holds one KV head count and head_dim; the layers have {sorted(shapes)}")
        (kvh, d), = shapes
        want = self.kv_shape(len(specs), kv_storage.shape[1], block_size, kvh, d)
        if tuple(kv_storage.shape) != want or kv_storage.dtype != torch.uint8:
            raise ValueError(f"int4 KV storage must be {want} uint8, got {tuple(kv_storage.shape)} {kv_storage.dtype}")
        self.units = kv_storage
        self.specs = specs
        self.ops = ops
        self.block_size = block_size

    def prepare(self, step: StepInputs) -> Int4Meta:
        bs = self.block_size
        if step.tails is None or len(step.tails) != len(step.decode) + len(step.chunks):
            raise ValueError("an int4 step needs each row's sequence's tail (StepInputs.tails)")
        rows = [(i, 1, p, table) for i, (p, table) in enumerate(step.decode)]
        rows += [(t0, c, start, table) for t0, c, start, table in step.chunks]
        completed, chunks, tables = [], [], []
        slots = [(-1, -1)] * sum(n for _, n, _, _ in rows)
        for (row, n, start, table), tail in zip(rows, step.tails):
            done, tail_slots = kv_int4.chunk_writes(start, n, row, table, tuple(tail), bs)
            completed += done
            slots[row: row + n] = tail_slots
            chunks.append((row, n, start, *tail))
            tables.append(table[: -(-(start + n) // bs)])
        width = max(len(t) for t in tables)
        i64 = dict(dtype=torch.int64, device=step.input_ids.device)
        return Int4Meta(
            completed=torch.tensor(completed, **i64).view(-1, 5), chunks=torch.tensor(chunks, **i64).view(-1, 5),
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i64),
            slots=torch.tensor(slots, **i64).view(-1, 2),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: int, meta: Int4Meta) -> Tensor:
        spec, units, bs = self.specs[layer], self.units[layer], self.block_size
        if meta.completed.shape[0]:
            self.ops.store_blocks_int4(k, v, units, meta.completed, bs)
        out = self.ops.attention_int4(q, k, v, units, meta.chunks, meta.tables, bs, spec.window or 0, spec.scale,
                                      spec.softcap or 0.0)
        self.ops.store_tail_int4(k, v, units, meta.slots, bs)
        return out
