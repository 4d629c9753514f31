"""Projections: a model's Linears (dense, or any scheme's runtime module) bound for direct calls, fused where
parts read the same input, and recorded by role for the engine's weight and activation accounting.

A model groups its Linears by what they read (q/k/v, gate/up) and by role; ``Projections.bind`` returns one
callable per group. Groups fuse into one matmul where the scheme allows (``server.fuse``: at batch 1 on a
small model each kernel call costs about as much in dispatch as in arithmetic); checkpoints that already
store them fused (Phi-3's qkv_proj and gate_up_proj) pass through as single modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quant.runtime.kernel_choice import Chooser, dense_key, dense_paths
from quant.runtime.kernels import gemm
from quant.runtime.kernels import rows as rowops
from quant.runtime.kernels import triton_ops
from quant.runtime.linear import QuantizedLinear, module_device
from server.fuse import fuse_linears

ROLES = ("qkv", "o", "gate_up", "down")  # quant.shape.memory.engine_prefill_bytes keys its transients by these

# Bytes a path's C++ op holds inside the call on (rows, K) x, by path name: (rows, K) -> bytes
_STAGING: dict[str, Callable[[int, int], int]] = {"rows": rowops.staging_bytes, "rows16": rowops.staging_bytes,
                                                  "gemm": gemm.staging_bytes}


def _plain_call(mod: nn.Module) -> Callable[[Tensor], Tensor]:
    """A direct call of a projection on a (M, K) contiguous input, without Module.__call__ and the reshapes
    a generic forward needs."""
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    if isinstance(mod, QuantizedLinear):
        return mod.call2d
    return mod


def bind(mod: nn.Module, dtype: torch.dtype, chooser: Chooser | None = None,
         upcast: bool = True, max_rows: int | None = None) -> Callable[[Tensor], Tensor]:
    """The call of one projection for inputs of ``dtype``: by the path the chooser planned per row count (one
    path for every row count: that path itself), else the module's own rule; a one-row kernel with launch
    parameters (a GPU's) is launched as the chooser measured best on the device. ``upcast``: whether a 16-bit dense
    Linear may take its fp32-upcast path (a transient fp32 copy of W). ``max_rows``: the most rows a call has,
    where that is known (the head's), so the plan is measured no further."""
    if chooser is None:
        return _plain_call(mod)
    if type(mod) is nn.Linear:
        paths = dense_paths(mod.weight, mod.bias, dtype, upcast)
    elif isinstance(mod, QuantizedLinear):
        paths = mod.paths(dtype)
    else:
        return mod
    key, dev = computation(mod, dtype), module_device(mod)
    if isinstance(mod, QuantizedLinear):  # the one-row kernel's launch first: the plan then times the kernel so
        space = mod.launch_space(dtype)
        if space is not None:
            mod.gemv_config = chooser.tune(key, space, mod.in_features, dtype, dev)
    plan = chooser.plan(key, paths, mod.in_features, dtype, dev, max_rows)
    if plan is None:
        return _plain_call(mod)
    if isinstance(mod, QuantizedLinear):
        mod.use_plan(plan, dtype, paths)
    if plan.single is not None:
        return paths[plan.single]
    return lambda x: paths[plan.pick(x.shape[0])](x)


def computation(mod: nn.Module, dtype: torch.dtype) -> str:
    """The key a projection's plan is kept under (quant.runtime.kernel_choice.computation_key)."""
    return mod.plan_key(dtype) if isinstance(mod, QuantizedLinear) else dense_key(mod.weight, mod.bias, dtype)


class Projections:
    """Every projection a model binds, by role; what the engine asks of them for its accounting."""

    def __init__(self, dtype: torch.dtype, chooser: Chooser | None = None):
        self.dtype = dtype
        self.chooser = chooser
        self.by_role: dict[str, list[nn.Module]] = {r: [] for r in ROLES}
        self.fused_groups = 0
        self.gated: dict[str, int] = {}  # activation -> [gate | up] projections whose one-row launch ends in it
        self.normed_calls = 0  # one-row launches ending in the residual add and its norms (the model says)
        self._calls: dict[int, Callable[[Tensor], Tensor]] = {}  # id(module) -> its bound call
        self._peak_cache: dict[tuple, int] = {}
        self._transients: dict[int, dict[str, int]] = {}

    def _bind(self, mod: nn.Module) -> Callable[[Tensor], Tensor]:
        call = self._calls[id(mod)] = bind(mod, self.dtype, self.chooser)
        return call

    def bind(self, role: str, mods: list[nn.Module]) -> Callable[[Tensor], Tensor]:
        """One callable computing ``cat([m(x) for m in mods], -1)`` (fused into one matmul where possible)."""
        return self.bind_group(role, mods)[0]

    def bind_gated(self, role: str, mods: list[nn.Module], act: str) -> tuple[Callable[[Tensor], Tensor],
                                                                             Callable[[Tensor], Tensor] | None]:
        """:meth:`bind` of a [gate | up] group, and the one-row call that ends in the activation ``act`` (a glue op's
        name) inside the projection's launch where its module has one (``WeightOnlyLinear.gated_call``), else None."""
        call, mod = self.bind_group(role, mods)
        gated = getattr(mod, "gated_call", None)
        if gated is not None:
            gated = gated(act, self.dtype)
        elif (product := self._dense_one_row(mod)) is not None and act in triton_ops.GATED_ACTS:
            gated = product.gated(act)
        if gated is not None:
            self.gated[act] = self.gated.get(act, 0) + 1
        return call, gated

    def normed(self, mod: nn.Module | None, norm, post=None, scale: float = 1.0) -> Callable | None:
        """The one-row call ``(x, residual) -> (x', norm(x'))``, x' = residual + post(mod(x)) * scale, inside ``mod``'s
        launch (``WeightOnlyLinear.normed_call``; ``norm``, ``post``: server.layers.norm.RMSNorm or None, where the
        layer has no such norm), or None where it has none."""
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        post = None if post is None else (post.weight, post.eps)
        make = getattr(mod, "normed_call", None)
        if make is not None:
            return make(weight, eps, self.dtype, post, scale)
        product = self._dense_one_row(mod)
        if product is None or not triton_ops.norm_weights_fit(mod.out_features, self.dtype, weight, post):
            return None
        return product.normed(weight, eps, post, scale)

    def _dense_one_row(self, mod: nn.Module | None) -> rowops.Product | None:
        """The C++ rows pass a float Linear's plan takes at one row (``kernel_choice.dense_paths``' ``rows``), whose
        epilogues the one-row step may use as the quantized modules' (``WeightOnlyLinear.gated_call``); None
        where its plan takes another path there, or none was measured (the static rule: PyTorch's product)."""
        if type(mod) is not nn.Linear or self.chooser is None:
            return None
        plan = self.chooser.chosen.get(computation(mod, self.dtype))
        if plan is None or plan.pick(1) != "rows":
            return None
        product = dense_paths(mod.weight, mod.bias, self.dtype).get("rows")
        return product if isinstance(product, rowops.Product) else None

    def bind_group(self, role: str, mods: list[nn.Module]) -> tuple[Callable[[Tensor], Tensor], nn.Module | None]:
        """(the group's call, the one module computing it, None where its parts run apart)."""
        if len(mods) == 1:
            self.by_role[role].append(mods[0])
            return self._bind(mods[0]), mods[0]
        fused = fuse_linears(mods)
        if fused is not None:
            self.fused_groups += 1
            self.by_role[role].append(fused)
            return self._bind(fused), fused
        self.by_role[role].extend(mods)
        parts = [self._bind(m) for m in mods]
        return (lambda h: torch.cat([p(h) for p in parts], dim=-1)), None

    def describe(self) -> list[str]:
        """Lines for ModelInfo.kernels on what the projections fuse beyond their own products."""
        lines = [f"gate_up of {n} layer(s): one-row launches end in {act}, no activation kernel at batch 1"
                 for act, n in sorted(self.gated.items())]
        if self.normed_calls:
            lines.append(f"o and down: {self.normed_calls} one-row launches end in the residual add and the norms "
                         "around it, no norm kernel between the layers at batch 1")
        return lines

    def modules(self) -> list[nn.Module]:
        return [m for ms in self.by_role.values() for m in ms]

    def prepare_kernels(self, extra: list[nn.Module]) -> None:
        """Every quantized module in its runtime layout for this dtype (quant's loader prepared them for the
        model's float dtype already; this covers a model built otherwise, and is a no-op when done)."""
        for m in self.quantized_modules(extra):
            m.prepare(self.dtype)

    def quantized_modules(self, extra: list[nn.Module]) -> list[QuantizedLinear]:
        mods = {id(m): m for m in [*extra, *self.modules()] if isinstance(m, QuantizedLinear)}
        return list(mods.values())

    def transients(self, rows: int) -> dict[str, int]:
        """Bytes each role holds beyond its output while it runs on ``rows`` rows: a layer whose path at that row
        count dequantizes its weight (or upcasts it, or its input, to fp32) holds those copies while it runs. Each
        is measured once per computation and path with quant.shape.memory's MemoryTracker, on the path itself at this
        row count (every scheme and path allocates with its own arithmetic; tracking it is exact), plus, for the
        ``rows``, ``rows16`` and ``gemm`` paths, the staging their C++ ops hold where the tracker cannot see
        (:data:`_STAGING`)."""
        if rows not in self._transients:
            self._transients[rows] = {role: max((self._extra_bytes(m, rows) for m in mods), default=0)
                                      for role, mods in self.by_role.items()}
        return self._transients[rows]

    def _extra_bytes(self, m: nn.Module, rows: int) -> int:
        call = self._calls.get(id(m))
        if call is None or not isinstance(m, (nn.Linear, QuantizedLinear)):
            return 0
        key = (computation(m, self.dtype), self._path_name(m, rows), rows)
        if key not in self._peak_cache:
            from quant.runtime.measure import MemoryTracker

            x = torch.zeros(rows, m.in_features, dtype=self.dtype, device=module_device(m))  # (M, K)
            with torch.inference_mode(), MemoryTracker() as mt:
                y = call(x)  # (M, N)
            staged = _STAGING.get(key[1], lambda *_: 0)(rows, m.in_features)  # inside a C++ op
            self._peak_cache[key] = max(0, mt.peak - y.numel() * y.element_size()) + staged
        return self._peak_cache[key]

    def _path_name(self, m: nn.Module, rows: int) -> str:
        if isinstance(m, QuantizedLinear):
            return m.path_for(rows, self.dtype)
        plan = None if self.chooser is None else self.chooser.chosen.get(computation(m, self.dtype))
        return "dense" if plan is None else plan.pick(rows)
