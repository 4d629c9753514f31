"""Runtime quantized Linear modules, each with a plain reference path beside its fast path.

Every scheme's runtime module is a `QuantizedLinear`: the loader, the server's fusing and the memory
accounting use only that interface, never a scheme's own fields. The fast paths use PyTorch's own int8
kernels; `reference_forward` dequantizes and does a float matmul, and the tests hold the two together.
Modules are built empty (optionally on the meta device) from a JSON spec stored in the artifact's config,
then filled by `load_state_dict(assign=True)` from a memory-mapped safetensors file: no quantization work
happens at load time beyond the after-load hook (`prepare`: kernel layouts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quant.runtime import primitives as P
from quant.runtime.kernel_choice import LaunchSpace, computation_key
from quant.runtime.kernels import rows as rowops
from quant.runtime.kernels import triton_ops


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _aligned(t: torch.Tensor, align: int = 64) -> torch.Tensor:
    """`t`, or an aligned copy of it: the CPU int8 GEMM kernels fault on int8 weights that are not 64-byte
    aligned, and a memory-mapped file gives only the alignment its writer chose (ours: 64)."""
    return t if t.data_ptr() % align == 0 else t.clone()


class QuantizedLinear(nn.Module):
    """The interface of a scheme's runtime module (vLLM's create_weights / apply /
    process_weights_after_loading, as one class):
    - ``from_spec(spec, in_features, out_features, device)`` builds it empty from the JSON ``spec()`` that the
      artifact's config stores for it (``SPEC_TYPE`` names the class there); ``features(tensors)`` reads
      (in_features, out_features) back from its stored tensors, for a loader that has no model class to ask;
    - ``prepare(dtype)`` is the after-load hook, run once on the target device for activations in ``dtype``:
      the module then holds one runtime layout (int4: the kernel's repacked codes and one scale/zero table in
      ``dtype``, in place of the stored tensors; int8: the stored tensors, aligned), all of it registered, so
      the accounting counts exactly what is held; ``DATA_TENSORS`` / ``PARAM_TENSORS`` name its tensors by
      class (weight, parameters), stored or runtime;
    - ``fuse(mods)``: one module computing ``cat([m(x) for m in mods], -1)`` that holds the parts' layout once
      (the parts become views of it), or None where it cannot;
    - ``paths(dtype)``: the ways it can compute a contiguous (M, K) input of ``dtype`` (bias included), by name;
      ``static_path(rows, dtype)`` names the one its built-in rule takes, and ``use_plan`` installs a per-row-count
      choice measured on this CPU (``quant.runtime.kernel_choice``); ``plan_key`` names the computation for that cache.
    """

    SPEC_TYPE: str
    DATA_TENSORS: tuple[str, ...] = ("weight",)
    PARAM_TENSORS: tuple[str, ...] = ()
    in_features: int
    out_features: int

    def spec(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_spec(cls, spec: dict, in_features: int, out_features: int, device=None) -> "QuantizedLinear":
        raise NotImplementedError

    @classmethod
    def features(cls, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(in_features, out_features) of the stored tensors (by leaf name): an (out, in) ``weight``."""
        w = tensors.get("weight")
        if w is None or w.dim() != 2:
            raise ValueError(f"a {cls.SPEC_TYPE} module stores a 2-D weight, found {sorted(tensors)}")
        return int(w.shape[1]), int(w.shape[0])

    def kernel(self, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        pass

    @classmethod
    def fuse(cls, mods: list["QuantizedLinear"]) -> "QuantizedLinear | None":
        return None

    _plan = None  # (dtype, RowPlan, paths) once use_plan ran

    def paths(self, dtype: torch.dtype) -> dict:
        raise NotImplementedError

    def static_path(self, rows: int, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def plan_key(self, dtype: torch.dtype) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.spec().items()) if k not in ("type", "bias"))
        return computation_key(f"{self.SPEC_TYPE}[{opts}]", self.out_features, self.in_features, dtype)

    def launch_space(self, dtype: torch.dtype) -> LaunchSpace | None:
        """The launch configurations of this module's one-row kernel worth measuring on its device, or None."""
        return None

    def use_plan(self, plan, dtype: torch.dtype, paths: dict | None = None) -> None:
        """Compute inputs of ``dtype`` by ``plan`` (a ``quant.runtime.kernel_choice.RowPlan`` over ``paths(dtype)``, which
        the caller may pass when it has them already)."""
        self._plan = (dtype, plan, self.paths(dtype) if paths is None else paths)

    def path_for(self, rows: int, dtype: torch.dtype) -> str:
        if self._plan is not None and self._plan[0] == dtype:
            return self._plan[1].pick(rows)
        return self.static_path(rows, dtype)

    def call2d(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) contiguous -> (M, N), by the planned path for M rows (the built-in rule without a plan)."""
        if self._plan is not None and self._plan[0] == x2.dtype:
            return self._plan[2][self._plan[1].pick(x2.shape[0])](x2)
        return self.paths(x2.dtype)[self.static_path(x2.shape[0], x2.dtype)](x2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:  # the reference arithmetic `quant eval` runs: the same on every machine
            return self.reference_forward(x)
        shape = x.shape
        y = self.call2d(x.reshape(-1, self.in_features).contiguous())  # (M, N)
        return y.reshape(*shape[:-1], self.out_features)


def module_device(mod: nn.Module) -> torch.device:
    """Where a module's tensors are (its first buffer or parameter; the CPU for a module holding none)."""
    t = next(iter([*mod.buffers(), *mod.parameters()]), None)
    return torch.device("cpu") if t is None else t.device


def fused_offsets(mods) -> list[tuple[int, int]]:
    """The row range of each part in the fused output."""
    spans, a = [], 0
    for m in mods:
        spans.append((a, a + m.out_features))
        a += m.out_features
    return spans


def fused_bias(mods, dtype) -> torch.Tensor | None:
    """The parts' biases concatenated (zeros for a part without one), or None when none has one."""
    biases = [m.bias for m in mods if m.bias is not None]
    if not biases:
        return None
    dev = biases[0].device
    return torch.cat([
        m.bias.data.to(dtype) if m.bias is not None else torch.zeros(m.out_features, dtype=dtype, device=dev)
        for m in mods
    ])


def view_rows(mods, fused, names) -> None:
    """Point each part's tensors at its rows of the fused tensors (no copy kept)."""
    for m, (a, b) in zip(mods, fused_offsets(mods)):
        for n in names:
            t = getattr(fused, n)
            if t is None:
                continue
            if isinstance(getattr(m, n), nn.Parameter):
                setattr(m, n, nn.Parameter(t.data[a:b], requires_grad=False))
            else:
                setattr(m, n, t[a:b])


class WeightOnlyLinear(QuantizedLinear):
    """The shared shape of weight-only modules: a low-bit kernel for short 16-bit inputs (decode),
    a dequantized dense matmul otherwise (long prefills, fp32 activations), then the float bias."""

    in_features: int
    out_features: int
    max_kernel_rows: int
    bias: nn.Parameter | None

    def has_kernel(self, dtype: torch.dtype) -> bool:
        """Whether the low-bit kernel can take inputs of this dtype."""
        return dtype in (torch.bfloat16, torch.float16)

    def kernel_runs(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether an input of this many rows and this dtype goes to the low-bit kernel (else: dequantize)."""
        return self.path_for(rows, dtype) == "kernel"

    def static_path(self, rows: int, dtype: torch.dtype) -> str:
        return "kernel" if self.has_kernel(dtype) and rows <= self.max_kernel_rows else "dequant"

    # The one-row kernel's launch configuration as measured on its device (quant.runtime.kernel_choice.Chooser.tune), or
    # None: the kernel's own rule.
    gemv_config: tuple[int, ...] | None = None

    def _kernel_matmul(self, x2: torch.Tensor, gemv_config: tuple[int, ...] | None = None,
                       gated: str | None = None, norm=None):
        """x2 (M, K) 16-bit -> (M, N) via the low-bit kernel (only called when has_kernel); ``gemv_config``: the
        one-row kernel's launch, where it has one (default: ``self.gemv_config``); ``gated`` / ``norm``: one row
        through that kernel's gated or norm epilogue (see :meth:`gated_call`, :meth:`normed_call`)."""
        raise NotImplementedError

    def _one_row_launch(self, dtype: torch.dtype) -> tuple[int, ...] | None:
        """The launch one-row inputs of ``dtype`` take where that is a GPU's one-row kernel with epilogues (no bias:
        it would come after them), else None: a CPU's kernels, a bias, a plan that takes another path at one row."""
        space = self.launch_space(dtype)
        if self.bias is not None or space is None or self.path_for(1, dtype) != "kernel":
            return None
        return self.gemv_config or space.start  # (start: the kernel's own rule)

    def _rows_products(self, dtype: torch.dtype) -> dict[str, rowops.Product]:
        """The C++ rows passes (``quant.runtime.kernels.rows.Product``) this module computes inputs of ``dtype`` with on a
        CPU, by path name: those that can end in the glue's epilogues. None here; the int8 and int4 modules have them."""
        return {}

    def _in_order(self, call):
        """A product's call taking x in this module's input order (the int4 module's act order permutes K)."""
        return call

    def _one_row_product(self, dtype: torch.dtype) -> rowops.Product | None:
        """The C++ rows pass one row of ``dtype`` takes here by the plan, or None (another path, a GPU): the product
        whose epilogues a one-row step may use instead of glue ops of its own."""
        products = self._rows_products(dtype)
        return products.get(self.path_for(1, dtype)) if products else None

    def gated_call(self, act: str, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For a [gate | up] projection: a call of one-row inputs of ``dtype`` that gives act(gate) * up (1, N/2)
        in the one-row product's own call, so that a decode step's MLP runs no activation op (``act`` the glue op's
        name, "silu_mul" or "gelu_tanh_mul"): on a CPU whose one-row path is a rows pass, that pass ending in the
        activation (``rows.Product.gated``); on a GPU the one-row kernel's gated epilogue
        (quant.runtime.kernels.triton_ops). None where one row takes no such kernel here (:meth:`_one_row_launch`)
        or its tiles do not split into the gate's."""
        if act not in triton_ops.GATED_ACTS:
            return None
        product = self._one_row_product(dtype)
        if product is not None:
            return self._in_order(product.gated(act))
        cfg = self._one_row_launch(dtype)
        if cfg is None or not triton_ops.gated_fits(self.out_features, cfg[0]):
            return None
        return lambda x: self._kernel_matmul(x, cfg, gated=act)

    def normed_call(self, weight: torch.Tensor | None, eps: float, dtype: torch.dtype,
                    post: tuple[torch.Tensor, float] | None = None, scale: float = 1.0):
        """For a projection that a residual add and norms follow (o, down): a call of one-row inputs ``(x, residual)``
        that gives ``(residual + y', rms_norm(residual + y') * weight)`` in the one-row product's own call (a CPU's
        rows pass ending in them, ``rows.Product.normed``; a GPU kernel's norm epilogue,
        quant.runtime.kernels.triton_ops.AddNorm), so that a decode step runs no norm between the layers. y' is y
        put through the output norm ``post`` (weight, eps) and times ``scale`` where the family has them; with no
        ``weight`` the second result is the sum itself. None where one row takes no such kernel here
        (:meth:`_one_row_launch`) or a weight is not (out_features,) in ``dtype``."""
        if not triton_ops.norm_weights_fit(self.out_features, dtype, weight, post):
            return None
        product = self._one_row_product(dtype)
        if product is not None:
            return self._in_order(product.normed(weight, eps, post, scale))
        cfg = self._one_row_launch(dtype)
        if cfg is None:
            return None
        return lambda x, residual: self._kernel_matmul(
            x, cfg, norm=triton_ops.AddNorm(residual, weight, eps, post, scale))

    def _gemv_space(self, dtype: torch.dtype):
        """(start, values per axis of triton_ops.GEMV_AXES) of the one-row kernel's launch, where it has one."""
        return None

    def launch_space(self, dtype: torch.dtype) -> LaunchSpace | None:
        """The one-row kernel's launch configurations to measure on this device (``Chooser.tune``), held to the
        dequantized product; None where the kernel has no launch to choose (the CPU's)."""
        got = self._gemv_space(dtype) if self.has_kernel(dtype) else None
        if got is None:
            return None
        start, axes = got
        dev = module_device(self)
        return LaunchSpace(tuple(start), axes, triton_ops.GEMV_AXES,
                           lambda cfg: (lambda x: self._kernel_matmul(x, cfg)),
                           lambda x: F.linear(x, self.dequantized(x.dtype)),
                           lambda: triton_ops.reset_split_counters(dev))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def paths(self, dtype: torch.dtype) -> dict:
        """kernel: the low-bit kernel in ``dtype``; dequant: W dequantized into ``dtype``, then a dense matmul;
        dequant-fp32 (16-bit dtypes): W and x in fp32 (where the CPU's fp32 GEMM is much faster than its 16-bit
        one), the result rounded to ``dtype``."""
        b = None if self.bias is None else self.bias.to(dtype)
        out = {}
        if self.has_kernel(dtype):
            kern = self._kernel_matmul
            out["kernel"] = kern if b is None else (lambda x: kern(x) + b)
        out["dequant"] = lambda x: F.linear(x, self.dequantized(dtype), b)
        if dtype != torch.float32 and module_device(self).type == "cpu":  # a GPU's fp32 GEMM is never the faster
            b32 = None if self.bias is None else self.bias.float()
            out["dequant-fp32"] = lambda x: F.linear(x.float(), self.dequantized(torch.float32), b32).to(dtype)
        return out

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b with W dequantized, in fp32, or in float64 for float64 inputs (exact weights, sums
        rounded ~1e-16: what `quant eval` computes, the same on every CPU)."""
        ct = P.compute_dtype(x.dtype)
        b = None if self.bias is None else self.bias.to(ct)
        return F.linear(x.to(ct), self.dequantized(ct), b)


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
