"""int8-sym / int8-affine: weight-only int8, per output channel, round-to-nearest; no calibration.

Runtime: ``quant.runtime.int8.Int8WeightLinear`` (PyTorch's int8 weight-only kernel for short 16-bit inputs,
a dequantized matmul otherwise); fusable (q/k/v and gate/up become row views of one tensor).
"""

from __future__ import annotations

from torch import nn

from quant.build.schemes.base import Scheme
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.linear import set_module
from quant.runtime.moe import quantizable_linears


class _Int8Layers:
    """Per-channel RTN, one decoder layer at a time."""

    report = None

    def __init__(self, affine: bool):
        self.affine = affine

    def quantize_layer(self, li: int, layer: nn.Module) -> None:
        for name, lin in quantizable_linears(layer).items():
            set_module(layer, name, Int8WeightLinear.from_float(lin, self.affine))


class Int8Scheme(Scheme):
    runtime = (Int8WeightLinear,)

    def __init__(self, affine: bool):
        self.affine = affine
        self.name = "int8-affine" if affine else "int8-sym"
        zero = "with an int8 zero-point" if affine else "symmetric"
        self.summary = f"int8 weights per output channel, {zero}; float activations"

    def layer_quantizer(self, cfg, model, calib_ids, resolved):
        return _Int8Layers(self.affine)

    def quantize_head(self, cfg, head):
        return Int8WeightLinear.from_float(head, self.affine)

    def linear_bytes(self, n, k, group_size):
        return n * k, 4 * n + (n if self.affine else 0)  # int8 weight; fp32 scales (+ int8 zero-points)

    def served_linear_bytes(self, n, k, group_size, float_bytes):
        w, p = self.linear_bytes(n, k, group_size)
        return w, p + (n * float_bytes if float_bytes < 4 else 0)  # + the scales in the kernel's 16-bit dtype


SCHEMES = (Int8Scheme(affine=False), Int8Scheme(affine=True))
