"""Fusing Linears that read the same input (q/k/v, gate/up) into one, for the runner's decode step.

At batch 1 on a small model each kernel call costs about as much in dispatch as in arithmetic, so three
projections as one matmul save two calls per layer and read the input once. The fused module's output is the
concatenation of the parts' outputs, exactly: rows of a weight matrix are independent.

Memory: for dense and int8 weights the parts are re-pointed at row slices of the fused tensor (views), so
nothing is stored twice and the model's own modules keep working. GPTQ tensors pack along the output axis
in columns, so the fused module gets its own kernel repack and the parts drop theirs (they fall back to
their dequantizing path if called directly). W8A8 Linears are not fused: each calibrated its own static
input scale, so sharing one input quantization would change the numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.int4 import GPTQLinear
from quant.layers import Int8WeightLinear


def _offsets(mods) -> list[tuple[int, int]]:
    spans, a = [], 0
    for m in mods:
        spans.append((a, a + m.out_features))
        a += m.out_features
    return spans


def _cat_bias(mods, dtype) -> torch.Tensor | None:
    biases = [m.bias for m in mods if m.bias is not None]
    if not biases:
        return None
    dev = biases[0].device
    return torch.cat([
        m.bias.data.to(dtype) if m.bias is not None else torch.zeros(m.out_features, dtype=dtype, device=dev)
        for m in mods
    ])


def _view_rows(mods, fused, names) -> None:
    """Point each part's tensors at its rows of the fused tensors (no copy kept)."""
    for m, (a, b) in zip(mods, _offsets(mods)):
        for n in names:
            t = getattr(fused, n)
            if t is None:
                continue
            if isinstance(getattr(m, n), nn.Parameter):
                setattr(m, n, nn.Parameter(t.data[a:b], requires_grad=False))
            else:
                setattr(m, n, t[a:b])


def _fuse_dense(mods: list[nn.Linear]) -> nn.Linear:
    w = mods[0].weight
    fused = nn.Linear(w.shape[1], sum(m.out_features for m in mods), bias=False, device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight.data for m in mods]), requires_grad=False)
    bias = _cat_bias(mods, w.dtype)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    # A part without a bias keeps none (its rows of the fused bias are zeros).
    had_bias = [m.bias is not None for m in mods]
    _view_rows(mods, fused, ["weight"])
    for m, (a, b), hb in zip(mods, _offsets(mods), had_bias):
        if hb:
            m.bias = nn.Parameter(fused.bias.data[a:b], requires_grad=False)
    return fused


def _fuse_int8(mods: list[Int8WeightLinear]) -> Int8WeightLinear:
    bias = _cat_bias(mods, torch.float32)
    fused = Int8WeightLinear(mods[0].in_features, sum(m.out_features for m in mods), bias is not None,
                             mods[0].affine, device="meta")
    fused.weight = torch.cat([m.weight for m in mods])
    fused.weight_scale = torch.cat([m.weight_scale for m in mods])
    if mods[0].affine:
        fused.weight_zero_point = torch.cat([m.weight_zero_point for m in mods])
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    _view_rows(mods, fused, ["weight", "weight_scale", "weight_zero_point"])
    return fused


def _fuse_gptq(mods: list[GPTQLinear]) -> GPTQLinear | None:
    first = mods[0]
    if any(m.group_size != first.group_size or m.v2 != first.v2 or not torch.equal(m.g_idx, first.g_idx)
           for m in mods):
        return None  # different group assignments (act-order with a permuted g_idx) cannot share a kernel call
    bias = _cat_bias(mods, torch.float32)
    fused = GPTQLinear(first.in_features, sum(m.out_features for m in mods), bias is not None, first.group_size,
                       first.v2, device="meta")
    fused.qweight = torch.cat([m.qweight for m in mods], dim=1)  # (K/8, N) packs along K: columns concatenate
    fused.qzeros = torch.cat([m.qzeros for m in mods], dim=1)  # (G, N/8)
    fused.scales = torch.cat([m.scales for m in mods], dim=1)  # (G, N)
    fused.g_idx = first.g_idx.clone()
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    fused.prepare()
    for m in mods:
        m._packed = None  # the fused module holds the only kernel copy
    return fused


def fuse_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)``, or None when these kinds cannot be fused."""
    if len({m.in_features for m in mods}) != 1:
        return None
    if all(type(m) is nn.Linear for m in mods) and len({(m.weight.dtype, m.weight.device) for m in mods}) == 1:
        return _fuse_dense(mods)
    if all(type(m) is Int8WeightLinear for m in mods) and len({m.affine for m in mods}) == 1:
        return _fuse_int8(mods)
    if all(type(m) is GPTQLinear for m in mods) and all(m.out_features % 8 == 0 for m in mods):
        return _fuse_gptq(mods)
    return None
