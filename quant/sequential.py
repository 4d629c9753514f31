"""Layer-by-layer execution over calibration data (shared by W8A8 calibration and GPTQ).

Only one decoder layer's inputs (and the inputs of its Linears) are held at a time: the embeddings
and every layer's own kwargs are captured in a pass that does not run the layers, each layer is then
run on its own, and its outputs become the next layer's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from quant.families import LayerPlan, plan
from quant.moe import quantizable_linears


class _StopForward(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM (Llama/Mistral/Qwen2-style `model.layers`, or any ModuleList
    with `num_hidden_layers` entries)."""
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner.layers
    n = getattr(model.config, "num_hidden_layers", None)
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return mod
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear a scheme quantizes inside the decoder blocks, by full module name, in execution-ish order."""
    layers = decoder_layers(model)
    prefix = next(name for name, mod in model.named_modules() if mod is layers)
    return {f"{prefix}.{name}": mod for name, mod in quantizable_linears(layers).items()}


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


@torch.inference_mode()
def capture_layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """Run only the embedding part: returns the first layer's hidden states (S, T, D) fp32 and, for every
    decoder layer, the kwargs the model passes it (rotary embeddings, masks), shared by every sample of
    length T. They differ per layer where layers differ in type (Gemma 2/3, Qwen 2 with max_window_layers:
    sliding vs global masks, local vs global rope), so each layer is calibrated with its own.

    The layers are not run: each returns its input while the kwargs are recorded, and the pass stops at the
    last one (nothing after the layers, e.g. the head, is computed)."""
    layers = decoder_layers(model)
    device = model.get_input_embeddings().weight.device
    hidden: list[torch.Tensor] = []
    kws: list[dict] = [{} for _ in layers]

    def record(i: int):
        def hook(_mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                hidden.append(h.detach().float())
            if len(hidden) == 1:  # the first sample: every sample of length T gets the same kwargs
                kws[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if i == len(layers) - 1:
                raise _StopForward

        return hook

    def passthrough(hidden_states, *args, **kwargs):
        return hidden_states

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    for layer in layers:
        layer.forward = passthrough  # an instance attribute shadows the class's forward
    try:
        for s in range(ids.shape[0]):
            try:
                model(ids[s : s + 1].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            del layer.forward
    return torch.cat(hidden), kws  # (S, T, D)


@torch.inference_mode()
def linear_order(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> tuple[str, ...]:
    """The layer's Linears in the order its forward calls them, traced on one sample (S, T, D)[:1]."""
    linears = quantizable_linears(layer)
    seen: list[str] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, n=n: None if n in seen else seen.append(n))
               for n, m in linears.items()]
    try:
        run_layer(layer, hidden[:1], kwargs)
    finally:
        for h in handles:
            h.remove()
    return (*seen, *(n for n in linears if n not in seen))  # never-called Linears last


def layer_plan(model: nn.Module, layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> LayerPlan:
    """The family plan of `layer`; a layer no family describes gets its Linears' traced execution order."""
    return plan(model.config, layer, lambda: linear_order(layer, hidden, kwargs))


def _cast_kwargs(kwargs: dict, dtype: torch.dtype) -> dict:
    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, tuple):
            return tuple(cast(x) for x in v)
        return v

    return {k: cast(v) for k, v in kwargs.items()}


@torch.inference_mode()
def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Apply one decoder layer to every sample: (S, T, D) -> (S, T, D) fp32."""
    kw = _cast_kwargs(kwargs, dtype)
    outs = []
    for s in range(hidden.shape[0]):
        out = layer(hidden[s : s + 1].to(dtype), **kw)
        out = out[0] if isinstance(out, tuple) else out
        outs.append(out.float())
    return torch.cat(outs)


@contextmanager
def capture_inputs(modules: dict[str, nn.Module]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the (rows, in_features) fp32 input of each module while the context is open."""
    store: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    handles = []

    def make(name: str) -> Callable:
        def hook(mod, args):
            x = args[0]
            store[name].append(x.detach().reshape(-1, x.shape[-1]).float())

        return hook

    for name, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(make(name)))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()
