"""Whole quantized Linears for a few rows in one C++ call each (``quant/runtime/kernels/csrc/rows_ops.cpp``): the ``rows`` path of
the W8A8, weight-only int8 and int4 runtime Linears (``quant.runtime.linear``, ``quant.runtime.int4``) and of unquantized bf16 and fp32 ones
(``quant.runtime.kernel_choice.dense_paths``), which their kernel plans take where it is the fastest.

At batch 1 a quantized Linear's eager form is a dozen small ATen ops, each costing about what its arithmetic does,
and on CPUs without VNNI ``torch._int_mm`` is far slower than a float product; one pass over the quantized weight,
with the activation quantization and the rescale folded in, reads a fraction of a bf16 weight's bytes in one call.

:func:`w8a8` equals the module's ``_int_mm`` path bit for bit (a rotated module's too: :func:`hadamard_` makes the
same sums); :func:`int8_weight`, :func:`int4` and :func:`dense`
round once, in fp32, and are held to their modules' fp32 references (tests/test_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from quant.runtime import primitives as P
from quant.runtime.kernels.native import Extension

_CSRC = Path(__file__).with_name("csrc")
EXTENSION = Extension([_CSRC / "rows_ops.cpp", _CSRC / "int4_a8_ops.cpp"], "quantserve_rows_ops")
unavailable_reason = EXTENSION.unavailable_reason
Rows = Callable[[torch.Tensor], torch.Tensor]


def available(t: torch.Tensor) -> bool:
    """Whether the C++ ops can compute a module whose weight is ``t`` (a CPU tensor, the extension built)."""
    return t.device.type == "cpu" and EXTENSION.load()


def staging_bytes(m: int, k: int) -> int:
    """What a rows op holds besides its output while it runs on (m, K) x, at most: x widened to fp32 (W8A8 holds
    it as int16 instead; the int4 ops on int8 or int16 activations hold it quantized, under 2.25 bytes a value with
    its block scales and group sums, and one row widened to fp32), plus, for int4, per-group sums of x and one
    (m, 64) fp32 block per thread. C++ vectors, which quant.shape.memory's MemoryTracker (it sees op outputs) cannot
    see: the engine adds this to what it tracks."""
    return 4 * m * k + 4 * k + 4 * m * (k // 32 + 64 * torch.get_num_threads())


def _op(name: str):
    """The op's one overload (called directly: the overload packet's resolution costs ~a microsecond a call)."""
    if not EXTENSION.load():
        raise RuntimeError(f"quant.runtime.kernels.rows needs its C++ ops: {EXTENSION.unavailable_reason()}")
    return getattr(torch.ops.quantserve_rows, name).default


def _opt(t: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32) if t is None else t


# Each function below binds a module's tensors once and returns its call: (M, K) contiguous -> (M, N). At one row
# a call is a few microseconds of arithmetic, so what is per call and what is per module matters.

def w8a8(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
         smooth: torch.Tensor | None, bias: torch.Tensor | None, rotate: int = 0) -> Rows:
    """In x's dtype: x (/ smooth, then rotated in blocks of ``rotate`` where not 0: quant.runtime.hadamard) quantized per row
    (``input_scale`` None) or by the static scale, times the (N, K) int8 weight, rescaled by s_x * weight_scale in
    fp32, plus the fp32 bias."""
    op, s, sm, b = _op("w8a8_rows"), _opt(input_scale), _opt(smooth), _opt(bias)
    qmax, floor = float(P.QMAX), float(P.MIN_SCALE)
    return lambda x2: op(x2, weight, weight_scale, s, sm, b, qmax, floor, rotate)


class Product:
    """A rows op bound to a module's tensors: ``(M, K) -> (M, N)``, and the same product ending in an epilogue inside
    its one call (``csrc/epilogue.h``, the glue ops' own row kernels, so the glue ops' bits): :meth:`gated` and
    :meth:`normed`, what a decode step's MLP and residual glue become where every projection has them
    (server/models/base.py's one-row forward)."""

    def __init__(self, name: str, *args):
        self.name, self.args = name, args
        self._op = _op(name)

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        return self._op(x2, *self.args)

    def gated(self, act: str) -> Rows:
        """For a [gate | up] product (M, 2I): act(gate) * up (M, I), ``act`` a glue op's name ("silu_mul",
        "gelu_tanh_mul"; the op refuses any other)."""
        op, args = _op(self.name + "_gated"), self.args
        return lambda x2: op(x2, *args, act)

    def normed(self, weight: torch.Tensor | None, eps: float, post: tuple[torch.Tensor, float] | None = None,
               scale: float = 1.0) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``(x2, residual) -> (residual + y', rms_norm(residual + y') * weight)``, y' the product put through the
        output norm ``post`` (weight, eps) and times ``scale``; with no ``weight`` the second result is the first
        (quant.runtime.kernels.triton_ops.AddNorm's steps, the GPU's)."""
        op, args = _op(self.name + "_normed"), self.args
        pw, pe = (None, 0.0) if post is None else (post[0], float(post[1]))
        return lambda x2, residual: op(x2, *args, residual, weight, float(eps), pw, pe, float(scale))


def int4(packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool], scales_zeros: torch.Tensor,
         group_size: int, bias: torch.Tensor | None) -> Product:
    """In x's dtype, x in the kernel's column order, read straight from the CPU int4pack layout (``layout``: block
    rows, split nibbles; see ``quant.runtime.kernels.int4_layout.cpu_layout``) and its (G, N, 2) scale/zero table: per group
    s * (x . codes) + (z - 8 s) * sum(x), in fp32, plus the fp32 bias, rounded once."""
    block, split = layout
    return Product("int4_rows", packed, n, k, block, split, scales_zeros.contiguous(), group_size, _opt(bias))


def int4_a8(packed: torch.Tensor, n: int, k: int, scales_zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None) -> Product:
    """:func:`int4` with each x row first quantized to int8 in blocks of 32 columns
    (``quant.runtime.primitives.quantize_act_blocks``): exact integer sums of codes times int8 activations, scaled in
    fp32, rounded once. AVX2 builds only (``int4_a8_ops.cpp``), on AVX2's int4pack layout (32-row split blocks)."""
    return Product("int4_rows_a8", packed, n, k, scales_zeros.contiguous(), group_size, _opt(bias), float(P.QMAX),
                   float(P.MIN_SCALE))


def int4_a16(packed: torch.Tensor, n: int, k: int, scales_zeros: torch.Tensor, group_size: int,
             bias: torch.Tensor | None) -> Product:
    """:func:`int4` with each x row first held as int16 in blocks of 32 columns with power-of-two scales
    (``quant.runtime.primitives.quantize_act_blocks16``: a bf16 row exactly, but for elements under 2^-7 of their
    block's max, which keep what lies above 2^-15 of it): exact integer sums of codes times int16 activations (16
    products an instruction where the exact path makes 8), scaled in fp32, rounded once. AVX2 builds only
    (``int4_a8_ops.cpp``), on AVX2's int4pack layout."""
    return Product("int4_rows_a16", packed, n, k, scales_zeros.contiguous(), group_size, _opt(bias))


def dense(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """x @ weight (N, K) ^T (+ the bias in fp32), x and the weight both bf16 or both fp32, in x's dtype: fp32 sums,
    rounded once; x rows two at a time against each weight vector, each row's sums those it has alone."""
    return Product("bf16_rows", weight, _opt(bias))


def int8_weight(weight: torch.Tensor, weight_scale: torch.Tensor, offset: torch.Tensor | None,
                bias: torch.Tensor | None) -> Product:
    """In x's dtype: (x . q) * s - rowsum(x) * offset (+ bias), offset = s * z (None when symmetric), all in fp32,
    rounded once."""
    return Product("int8_weight_rows", weight, weight_scale, _opt(offset), _opt(bias))


def rows16_built() -> bool:
    """Whether the passes on 16-bit block activations (:func:`int4_a16`, :func:`int8_weight16`) are built here: AVX2
    builds without AVX-512, the C++ ops loaded."""
    return EXTENSION.load() and bool(_op("rows16_built")())


def int8_weight16(weight: torch.Tensor, weight_scale: torch.Tensor, offset: torch.Tensor | None,
                  bias: torch.Tensor | None) -> Product:
    """:func:`int8_weight` with each x row first held as int16 in blocks of 32 columns with power-of-two scales
    (``quant.runtime.primitives.quantize_act_blocks16``, as :func:`int4_a16`; K a multiple of 32): exact integer
    sums per block, 16 products an instruction, scaled in fp32, rounded once; within 2^-14 of the exact product's
    largest output. Where :func:`rows16_built`."""
    return Product("int8_weight_rows16", weight, weight_scale, _opt(offset), _opt(bias))


def hadamard_(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (M, K) fp32 or fp64, contiguous, times the block-diagonal normalized Hadamard transform (quant.runtime.hadamard), in
    place: the butterfly the ``w8a8`` pass applies to a rotated module's input, bit for bit."""
    return _op("hadamard_")(x, block)

