"""One engine step's flat batch: what the runner prepares and the model and attention backend read.

A step is T tokens from many requests: one per decoding request (the decode rows come first), then a chunk of
prompt per prefilling request. Linears see all T as one (T, hidden) matrix; attention needs to know which
request each token belongs to, which is what the per-request lists say. How K/V slots are gathered or read
through the block tables is the attention backend's business (``server.attention``), prepared once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def stage(values: list, dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """A host list as a tensor on ``device``: on CUDA through a pinned staging buffer and a non-blocking copy, so
    building a step's inputs never waits for the GPU (a copy from pageable memory synchronises). The caching host
    allocator keeps the buffer alive until the copy has run."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class StepInt(int):
    """An integer of one step (a prefill chunk's first position) that an op takes as a plain int, with the (1,)
    int64 tensor holding it: a recorded step program (server/cpu_graphs.py) reads it from that tensor, as it reads
    the step's other inputs, where a plain int would be a constant of the program."""

    tensor: Tensor

    def __new__(cls, value: int, device: torch.device | str | None = None) -> "StepInt":
        self = super().__new__(cls, value)
        self.tensor = torch.tensor([value], dtype=torch.int64, device=device)
        return self


@dataclass
class StepInputs:
    input_ids: Tensor  # (T,) int64
    positions: Tensor  # (T,) int64
    slots: Tensor  # (T,) int64: where each token's K/V is written (slot = block * block_size + offset)
    sample_index: Tensor  # (S,) int64: the token rows whose logits are returned, in order
    decode: list[tuple[int, list[int]]]  # per decode row (token row i): (its position, its block table)
    chunks: list[tuple[int, int, int, list[int]]]  # per prefill chunk: (first row in T, length C, first position, table)
    block_size: int
    # per decode row, then per prefill chunk: its sequence's tail blocks (int4's residual: K, V); None for other pools
    tails: list[list[int]] | None = None
    # (P,) int64: prompt rows whose next token is scored (prompt logprobs); the model leaves their final-normed
    # hidden states (P, hidden) in ``scored`` for the runner's head, which runs over them in slices
    score_index: Tensor | None = None
    scored: Tensor | None = None

    @property
    def num_decode(self) -> int:
        return len(self.decode)
