"""Fusing Linears that read the same input (q/k/v, gate/up) into one, for the runner's decode step.

At batch 1 on a small model each kernel call costs about as much in dispatch as in arithmetic, so three
projections as one matmul save two calls per layer and read the input once. The fused module's output is the
concatenation of the parts' outputs, exactly: rows of a weight matrix are independent.

Dense weights are fused here: the parts are re-pointed at row slices of the fused tensor (views), so nothing
is stored twice and the model's own modules keep working. A quantized scheme's runtime module fuses its own
kind (``QuantizedLinear.fuse``), or declines (W8A8: one calibrated input scale per Linear).
"""

from __future__ import annotations

import torch
from torch import nn

from quant.runtime.linear import QuantizedLinear, fused_bias, fused_offsets, view_rows


def _fuse_dense(mods: list[nn.Linear]) -> nn.Linear:
    w = mods[0].weight
    fused = nn.Linear(w.shape[1], sum(m.out_features for m in mods), bias=False, device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight.data for m in mods]), requires_grad=False)
    bias = fused_bias(mods, w.dtype)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    # A part without a bias keeps none (its rows of the fused bias are zeros).
    had_bias = [m.bias is not None for m in mods]
    view_rows(mods, fused, ["weight"])
    for m, (a, b), hb in zip(mods, fused_offsets(mods), had_bias):
        if hb:
            m.bias = nn.Parameter(fused.bias.data[a:b], requires_grad=False)
    return fused


def fuse_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)``, or None when these kinds cannot be fused."""
    if len({m.in_features for m in mods}) != 1:
        return None
    if all(type(m) is nn.Linear for m in mods) and len({(m.weight.dtype, m.weight.device) for m in mods}) == 1:
        return _fuse_dense(mods)
    kind = type(mods[0])
    if issubclass(kind, QuantizedLinear) and all(type(m) is kind for m in mods):
        return kind.fuse(mods)
    return None
