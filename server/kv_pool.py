"""The KV cache pool: preallocated from a memory budget, handed out in fixed-size blocks.

A request reserves, when admitted, every block it can ever need: (prompt + max_new_tokens) tokens
rounded up to whole blocks. Reserving the worst case up front is what lets the engine promise it
never runs out of KV memory because of a request it accepted; the price is that a request stopping
early held blocks it did not use, which is why they are released the moment it finishes or is
cancelled, and why its accounting reports both reserved and used bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.memory import ModelShape, kv_bytes_per_token


class KVBudgetError(ValueError):
    """The budget cannot hold even one block, or is not a valid size."""


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, block_size: int = 16) -> "KVLayout":
        s = ModelShape.from_config(config)
        return cls(s.layers, s.kv_heads, s.head_dim, dtype, block_size)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * layers * kv_heads * head_dim * bytes(dtype): quant.memory's formula."""
        shape = ModelShape(self.layers, 1, 1, self.kv_heads, self.kv_heads, self.head_dim, 1)
        return kv_bytes_per_token(shape, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


def budget_fraction(spec: str | int | float) -> float | None:
    """The fraction a budget spec asks for ("0.3"), or None for a byte count."""
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value < 1.0 and "." in text else None


def free_memory(device: torch.device | str = "cpu") -> int:
    """Bytes free on the device right now (CUDA: the driver's count; CPU: available RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def resolve_budget(spec: str | int | float, device: torch.device | str = "cpu") -> int:
    """Bytes for the pool: an integer byte count ("2147483648", "2GiB") or a fraction of the memory
    free right now ("0.3"). Invalid specs are errors, not silently clamped."""
    from quant.memory import parse_bytes

    text = str(spec).strip()
    value = budget_fraction(text)
    if value is not None:
        return int(free_memory(device) * value)
    try:
        nbytes = parse_bytes(text)
    except ValueError as e:
        raise KVBudgetError(f"--memory-budget: {e}; or a fraction of free memory in (0, 1)") from e
    if nbytes <= 0:
        raise KVBudgetError(f"--memory-budget must be positive, got {spec!r}")
    return nbytes


class BlockPool:
    """Fixed-size blocks of KV storage with all-or-nothing reservations per request."""

    def __init__(self, layout: KVLayout, budget_bytes: int, device: torch.device | str = "cpu",
                 allocate: bool = True):
        self.layout = layout
        self.num_blocks = budget_bytes // layout.bytes_per_block
        if self.num_blocks < 1:
            raise KVBudgetError(
                f"KV budget of {budget_bytes} bytes holds no block of {layout.block_size} tokens "
                f"({layout.bytes_per_block} bytes)"
            )
        # (layers, 2, blocks, block_size, kv_heads, head_dim): one contiguous allocation, made once.
        self.storage = (
            torch.zeros(layout.layers, 2, self.num_blocks, layout.block_size, layout.kv_heads, layout.head_dim,
                        dtype=layout.dtype, device=device)
            if allocate else None
        )
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: reuse the warmest blocks first
        self._owned: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_ever_fit(self, tokens: int) -> bool:
        return self.layout.blocks_for(tokens) <= self.num_blocks

    def try_reserve(self, request_id: str, tokens: int) -> list[int] | None:
        """Reserve every block `tokens` can need, or nothing (None) if they are not free now."""
        if request_id in self._owned:
            raise ValueError(f"request {request_id} already holds KV blocks")
        need = self.layout.blocks_for(tokens)
        if need > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(need)]
        self._owned[request_id] = blocks
        return blocks

    def release(self, request_id: str) -> int:
        """Free a request's blocks at once; returns how many. Releasing twice is harmless."""
        blocks = self._owned.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def blocks_of(self, request_id: str) -> list[int]:
        return self._owned[request_id]

    def stats(self) -> dict:
        return {
            "block_size": self.layout.block_size,
            "bytes_per_token": self.layout.bytes_per_token,
            "capacity_blocks": self.num_blocks,
            "capacity_bytes": self.capacity_bytes,
            "used_blocks": self.used_blocks,
            "used_bytes": self.used_blocks * self.layout.bytes_per_block,
            "requests": len(self._owned),
        }
