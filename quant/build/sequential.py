"""Layer-by-layer execution over calibration data (shared by W8A8 calibration and GPTQ).

Only one decoder layer's inputs (and the inputs of its Linears) are held at a time: the embeddings
and every layer's own kwargs are captured in a pass that does not run the layers, each layer is then
run on its own, and its outputs become the next layer's inputs.

Inside a layer, the Linears are quantized sequentially: each group (q/k/v, o, gate/up, down) is calibrated on
inputs computed with the groups before it already quantized, which a scheme arranges by making each Linear
compute its quantized function in float once its group is done (`quantize_group` below). Two passes do this:
- `staged_pass` (Llama-shaped layers, quant.build.families says which) executes the layer in stages (norm ->
  attention -> o -> norm -> MLP up to down -> down), each stage once: one layer pass in all;
- `exact_pass` (any layer) re-runs the layer's own forward once per stage of its plan (a stage: groups whose
  inputs do not depend on each other, such as all the experts' gate/up of a MoE block), then once more.

`quantize_group(names, inputs)` gets the group's Linears and their common input, one (1, T, K) or (rows, K)
tensor per calibration sample (a sequence that may compute them on access: iterate it, or cat it once), and
returns the per-channel divisor it folded into the producer of that input (SmoothQuant), or None; the staged
pass then divides the inputs it holds by it, so the next stage sees what the quantized layer computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from quant.build.families import LayerPlan, plan
from quant.runtime.moe import quantizable_linears


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


QuantizeGroup = Callable[[tuple[str, ...], Sequence[torch.Tensor]], "torch.Tensor | None"]


def _stop(_mod, _args):
    raise _StopForward


class _Computed(Sequence):
    """f(0), ..., f(n-1), each computed when read (a stage's inputs that the next stage recomputes anyway)."""

    def __init__(self, f: Callable[[int], torch.Tensor], n: int):
        self.f, self.n = f, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.f(j) for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.f(i % self.n)


def _inputs_until(module: nn.Module, run: Callable[[int], object], samples: int) -> list[torch.Tensor]:
    """`module`'s input for each sample, the forward stopped there (nothing after it is computed)."""
    with capture_inputs({"x": module}) as store:
        stop = module.register_forward_pre_hook(_stop)
        try:
            for s in range(samples):
                try:
                    run(s)
                except _StopForward:
                    pass
        finally:
            stop.remove()
    return store["x"]  # S x (T, K)


def _divided(xs: list[torch.Tensor], div: torch.Tensor | None) -> list[torch.Tensor]:
    return xs if div is None else [x / div for x in xs]


@torch.inference_mode()
def staged_pass(layer: nn.Module, hidden: torch.Tensor, kw: dict, quantize_group: QuantizeGroup,
                lp: LayerPlan) -> torch.Tensor:
    """One pass over the calibration set (S, T, D) with each group quantized right before its stage, for layers
    h' = h + r * attn(norm1(h)); out = h' + r * mlp(norm2(h')) (lp.staged). Returns the layer's output."""
    fam, r = lp.family, lp.residual_scale
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.get_submodule(fam.attn_norm), layer.get_submodule(fam.mlp_norm)
    o_proj, down_proj = layer.get_submodule(fam.o), layer.get_submodule(fam.down)
    n = hidden.shape[0]

    def h(s: int) -> torch.Tensor:
        return hidden[s : s + 1]  # (1, T, D)

    # Stage 1: q/k/v read norm1(h) (recomputed after the group: a smoothing fold changes norm1).
    quantize_group(fam.qkv, _Computed(lambda s: norm1(h(s)), n))
    # Stage 2: attention with quantized q/k/v, stopped at o_proj's input.
    attn_in = _inputs_until(o_proj, lambda s: attn(hidden_states=norm1(h(s)), **kw), n)
    attn_in = _divided(attn_in, quantize_group((fam.o,), attn_in))
    # Stage 3: residual + r * o_proj, then norm2 feeds gate/up.
    mid = torch.cat([h(s) + r * o_proj(attn_in[s]).reshape(h(s).shape) for s in range(n)])  # (S, T, D)
    del attn_in
    quantize_group(fam.gate_up, _Computed(lambda s: norm2(mid[s : s + 1]), n))
    # Stage 4: the MLP up to down_proj's input.
    down_in = _inputs_until(down_proj, lambda s: mlp(norm2(mid[s : s + 1])), n)
    down_in = _divided(down_in, quantize_group((fam.down,), down_in))
    # Stage 5: the layer's output.
    return torch.cat([mid[s : s + 1] + r * down_proj(down_in[s]).reshape(mid[s : s + 1].shape) for s in range(n)])


@torch.inference_mode()
def exact_pass(layer: nn.Module, hidden: torch.Tensor, kw: dict, quantize_group: QuantizeGroup,
               lp: LayerPlan, groups) -> torch.Tensor:
    """The layer's own forward re-run once per stage of `lp` (any layer shape), capturing the input of every
    group of the stage (`groups`: quant.build.smooth.SmoothGroup, each named by its Linears), then once for the
    output."""
    for stage in lp.stages:
        now = [g for g in groups if g.linears[0] in stage]
        with capture_inputs({g.linears[0]: layer.get_submodule(g.linears[0]) for g in now}) as store:
            run_layer(layer, hidden, kw)
        for g in now:
            x = store.pop(g.linears[0])
            quantize_group(g.linears, x)
            del x
    return run_layer(layer, hidden, kw)


def layer_pass(layer: nn.Module, hidden: torch.Tensor, kw: dict, quantize_group: QuantizeGroup, lp: LayerPlan,
               groups, matmul_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The staged pass where `lp` allows it, the exact pass otherwise; returns the layer's output. The layer's
    Linears multiply in `matmul_dtype` (see `linear_products_in`)."""
    with linear_products_in(layer, matmul_dtype):
        if lp.staged:
            return staged_pass(layer, hidden, kw, quantize_group, lp)
        return exact_pass(layer, hidden, kw, quantize_group, lp, groups)


@contextmanager
def linear_products_in(layer: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While open, each float nn.Linear of `layer` multiplies in `dtype`: its input and weight rounded to it, the
    product summed in fp32 by the GEMM and rounded to it, then returned in the input's dtype. Only the products
    change: the weights stay as they are for the quantizer, and norms, attention, the residual stream and the
    captured inputs (Hessians, activation statistics) stay fp32. A weight's cast is made once and made again
    when the weight changes (a quantized group's dequantized weight, a smoothing fold); a Linear a scheme
    makes compute something else (W8A8's simulation of its finished groups) is left to that."""
    if dtype == torch.float32:
        yield
        return
    mods = [m for m in layer.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    calls = {}

    def low_precision(mod: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        cast: list = [None, None, None]  # (weight's data_ptr, version), W, bias in `dtype`

        def forward(x: torch.Tensor) -> torch.Tensor:
            w, b = mod.weight, mod.bias
            key = (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))
            if cast[0] != key:
                cast[:] = [key, w.to(dtype), None if b is None else b.to(dtype)]
            return torch.nn.functional.linear(x.to(dtype), cast[1], cast[2]).to(x.dtype)

        return forward

    for m in mods:
        m.forward = calls[m] = low_precision(m)
    try:
        yield
    finally:
        for m in mods:
            if m.__dict__.get("forward") is calls[m]:
                del m.forward
