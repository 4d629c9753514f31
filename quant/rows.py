"""Whole quantized Linears for a few rows in one C++ call each (``quant/csrc/rows_ops.cpp``): the ``rows`` path of
the W8A8, weight-only int8 and int4 runtime Linears (``quant.layers``, ``quant.int4``) and of unquantized bf16 ones
(``quant.kernel_choice.dense_paths``), which their kernel plans take where it is the fastest.

At batch 1 a quantized Linear's eager form is a dozen small ATen ops, each costing about what its arithmetic does,
and on CPUs without VNNI ``torch._int_mm`` is far slower than a float product; one pass over the quantized weight,
with the activation quantization and the rescale folded in, reads a fraction of a bf16 weight's bytes in one call.

:func:`w8a8` equals the module's ``_int_mm`` path bit for bit; :func:`int8_weight`, :func:`int4` and :func:`bf16`
round once, in fp32, and are held to their modules' fp32 references (tests/test_rows.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from quant import primitives as P
from quant.native import Extension

_EXT = Extension(Path(__file__).with_name("csrc") / "rows_ops.cpp", "quantserve_rows_ops")
unavailable_reason = _EXT.unavailable_reason


def available(t: torch.Tensor) -> bool:
    """Whether the C++ ops can compute a module whose weight is ``t`` (a CPU tensor, the extension built)."""
    return t.device.type == "cpu" and _EXT.load()


def _ready() -> None:
    if not _EXT.load():
        raise RuntimeError(f"quant.rows needs its C++ ops: {_EXT.unavailable_reason()}")


def _opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32) if t is None else t


def w8a8(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
         smooth: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) contiguous -> (M, N) in x's dtype: x (/ smooth) quantized per row (``input_scale`` None) or by the
    static scale, times the (N, K) int8 weight, rescaled by s_x * weight_scale in fp32, plus the fp32 bias."""
    _ready()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype)
    torch.ops.quantserve_rows.w8a8_rows(x2, weight, weight_scale, _opt(input_scale, x2), _opt(smooth, x2),
                                        _opt(bias, x2), float(P.QMAX), float(P.MIN_SCALE), out)
    return out


def int4(x2: torch.Tensor, packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool],
         scales_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) contiguous, in the kernel's column order -> (M, N) in x's dtype, read straight from the CPU int4pack
    layout (``layout``: block rows, split nibbles; see ``quant.int4._cpu_layout``) and its (G, N, 2) scale/zero
    table: per group s * (x . codes) + (z - 8 s) * sum(x), in fp32, plus the fp32 bias, rounded once."""
    _ready()
    out = torch.empty((x2.shape[0], n), dtype=x2.dtype)
    torch.ops.quantserve_rows.int4_rows(x2, packed, n, k, layout[0], layout[1], scales_zeros.contiguous(), group_size,
                                        _opt(bias, x2), out)
    return out


def bf16(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) bf16 contiguous @ weight (N, K) bf16 ^T (+ the bias in fp32) -> (M, N) bf16: fp32 sums, rounded once."""
    _ready()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    torch.ops.quantserve_rows.bf16_rows(x2, weight, _opt(bias, x2), out)
    return out


def int8_weight(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, offset: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) contiguous -> (M, N) in x's dtype: (x . q) * s - rowsum(x) * offset (+ bias), offset = s * z (None
    when symmetric), all in fp32, rounded once."""
    _ready()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype)
    torch.ops.quantserve_rows.int8_weight_rows(x2, weight, weight_scale, _opt(offset, x2), _opt(bias, x2), out)
    return out
