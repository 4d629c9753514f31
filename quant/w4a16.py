"""W4A16 builds: GPTQ (or RTN) layer by layer, written in the GPTQ checkpoint format.

GPTQ runs sequentially: each decoder layer sees the calibration activations produced by the already
quantized layers before it, and inside a layer each group of Linears (q/k/v, then o, then gate/up,
then down) sees inputs computed with the groups before it already quantized. For Llama-shaped layers
(quant.families says which) the layer is executed in stages (norm -> attention -> o -> norm -> MLP up to
down -> down), each stage once, after the weights it uses are quantized: the same result as re-running the
layer between groups, at the cost of one layer pass. Other layer shapes re-run the whole layer per group.
Memory is bounded by one layer's activations for the calibration set plus one Hessian.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from quant import calibration
from quant import gptq as G
from quant.errors import ConfigError
from quant.families import LayerPlan
from quant.int4 import PACK, GPTQLinear
from quant.moe import quantizable_linears
from quant.sequential import (
    _StopForward, _cast_kwargs, block_linears, capture_inputs, capture_layer_inputs, decoder_layers,
    layer_plan, run_layer, set_module,
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


def _stop(_mod, _args):
    raise _StopForward


class _Hessian:
    """Streaming H = 2 X^T X / n in fp32."""

    def __init__(self, k: int):
        self.k, self.h, self.n = k, None, 0  # h is allocated on the device of the first batch

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (rows, K)
        if self.h is None:
            self.h = torch.zeros(self.k, self.k, device=x.device)
        self.h.addmm_(x.t(), x)
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        """H, scaled in place (the accumulator is done with): no second K x K copy."""
        if self.h is None:
            return torch.zeros(self.k, self.k)
        return self.h.mul_(2.0 / max(self.n, 1))


@torch.inference_mode()
def _staged(layer: nn.Module, hidden: torch.Tensor, kw: dict, quantize_group: Callable, lp: LayerPlan) -> torch.Tensor:
    """One pass over the calibration set with each group quantized right before its stage: for layers
    h' = h + r * attn(norm1(h)); out = h' + r * mlp(norm2(h')) (lp.staged)."""
    fam, r = lp.family, lp.residual_scale
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.get_submodule(fam.attn_norm), layer.get_submodule(fam.mlp_norm)
    o_proj, down_proj = layer.get_submodule(fam.o), layer.get_submodule(fam.down)
    samples = range(hidden.shape[0])
    # Stage 1: q/k/v read norm1(h).
    h_qkv = _Hessian(hidden.shape[-1])
    for s in samples:
        h_qkv.add(norm1(hidden[s : s + 1]))
    quantize_group(fam.qkv, h_qkv)
    # Stage 2: attention with quantized q/k/v, stopped at o_proj's input.
    attn_in = []
    with capture_inputs({"o": o_proj}) as store:
        stop = o_proj.register_forward_pre_hook(_stop)
        try:
            for s in samples:
                try:
                    attn(hidden_states=norm1(hidden[s : s + 1]), **kw)
                except _StopForward:
                    pass
        finally:
            stop.remove()
        attn_in = store["o"]  # S x (T, K)
    h_o = _Hessian(attn_in[0].shape[-1])
    for x in attn_in:
        h_o.add(x)
    quantize_group((fam.o,), h_o)
    # Stage 3: residual + r * o_proj, then norm2 feeds gate/up.
    mid = torch.cat([hidden[s : s + 1] + r * o_proj(attn_in[s]).reshape(hidden[s : s + 1].shape) for s in samples])
    del attn_in
    h_gu = _Hessian(mid.shape[-1])
    for s in samples:
        h_gu.add(norm2(mid[s : s + 1]))
    quantize_group(fam.gate_up, h_gu)
    # Stage 4: the MLP up to down_proj's input.
    with capture_inputs({"down": down_proj}) as store:
        stop = down_proj.register_forward_pre_hook(_stop)
        try:
            for s in samples:
                try:
                    mlp(norm2(mid[s : s + 1]))
                except _StopForward:
                    pass
        finally:
            stop.remove()
        down_in = store["down"]
    h_d = _Hessian(down_in[0].shape[-1])
    for x in down_in:
        h_d.add(x)
    quantize_group((fam.down,), h_d)
    # Stage 5: the layer's output.
    return torch.cat([mid[s : s + 1] + r * down_proj(down_in[s]).reshape(mid[s : s + 1].shape) for s in samples])


@torch.inference_mode()
def _exact(layer: nn.Module, hidden: torch.Tensor, kw: dict, quantize_group: Callable, lp: LayerPlan) -> torch.Tensor:
    """The layer's own forward re-run for each group (any layer shape)."""
    for g in layer_groups(layer, lp):
        first = layer.get_submodule(g.linears[0])
        h = _Hessian(first.in_features)
        with capture_inputs({"x": first}) as store:
            run_layer(layer, hidden, kw)
        for x in store["x"]:
            h.add(x)
        quantize_group(g.linears, h)
    return run_layer(layer, hidden, kw)


class LayerQuantizer:
    """W4A16 one decoder layer at a time, in order: `quantize_layer(li, layer)` swaps the layer's Linears
    for GPTQLinear modules. For GPTQ the calibration inputs of layer 0 are captured on construction (the
    model's embedding must be materialised then) and each layer's output becomes the next one's input.

    method: "gptq" (needs calib_ids) or "rtn". `report` holds the per-Linear figures and the fallbacks.
    """

    def __init__(self, model: nn.Module, calib_ids: torch.Tensor | None, method: str, group_size: int,
                 sym: bool, damp: float, act_order: bool):
        self.model, self.method = model, method
        self.group_size, self.sym, self.damp, self.act_order = group_size, sym, damp, act_order
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

            def quantize_group(names, hess: _Hessian):
                h = hess.value()
                need = calibration.min_rows(hess.k)
                for n in names:
                    lin = layer.get_submodule(n)
                    t = time.perf_counter()
                    if hess.n < need:  # a MoE expert the calibration set hardly routes to
                        q = G.rtn(lin.weight.data, 4, self.group_size, self.sym)
                        q.fallback = f"{hess.n} calibration tokens reached it, fewer than the {need} GPTQ needs here"
                    else:
                        q = G.gptq(lin.weight.data, h, 4, self.group_size, self.sym, self.damp, self.act_order)
                    full = f"{self.prefix}.{li}.{n}"
                    packed[n] = GPTQLinear.from_quantized(q, lin.bias, v2=not self.sym)
                    self.report["linears"][full] = {
                        "damp": q.damp, "loss": q.error, "fallback": q.fallback, "seconds": time.perf_counter() - t,
                    }
                    if q.fallback:
                        self.report["fallbacks"].append({"module": full, "reason": q.fallback})
                    lin.weight.data = q.dequantize().to(lin.weight.dtype)  # what the next groups see
                    del q

            self.hidden = (_staged if lp.staged else _exact)(layer, self.hidden, kw, quantize_group, lp)
        for n in linears:
            set_module(layer, n, packed.pop(n))
