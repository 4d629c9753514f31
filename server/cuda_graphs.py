"""CUDA graphs of the decode step: captured at start for batch-size buckets, replayed per step.

A decode-only step of n rows runs the graph of the smallest bucket >= n: the step's token ids, positions and
slots are copied into the graph's static inputs (device to device), its sequence metadata and block tables in
one staged copy, and the graph replays the whole model forward (every layer's kernels, attention included) in one
launch. The rows past n are padding: they read and write one KV block reserved for them (``pad_block``) and their
logits are dropped. Steps with prefill chunks, or more rows than the largest bucket, run eagerly; the eager path
is the reference the graphs are held to (tests/test_cuda.py).

The attention backend must support graphs (``TritonBackend.graph_meta`` / ``update_graph_meta``: static metadata
tensors filled in place, a split-K factor fixed per bucket); the sdpa backend does not (its metadata shapes follow the batch), so with it every step
runs eagerly.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from server.batch import StepInputs

log = logging.getLogger("quantserve.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, backend, block_size: int, max_batch: int, max_blocks: int, pad_block: int,
                 device: torch.device):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        self.width = max_blocks
        self.pad_block = pad_block
        self.device = device
        top = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(top, **i64)
        self.pos = torch.zeros(top, **i64)
        self.slots = torch.full((top,), pad_block * block_size, **i64)
        self.rows = torch.arange(top, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, object]] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every bucket, the largest first (the others reuse its memory pool)."""
        for b in reversed(self.buckets):
            meta = self.backend.graph_meta(b, self.width, self.slots[:b], self.pad_block)
            step = StepInputs(self.ids[:b], self.pos[:b], self.slots[:b], self.rows[:b], [], [], self.block_size)
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):  # warm up outside the capture (Triton compiles, cuBLAS picks its kernels)
                for _ in range(2):
                    self.model.forward(step, self.backend, meta)
            torch.cuda.current_stream(self.device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model.forward(step, self.backend, meta)  # (b, V)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = (g, out, meta)
        torch.cuda.synchronize(self.device)
        log.info("cuda graphs: decode buckets %s captured", ",".join(map(str, self.buckets)))

    def bucket(self, step: StepInputs) -> int | None:
        """The bucket that runs this step, or None (prefill chunks, too many rows, a table past the width)."""
        n = len(step.decode)
        if step.chunks or n == 0 or n > self.buckets[-1]:
            return None
        if max(len(t) for _, t in step.decode) > self.width:
            return None
        return next(b for b in self.buckets if b >= n)

    def run(self, step: StepInputs, b: int) -> Tensor:
        """Replay bucket b's graph for this decode step; the logits (n, V) of its rows."""
        g, out, meta = self.graphs[b]
        n = len(step.decode)
        self.ids[:n].copy_(step.input_ids)
        self.pos[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slots)
        if n < b:  # padding rows: position 0 in the pad block
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].fill_(self.pad_block * self.block_size)
        self.backend.update_graph_meta(meta, step, self.pad_block)  # one staged copy
        g.replay()
        return out[:n]
