"""One-pass CPU dequantizers for the runtime Linears' dequantize-then-matmul paths (``quant/runtime/kernels/csrc/dequant_ops.cpp``).

Each function returns W (N, K) in the requested dtype from a module's runtime tensors, by the C++ kernel where it
is built (``quant.runtime.kernels.native``) and by the plain PyTorch reference otherwise; the two are equal bit for bit
(tests/test_dequant.py). The references are what the modules computed before: ``primitives.dequantize_weight``
for int8 and :func:`int4pack_reference` for the int4 kernel layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quant.runtime import primitives as P
from quant.runtime.kernels.native import Extension

EXTENSION = Extension(Path(__file__).with_name("csrc") / "dequant_ops.cpp", "quantserve_dequant_ops")
load = EXTENSION.load
unavailable_reason = EXTENSION.unavailable_reason


def _fast(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and EXTENSION.load()


def int8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(q - zero) * scale per row, rounded to ``dtype``: q (N, K) int8, scale (N,) fp32, zero (N,) int8 or None."""
    if not _fast(q) or dtype == torch.float64:
        return P.dequantize_weight(q, scale, zero, dtype)
    out = torch.empty(q.shape, dtype=dtype)
    empty = q.new_empty(0)
    torch.ops.quantserve_quant.dequant_int8(q, scale, empty if zero is None else zero, out)
    return out


def int4pack(packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool], scales_zeros: torch.Tensor,
             group_size: int, perm: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """W (N, K) in ``dtype`` from the CPU int4pack layout (``layout``: block rows, split nibbles; see
    ``quant.runtime.kernels.int4_layout.cpu_layout``) and its (G, N, 2) scale/zero table: (code - 8) * s + z per group, computed as
    code * s + (z - 8 s) in fp32, column ``perm[c]`` of W being code column c. The C++ path returns a
    transposed view of a contiguous (K, N)."""
    if not _fast(packed):
        return int4pack_reference(packed, n, k, layout, scales_zeros, group_size, perm, dtype)
    out_t = torch.empty((k, n), dtype=dtype)  # W^T: the packed layout runs along N, so this is the contiguous way
    torch.ops.quantserve_quant.dequant_int4pack(packed.contiguous(), n, k, layout[0], layout[1],
                                                scales_zeros.contiguous(), group_size,
                                                packed.new_empty(0, dtype=torch.int64) if perm is None else perm, out_t)
    return out_t.t()  # (N, K) view; a dense matmul takes it at the same speed as a contiguous W (bench/RESULTS.md#cpu-kernels-per-linear-benchlinear_pathspy)


def int4pack_reference(packed, n, k, layout, scales_zeros, group_size, perm, dtype) -> torch.Tensor:
    from quant.runtime.kernels.int4_layout import kernel_codes_cpu

    return int4_codes_reference(kernel_codes_cpu(packed, n, k, layout), scales_zeros, group_size, perm, dtype)


def int4_codes_reference(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """W (N, K) from (N, K) codes in the kernel's column order and the (G, N, 2) scale/zero table."""
    n, k = codes.shape
    s = scales_zeros[..., 0].float().t()[:, :, None]  # (N, G, 1)
    z = scales_zeros[..., 1].float().t()[:, :, None]  # (N, G, 1)
    w = codes.view(n, k // group_size, group_size).float().mul_(s).add_(z - 8 * s).view(n, k)  # kernel order
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm, w)  # column perm[i] of the checkpoint is column i here
    return w.to(dtype)
