"""Projections: a model's Linears (dense, or any scheme's runtime module) bound for direct calls, fused where
parts read the same input, and recorded by role for the engine's weight and activation accounting.

A model groups its Linears by what they read (q/k/v, gate/up) and by role; ``Projections.bind`` returns one
callable per group. Groups fuse into one matmul where the scheme allows (``server.fuse``: at batch 1 on a
small model each kernel call costs about as much in dispatch as in arithmetic); checkpoints that already
store them fused (Phi-3's qkv_proj and gate_up_proj) pass through as single modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quant.layers import QuantizedLinear, WeightOnlyLinear
from server.fuse import fuse_linears

ROLES = ("qkv", "o", "gate_up", "down")  # quant.memory.engine_prefill_bytes keys its transients by these


def bind(mod: nn.Module) -> Callable[[Tensor], Tensor]:
    """A direct call of a projection on a (M, K) contiguous input, without Module.__call__ and the reshapes
    a generic forward needs: the low-bit kernel when it takes this input, the module's own forward otherwise."""
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    if isinstance(mod, WeightOnlyLinear) and mod.bias is None:
        kernel, runs = mod._kernel_matmul, mod.kernel_runs

        def call(x: Tensor) -> Tensor:
            return kernel(x) if runs(x.shape[0], x.dtype) else mod(x)

        return call
    return mod


class Projections:
    """Every projection a model binds, by role; what the engine asks of them for its accounting."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.by_role: dict[str, list[nn.Module]] = {r: [] for r in ROLES}
        self.fused_groups = 0
        self._dequant_cache: dict[tuple, tuple[int, int]] = {}
        self._transients: dict[int, dict[str, int]] = {}

    def bind(self, role: str, mods: list[nn.Module]) -> Callable[[Tensor], Tensor]:
        """One callable computing ``cat([m(x) for m in mods], -1)`` (fused into one matmul where possible)."""
        if len(mods) == 1:
            self.by_role[role].append(mods[0])
            return bind(mods[0])
        fused = fuse_linears(mods)
        if fused is not None:
            self.fused_groups += 1
            self.by_role[role].append(fused)
            return bind(fused)
        self.by_role[role].extend(mods)
        parts = [bind(m) for m in mods]
        return lambda h: torch.cat([p(h) for p in parts], dim=-1)

    def modules(self) -> list[nn.Module]:
        return [m for ms in self.by_role.values() for m in ms]

    def prepare_kernels(self, extra: list[nn.Module]) -> None:
        """Every quantized module in its runtime layout for this dtype (quant's loader prepared them for the
        model's float dtype already; this covers a model built otherwise, and is a no-op when done)."""
        for m in self.quantized_modules(extra):
            m.prepare(self.dtype)

    def quantized_modules(self, extra: list[nn.Module]) -> list[QuantizedLinear]:
        mods = {id(m): m for m in [*extra, *self.modules()] if isinstance(m, QuantizedLinear)}
        return list(mods.values())

    def transients(self, rows: int) -> dict[str, int]:
        """Bytes each role holds beyond its output while it runs on ``rows`` rows: weight-only layers above
        their kernel's row limit (or without a kernel for this dtype) dequantize the weight first, peaking at D
        bytes before the matmul and holding the dequantized weight W during it, so the role adds
        max(W, D - output). D and W are measured once per layer shape with quant.memory's MemoryTracker (each
        scheme dequantizes with its own arithmetic; tracking it is exact)."""
        if rows not in self._transients:
            out = {}
            b = torch.empty((), dtype=self.dtype).element_size()
            for role, mods in self.by_role.items():
                extra = [max(w, d - rows * m.out_features * b) for m in mods
                         if isinstance(m, WeightOnlyLinear) and not m.kernel_runs(rows, self.dtype)
                         for d, w in [self._dequant_peak(m)]]
                out[role] = max(extra, default=0)
            self._transients[rows] = out
        return self._transients[rows]

    def _dequant_peak(self, m: WeightOnlyLinear) -> tuple[int, int]:
        """(peak bytes while dequantizing, bytes of the dequantized weight) for m's shape and class."""
        key = (type(m).__name__, m.out_features, m.in_features)
        if key not in self._dequant_cache:
            from quant.memory import MemoryTracker

            with torch.inference_mode(), MemoryTracker() as mt:
                w = m.dequantized(self.dtype)
            self._dequant_cache[key] = (mt.peak, w.numel() * w.element_size())
        return self._dequant_cache[key]
