"""W4A16 builds: GPTQ (or RTN) layer by layer, written in the GPTQ checkpoint format.

GPTQ runs sequentially: each decoder layer sees the calibration activations produced by the already
quantized layers before it, and inside a layer each group of Linears (q/k/v, then o, then gate/up,
then down) sees inputs computed with the groups before it already quantized (quant.sequential's staged
pass for Llama-shaped layers, one layer pass; the exact pass otherwise). A quantized group computes with
its dequantized weights for the rest of the layer's pass. Memory is bounded by one layer's activations for
the calibration set plus one Hessian (accumulated sample by sample).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from quant import calibration
from quant import gptq as G
from quant.errors import ConfigError
from quant.int4 import PACK, GPTQLinear
from quant.moe import quantizable_linears
from quant.sequential import (
    _cast_kwargs, block_linears, capture_layer_inputs, decoder_layers, layer_pass, layer_plan, set_module,
)
from quant.smooth import layer_groups

GROUP_CHOICES = (128, 64, 32)


def choose_group_size(model: nn.Module, requested: int | None) -> int:
    """128 where it divides every quantized Linear's input dimension, else the largest of 64, 32."""
    linears = block_linears(model)
    for name, lin in linears.items():
        if lin.in_features % PACK or lin.out_features % PACK:
            raise ConfigError(f"{name}: dimensions {lin.in_features}x{lin.out_features} are not multiples of {PACK}")
    if requested is not None:
        for name, lin in linears.items():
            if lin.in_features % requested:
                raise ConfigError(f"--group-size {requested} does not divide {name}'s input dimension {lin.in_features}")
        return requested
    for g in GROUP_CHOICES:
        if all(lin.in_features % g == 0 for lin in linears.values()):
            return g
    raise ConfigError("no group size of 128, 64 or 32 divides every Linear's input dimension; pass --group-size")


class LayerQuantizer:
    """W4A16 one decoder layer at a time, in order: `quantize_layer(li, layer)` swaps the layer's Linears
    for GPTQLinear modules. For GPTQ the calibration inputs of layer 0 are captured on construction (the
    model's embedding must be materialised then) and each layer's output becomes the next one's input.

    method: "gptq" (needs calib_ids) or "rtn". `report` holds the per-Linear figures and the fallbacks.
    """

    def __init__(self, model: nn.Module, calib_ids: torch.Tensor | None, method: str, group_size: int,
                 sym: bool, damp: float, act_order: bool, matmul_dtype: torch.dtype = torch.float32,
                 clip: bool = False):
        self.model, self.method, self.matmul_dtype = model, method, matmul_dtype
        self.group_size, self.sym, self.damp, self.act_order, self.clip = group_size, sym, damp, act_order, clip
        layers = decoder_layers(model)
        self.prefix = next(n for n, m in model.named_modules() if m is layers)
        self.report: dict = {"linears": {}, "fallbacks": []}
        self.hidden, self.kws = capture_layer_inputs(model, calib_ids) if method == "gptq" else (None, None)

    @torch.inference_mode()
    def quantize_layer(self, li: int, layer: nn.Module) -> None:
        linears = quantizable_linears(layer)
        # Packed as soon as each Linear is quantized: its int32 codes would be 8x the packed bytes, and a
        # layer's worth of them (an 8B layer: 0.9 GB) would otherwise be held until the layer is done.
        packed: dict[str, GPTQLinear] = {}
        if self.method == "rtn":
            for n, lin in linears.items():
                q = G.rtn(lin.weight.data, 4, self.group_size, self.sym)
                packed[n] = GPTQLinear.from_quantized(q, lin.bias, v2=not self.sym)
        else:
            kw = _cast_kwargs(self.kws[li], torch.float32)
            lp = layer_plan(self.model, layer, self.hidden, kw)

            def quantize_group(names: tuple[str, ...], inputs: Sequence[torch.Tensor]) -> None:
                hess = G.Hessian(layer.get_submodule(names[0]).in_features)
                for x in inputs:
                    hess.add(x)
                h = hess.value()
                need = calibration.min_rows(hess.k)
                for n in names:
                    lin = layer.get_submodule(n)
                    t = time.perf_counter()
                    if hess.n < need:  # a MoE expert the calibration set hardly routes to
                        q = G.rtn(lin.weight.data, 4, self.group_size, self.sym)
                        q.fallback = f"{hess.n} calibration tokens reached it, fewer than the {need} GPTQ needs here"
                    else:
                        q = G.gptq(lin.weight.data, h, 4, self.group_size, self.sym, self.damp, self.act_order,
                                   grid=G.Grid.uint(4, self.sym, self.clip))
                    full = f"{self.prefix}.{li}.{n}"
                    packed[n] = GPTQLinear.from_quantized(q, lin.bias, v2=not self.sym)
                    self.report["linears"][full] = {
                        "damp": q.damp, "loss": q.error, "fallback": q.fallback, "seconds": time.perf_counter() - t,
                    }
                    if q.fallback:
                        self.report["fallbacks"].append({"module": full, "reason": q.fallback})
                    lin.weight.data = q.dequantize().to(lin.weight.dtype)  # what the next groups see
                    del q

            self.hidden = layer_pass(layer, self.hidden, kw, quantize_group, lp, layer_groups(layer, lp),
                                     self.matmul_dtype)
        for n in linears:
            set_module(layer, n, packed.pop(n))
