"""Weight-only Linears' many-row products in one C++ call each (``quant/runtime/kernels/csrc/gemm_ops.cpp``): the ``gemm`` path
of the CPU int4 (``quant.runtime.int4``) and int8 (``quant.runtime.int8.Int8WeightLinear``) Linears with bf16 activations, and
of bf16 ones where the CPU has no fast bf16 GEMM, which their kernel plans take where it is the fastest (a prefill
chunk's rows).

Each block of W's rows is dequantized once per call, a K-tile at a time, into an L1 tile, which 6-row strips of x
run over: with AVX512-BF16, tiles of bf16 pairs and ``vdpbf16ps`` (the dequantize + oneDNN path's weights and
arithmetic); with AVX2, fp32 tiles and FMAs (the dequantize-to-fp32 path's), in both without writing the
dequantized W through memory (bench/RESULTS.md#cpu-kernels-per-linear-benchlinear_pathspy has them timed). The ops are held to their modules' fp32 references
and to those paths (tests/test_gemm.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from quant.runtime import primitives as P
from quant.runtime.kernels.native import Extension
from quant.runtime.kernels.rows import Rows

EXTENSION = Extension(Path(__file__).with_name("csrc") / "gemm_ops.cpp", "quantserve_gemm_ops")
unavailable_reason = EXTENSION.unavailable_reason
TILE_BYTES = (32 << 10) + 32 * 128  # the largest K-tile of a block's expanded weights (gemm_avx512.h kTileBytes,
# rounded up to the int8 expander's 32-column steps, 128 bytes a column; AVX2's tiles are smaller)
MAX_BLOCK = 64  # the most rows of W per block either kernel uses


def no_kernel_reason() -> str | None:
    """Why a build here would hold no kernel (the tiles are written for AVX2 and AVX-512), or None."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return None
    return f"PyTorch dispatches to {cap} here; the tiled products have AVX2 and AVX-512 kernels only"


@functools.cache
def _build() -> tuple[int, int, bool, int]:
    """(rows per block of W, 0 without a kernel; the int4pack block rows the int4 op reads; whether bf16 weights
    have an op; the K multiple for which W8A8's sums are exact int32 ones, 0 for never), as the extension was
    compiled for this CPU (AVX512-BF16 and VNNI: 64, 64, no, 4; AVX2: 16, 32, yes, 2); nothing is built where it
    would hold no kernel (:func:`no_kernel_reason`)."""
    if no_kernel_reason() is not None or not EXTENSION.load():
        return 0, 0, False, 0
    block, int4_block, dense, exact = torch.ops.quantserve_gemm.gemm_build()
    return block, int4_block, bool(dense), exact


def w8a8_integer_sums(k: int) -> bool:
    """Whether :func:`w8a8` sums a K-column product in int32 (exact: ``torch._int_mm``'s numbers), not fp32."""
    multiple = _build()[3]
    return multiple > 0 and k % multiple == 0


def available(t: torch.Tensor, n: int, k: int, dtype: torch.dtype, int4_layout: tuple[int, bool] | None = None,
              dense: bool = False) -> bool:
    """Whether an op can compute a module of N outputs and K inputs whose weight is ``t`` for ``dtype``
    activations: a CPU tensor, bf16, whole blocks, the extension built with a kernel; K even (the quantized
    weights' tiles take columns in pairs); for int4 (``int4_layout``, as ``quant.runtime.kernels.int4_layout.cpu_layout`` names it) the
    layout the op reads; for a bf16 weight (``dense``), a build that has that op."""
    block, int4_block, has_dense, _ = _build()
    if not (block and t.device.type == "cpu" and dtype == torch.bfloat16 and n % block == 0):
        return False
    if not dense and k % 2:
        return False
    if int4_layout is not None and (int4_layout != (int4_block, True) or n % int4_block):
        return False
    return has_dense or not dense


def tile_dtype() -> torch.dtype:
    """The dtype the tiles hold W in: an op's results are those of the dequantize path in this dtype (bf16 with
    AVX512-BF16, fp32 with AVX2), up to the order of the fp32 sums."""
    return torch.float32 if _build()[2] else torch.bfloat16


def staging_bytes(m: int, k: int) -> int:
    """What an op holds besides its output while it runs on (m, K) x, at most: per thread, one K-tile of a block
    and the fp32 sums of its rows; the AVX2 kernel's x widened to fp32. C++ vectors, which quant.shape.memory's
    MemoryTracker cannot see."""
    return 4 * m * k + torch.get_num_threads() * (min(TILE_BYTES, 128 * k) + 4 * MAX_BLOCK * m)


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32) if bias is None else bias.float().contiguous()


# Each function binds a module's tensors once and returns its call: bf16 (M, K) contiguous -> bf16 (M, N): x @ W^T
# (+ the fp32 bias), W dequantized as quant.runtime.kernels.dequant computes it and rounded to bf16, fp32 sums, rounded once.

def int4(packed: torch.Tensor, n: int, k: int, scales_zeros: torch.Tensor, group_size: int,
         bias: torch.Tensor | None) -> Rows:
    """W from this CPU's int4pack layout (see :func:`available`) and its (G, N, 2) scale/zero table, code * s + (z -
    8 s) (``quant.runtime.kernels.dequant.int4pack``); x in the kernel's column order."""
    op, sz, b = torch.ops.quantserve_gemm.int4_gemm.default, scales_zeros.contiguous(), _bias(bias)
    return lambda x2: op(x2, packed, n, k, sz, group_size, b)


def int8(weight: torch.Tensor, weight_scale: torch.Tensor, zero: torch.Tensor | None,
         bias: torch.Tensor | None) -> Rows:
    """W = (q - zero) * scale per row (``quant.runtime.kernels.dequant.int8``): q (N, K) int8, scale (N,) fp32, zero (N,) int8 or
    None."""
    op, b = torch.ops.quantserve_gemm.int8_gemm.default, _bias(bias)
    z = torch.empty(0, dtype=torch.int8) if zero is None else zero.contiguous()
    return lambda x2: op(x2, weight, weight_scale, z, b)


def w8a8(weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
    """W8A8's product from its quantized activations: (xq (M, K) int8, x_scale (M, 1) or a 0-dim static scale)
    -> bf16 (M, N) = (xq @ q^T) * (x_scale * weight_scale) (+ the fp32 bias), the rescale in W8A8Linear's order,
    rounded once: with AVX512-VNNI (K a multiple of 4) and with AVX2 the exact int32 sums (its int_mm path bit for
    bit), else fp32 sums of the exact products (its fp32 path's numbers)."""
    op, b = torch.ops.quantserve_gemm.w8a8_gemm.default, _bias(bias)
    sums = weight.sum(1, dtype=torch.int32)  # (N,): the VNNI kernel's correction for its unsigned x

    def call(xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        xs = x_scale.float().reshape(-1).expand(xq.shape[0]).contiguous()  # (M,): a static scale per row too
        return op(xq, xs, weight, weight_scale, sums, b)

    return call


def int8_product(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """``primitives.int8_product``'s numbers, xq (M, K) int8 @ wq (N, K)^T int8 -> (M, N) fp32, the exact integer
    sums: where that sums the codes' products in fp32 (no exact ``torch._int_mm``: AVX2 without VNNI), by the AVX2
    build's int16 op instead (its exact int32 sums, converted as int_mm's), which does twice the multiply-adds an
    instruction; elsewhere, or for a shape the op does not take (N not in whole blocks, K odd), that function."""
    block, _, dense, _ = _build()
    n, k = wq.shape
    if dense and xq.device.type == "cpu" and n % block == 0 and k % 2 == 0 and not P.int_mm_is_usable(xq.device):
        return torch.ops.quantserve_gemm.int8_sums(xq.contiguous(), wq.contiguous())
    return P.int8_product(xq, wq)


def bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Rows:
    """A bf16 (N, K) weight, in fp32 (only where that is what the CPU does fastest: see :func:`available`)."""
    op, b = torch.ops.quantserve_gemm.bf16_gemm.default, _bias(bias)
    return lambda x2: op(x2, weight, b)
