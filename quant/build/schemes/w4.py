"""w4a16 (GPTQ) and rtn-w4: 4-bit weights in groups along the input, 16-bit activations, written in the GPTQ
checkpoint format (transformers + gptqmodel, optimum and vLLM load it; so does ``quant.load`` a GPTQ
checkpoint from elsewhere).

Runtime: ``quant.runtime.int4.GPTQLinear`` (PyTorch's int4 kernels on a layout repacked once at load); fusable (the
fused module holds the one kernel copy). Act-order uses static groups, so ``g_idx`` stays ``k // group``.

The build runs GPTQ (or RTN) sequentially: each decoder layer sees the calibration activations produced by the
already quantized layers before it, and inside a layer each group of Linears (q/k/v, then o, then gate/up,
then down) sees inputs computed with the groups before it already quantized (``quant.build.sequential``'s staged
pass for Llama-shaped layers, one layer pass; the exact pass otherwise). A quantized group computes with
its dequantized weights for the rest of the layer's pass. Memory is bounded by one layer's activations for
the calibration set plus one Hessian (accumulated sample by sample).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch
from torch import nn

from quant.build import calibration
from quant.build import gptq as G
from quant.build.schemes.base import Scheme
from quant.build.sequential import (
    _cast_kwargs,
    block_linears,
    capture_layer_inputs,
    decoder_layers,
    layer_pass,
    layer_plan,
)
from quant.build.smooth import layer_groups
from quant.errors import ConfigError
from quant.runtime.int4 import GPTQLinear, repacked_on_cpu
from quant.runtime.kernels.int4_layout import PACK
from quant.runtime.linear import set_module
from quant.runtime.moe import quantizable_linears

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


class GPTQScheme(Scheme):
    runtime = (GPTQLinear,)
    no_head_because = "the GPTQ format keeps lm_head in float"
    options = ("group_size", "asym")

    def __init__(self, method: str):
        self.method = method
        self.name = "w4a16" if method == "gptq" else "rtn-w4"
        self.needs_calibration = method == "gptq"
        if method == "gptq":
            self.options = (*self.options, "calib", "damp", "act_order", "clip_search")
        self.summary = f"4-bit weights in groups ({'GPTQ' if method == 'gptq' else 'round-to-nearest'}), 16-bit activations"

    def resolve(self, cfg, model):
        return {"group_size": choose_group_size(model, cfg.group_size)}

    def layer_quantizer(self, cfg, model, calib_ids, resolved):
        return LayerQuantizer(model, calib_ids, self.method, resolved["group_size"], not cfg.asym, cfg.damp,
                                    cfg.act_order, cfg.matmul_torch_dtype(cfg.torch_device()), cfg.clip_search)

    def parameters(self, cfg, resolved, report):
        gs = resolved["group_size"]
        return {
            "bits": 4, "group_size": gs, "sym": not cfg.asym,
            "damp": cfg.damp if self.method == "gptq" else None,
            "act_order": cfg.act_order if self.method == "gptq" else None,
            "clip_search": cfg.clip_search if self.method == "gptq" else None,
            "checkpoint_format": _format(cfg.asym),
            "rtn_fallbacks": report["fallbacks"],
            "weight_granularity": f"per-output-channel, groups of {gs} inputs",
        }

    def quantization_config(self, cfg, resolved, modules):
        """The standard GPTQ `quantization_config` (transformers/gptqmodel, optimum, vLLM).

        Act-order uses static groups here, so g_idx is the trivial k // group and loaders are told
        desc_act = false: no runtime reordering is needed. Asymmetric zero-points do not survive the v1
        format's zero - 1 storage at zero = 0, hence gptq_v2 for --asym.
        """
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": resolved["group_size"],
            "desc_act": False,
            "sym": not cfg.asym,
            "static_groups": cfg.act_order,
            "true_sequential": True,
            "damp_percent": cfg.damp,
            "lm_head": False,
            "checkpoint_format": _format(cfg.asym),
            "pack_dtype": "int32",
            "model_file_base_name": "model",
        }

    def extra_files(self, cfg, resolved):
        return {"quantize_config.json": json.dumps(self.quantization_config(cfg, resolved, {}), indent=2) + "\n"}

    def linear_bytes(self, n, k, group_size):
        g = k // group_size
        return n * k // 2, g * n // 2 + 2 * g * n + 4 * k  # qweight; qzeros, fp16 scales, g_idx

    def served_linear_bytes(self, n, k, group_size, float_bytes):
        if not repacked_on_cpu(n, group_size, {2: torch.bfloat16, 4: torch.float32}.get(float_bytes)):
            return self.linear_bytes(n, k, group_size)
        return n * k // 2, (k // group_size) * n * 2 * float_bytes  # packed codes; (G, N, 2) scale/zero table

    def calib_activation_bytes(self, shape, tokens):
        # The layer's input, output and the stage in between, the attention output and down_proj's input.
        return 3 * tokens * shape.hidden * 4 + tokens * (shape.heads * shape.head_dim + shape.intermediate) * 4

    def solver_bytes(self, n, k):
        if self.method == "rtn":
            return super().solver_bytes(n, k)
        # The group's Hessian, GPTQ's copy and two factorisation steps (K x K), the weight's fp32 copies.
        return 4 * k * k * 4 + 4 * n * k * 4


def _format(asym: bool) -> str:
    return "gptq_v2" if asym else "gptq"


SCHEMES = (GPTQScheme("gptq"), GPTQScheme("rtn"))
