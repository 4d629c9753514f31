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

from quant import dequant, gemm, hadamard, triton_ops
from quant import primitives as P
from quant import rows as rowops
from quant.kernel_choice import LaunchSpace, computation_key

# Up to this many rows (tokens) the weight-only int8 kernel wins; at 512 rows a dequantized dense
# matmul is faster on CPU (bench/kernels.py, bench/RESULTS.md: kernel ahead at 64 rows, behind at 512).
INT8PACK_MAX_ROWS = 64


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
      choice measured on this CPU (``quant.kernel_choice``); ``plan_key`` names the computation for that cache.
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
        """Compute inputs of ``dtype`` by ``plan`` (a ``quant.kernel_choice.RowPlan`` over ``paths(dtype)``, which
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
        if x.dtype == torch.float64:  # the reference arithmetic `quant eval` runs: the same on every machine (#43)
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

    # The one-row kernel's launch configuration as measured on its device (quant.kernel_choice.Chooser.tune), or
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

    def gated_call(self, act: str, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For a [gate | up] projection: a call of one-row inputs of ``dtype`` that gives act(gate) * up (1, N/2)
        from the one-row kernel's own launch (its gated epilogue, quant.triton_ops; ``act`` the glue op's name,
        "silu_mul" or "gelu_tanh_mul"), so that a decode step's MLP launches no activation kernel. None where one row
        takes no such kernel here (:meth:`_one_row_launch`) or its tiles do not split into the gate's."""
        cfg = self._one_row_launch(dtype)
        if act not in triton_ops.GATED_ACTS or cfg is None or not triton_ops.gated_fits(self.out_features, cfg[0]):
            return None
        return lambda x: self._kernel_matmul(x, cfg, gated=act)

    def normed_call(self, weight: torch.Tensor | None, eps: float, dtype: torch.dtype,
                    post: tuple[torch.Tensor, float] | None = None, scale: float = 1.0):
        """For a projection that a residual add and norms follow (o, down): a call of one-row inputs ``(x, residual)``
        that gives ``(residual + y', rms_norm(residual + y') * weight)`` from the one-row kernel's own launch (its norm
        epilogue, quant.triton_ops.AddNorm), so that a decode step launches no norm between the layers. y' is y put
        through the output norm ``post`` (weight, eps) and times ``scale`` where the family has them; with no
        ``weight`` the second result is the sum itself. None where one row takes no such kernel here
        (:meth:`_one_row_launch`) or a weight is not (out_features,) in ``dtype``."""
        cfg = self._one_row_launch(dtype)
        if cfg is None or not triton_ops.norm_weights_fit(self.out_features, dtype, weight, post):
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


class Int8WeightLinear(WeightOnlyLinear):
    """Weight-only int8 (per output channel), symmetric or affine; activations stay in float.

    Fast path (bf16/fp16 activations, few rows): `aten._weight_int8pack_mm`, which computes
    x @ (s * q)^T with int8 weights. For affine weights W = s * (q8 - z8), the zero-point is folded
    out algebraically: x @ W^T = int8pack(x, q8, s) - (sum_k x_k) * (s * z8).
    Otherwise (fp32 activations or long prefills): dequantize into the activation dtype and matmul.
    """

    SPEC_TYPE = "int8_weight"
    PARAM_TENSORS = ("weight_scale", "weight_zero_point", "kernel_scale", "kernel_offset")

    @property
    def max_kernel_rows(self) -> int:
        """CUDA: the Triton kernel at every row count (bench/gpu.py: ahead of dequantizing); CPU: the int8pack
        kernel up to INT8PACK_MAX_ROWS."""
        return INT8PACK_MAX_ROWS if self.weight.device.type != "cuda" else 1 << 30

    def __init__(self, in_features: int, out_features: int, bias: bool, affine: bool, device=None):
        super().__init__()
        self.in_features, self.out_features, self.affine = in_features, out_features, affine
        self.register_buffer("weight", _empty((out_features, in_features), torch.int8, device))
        self.register_buffer("weight_scale", _empty((out_features,), torch.float32, device))
        if affine:
            self.register_buffer("weight_zero_point", _empty((out_features,), torch.int8, device))
        else:
            self.weight_zero_point = None
        self.register_buffer("kernel_scale", None)  # weight_scale in the kernel's activation dtype (prepare)
        self.register_buffer("kernel_offset", None)  # affine: s * z in fp32 (prepare), the row-sum correction's
        self.bias = nn.Parameter(_empty((out_features,), torch.float32, device), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, affine: bool) -> "Int8WeightLinear":
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, affine)
        if affine:
            m.weight, m.weight_scale, m.weight_zero_point = P.quantize_weight_affine(linear.weight.data)
        else:
            m.weight, m.weight_scale = P.quantize_weight_sym(linear.weight.data)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.data.detach().clone().float(), requires_grad=False)
        return m

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        """After loading: the kernel's layout requirements (alignment), and its scales in ``dtype``."""
        self.weight = _aligned(self.weight)
        if self.has_kernel(dtype) and not self.weight_scale.is_meta:
            self.kernel_scale = self.weight_scale.to(dtype)
            if self.affine:  # computed once, not per call: at batch 1 each small op costs as much as its math
                self.kernel_offset = self.weight_scale * self.weight_zero_point.float()  # (N,)

    def spec(self) -> dict:
        return {"type": self.SPEC_TYPE, "affine": self.affine, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, in_features: int, out_features: int, device=None) -> "Int8WeightLinear":
        return cls(in_features, out_features, spec["bias"], spec["affine"], device=device)

    @classmethod
    def fuse(cls, mods: list["Int8WeightLinear"]) -> "Int8WeightLinear | None":
        """Concatenated rows; the parts become views of them (nothing stored twice)."""
        if len({m.affine for m in mods}) != 1:
            return None
        bias = fused_bias(mods, torch.float32)
        fused = cls(mods[0].in_features, sum(m.out_features for m in mods), bias is not None, mods[0].affine,
                    device="meta")
        fused.weight = torch.cat([m.weight for m in mods])
        fused.weight_scale = torch.cat([m.weight_scale for m in mods])
        if mods[0].affine:
            fused.weight_zero_point = torch.cat([m.weight_zero_point for m in mods])
        if all(m.kernel_scale is not None and m.kernel_scale.dtype == mods[0].kernel_scale.dtype for m in mods):
            fused.kernel_scale = torch.cat([m.kernel_scale for m in mods])
        if all(m.kernel_offset is not None for m in mods):
            fused.kernel_offset = torch.cat([m.kernel_offset for m in mods])
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        view_rows(mods, fused, ["weight", "weight_scale", "weight_zero_point", "kernel_scale", "kernel_offset"])
        return fused

    def has_kernel(self, dtype: torch.dtype) -> bool:
        if self.weight.is_cuda:  # the CUDA int8pack kernel walks K serially: the Triton GEMM instead
            return dtype in (torch.bfloat16, torch.float16) and triton_ops.available() is None
        return super().has_kernel(dtype)

    def kernel(self, dtype: torch.dtype) -> str:
        if self.has_kernel(dtype) and self.weight.is_cuda:
            return ("Triton int8 weight-only kernels (quant.triton_ops.int8_matmul): a GEMV at one row, a tiled GEMM "
                    "above, every row count")
        if self.has_kernel(dtype):
            corr = " - rowsum(x)*s*z" if self.affine else ""
            return (f"aten._weight_int8pack_mm{corr}, one C++ pass (quant.rows), a tiled C++ product (quant.gemm, "
                    f"bf16) or dequantize + matmul (bf16 or fp32), per row count the fastest on the serving CPU "
                    f"(quant serve --kernels; static rule: the kernel up to {INT8PACK_MAX_ROWS} rows)")
        return ("dequantize + matmul, or one C++ pass (quant.rows) where measured faster (the fp32 int8pack "
                "kernel is slower than dense on CPU)")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant.int8(self.weight, self.weight_scale, self.weight_zero_point, dtype)

    def paths(self, dtype: torch.dtype) -> dict:
        """As every weight-only module's, and on CPU ``rows``: the whole Linear in one C++ pass over the int8
        weight, in fp32, rounded once (``quant.rows``; at a few rows a dozen small ops cost more than the
        bytes); ``gemm`` for many bf16 rows where the CPU has AVX512-BF16 (``quant.gemm``)."""
        out = super().paths(dtype)
        bias = None if self.bias is None else self.bias.data
        if rowops.available(self.weight):
            off = self.kernel_offset
            if self.affine and off is None:
                off = self.weight_scale * self.weight_zero_point.float()  # (N,) s * z, once per plan
            out["rows"] = rowops.int8_weight(self.weight, self.weight_scale, off, bias)
        if gemm.available(self.weight, self.out_features, self.in_features, dtype):
            out["gemm"] = gemm.int8(self.weight, self.weight_scale, self.weight_zero_point, bias)
        return out

    def _gemv_space(self, dtype: torch.dtype):
        if not self.weight.is_cuda:
            return None
        return triton_ops.int8_gemv_space(self.out_features, self.in_features,
                                          triton_ops.multiprocessors(self.weight.device))

    def _kernel_matmul(self, x2: torch.Tensor, gemv_config: tuple[int, ...] | None = None,
                       gated: str | None = None, norm=None):
        if x2.is_cuda:
            return triton_ops.int8_matmul(x2, self.weight, self.weight_scale, self.weight_zero_point,
                                          gemv_config or self.gemv_config, gated, norm)
        if gated is not None or norm is not None:
            raise ValueError("the CPU's int8 kernels have no epilogues")
        s = self.kernel_scale  # the kernel takes its scales in x's dtype: converted once by prepare, not per call
        if s is None or s.dtype != x2.dtype:
            s = self.weight_scale.to(x2.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, s)  # (M, N)
        if self.affine:
            sz = self.kernel_offset
            if sz is None:
                sz = self.weight_scale * self.weight_zero_point.float()  # (N,)
            rows = x2.sum(-1, keepdim=True, dtype=torch.float32)  # (M, 1)
            y = torch.addcmul(y.float(), rows, sz, value=-1.0).to(x2.dtype)  # y - rowsum(x) * s * z
        return y


class W8A8Linear(QuantizedLinear):
    """int8 weights (per output channel) x int8 activations (per tensor static, or per token dynamic).

    y = (q_x @ q_w^T) * s_x * s_w with the integer product from `torch._int_mm` (int8 x int8 -> int32).
    `smooth_scale`, when present, is the SmoothQuant divisor that could not be folded into a
    preceding op; activations are divided by it before quantization. `rotate` (a block size, 0: none): the weight
    was stored rotated (W H^T, quant.hadamard) and the input is rotated after the smoothing, before quantization.

    Not fused: each Linear calibrated its own static input scale, so sharing one input quantization would
    change the numbers.
    """

    SPEC_TYPE = "w8a8"
    PARAM_TENSORS = ("weight_scale", "input_scale", "smooth_scale")

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dynamic: bool, smooth: bool, device=None,
        rotate: int = 0,
    ):
        super().__init__()
        if not (type(rotate) is int and rotate == 0) and not hadamard.is_block(in_features, rotate):
            raise ValueError(f"w8a8: rotate must be a power of two >= 2 dividing the {in_features} input features, "
                             f"got {rotate!r}")
        self.in_features, self.out_features, self.dynamic, self.rotate = in_features, out_features, dynamic, rotate
        self.register_buffer("weight", _empty((out_features, in_features), torch.int8, device))
        self.register_buffer("weight_scale", _empty((out_features,), torch.float32, device))
        if dynamic:
            self.input_scale = None
        else:
            self.register_buffer("input_scale", _empty((), torch.float32, device))
        if smooth:
            self.register_buffer("smooth_scale", _empty((in_features,), torch.float32, device))
        else:
            self.smooth_scale = None
        self.bias = nn.Parameter(_empty((out_features,), torch.float32, device), requires_grad=False) if bias else None

    @classmethod
    def from_float(
        cls, linear: nn.Linear, input_scale: float | None, smooth_scale: torch.Tensor | None = None,
        weight: tuple[torch.Tensor, torch.Tensor] | None = None, rotate: int = 0,
    ) -> "W8A8Linear":
        """`linear` must already carry the smoothing in its weight columns, and the rotation when `rotate`.
        `weight`: its int8 codes (N, K) and per-row scales (N,) when already quantized (GPTQ); else rounded to
        nearest here."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, input_scale is None,
                smooth_scale is not None, rotate=rotate)
        m.weight, m.weight_scale = weight if weight is not None else P.quantize_weight_sym(linear.weight.data)
        if input_scale is not None:
            m.input_scale = torch.tensor(float(input_scale), dtype=torch.float32)
        if smooth_scale is not None:
            m.smooth_scale = smooth_scale.detach().float().clone()
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.data.detach().clone().float(), requires_grad=False)
        return m

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        """After loading: the kernel's layout requirements (alignment); on CUDA the rotation's factors, where it
        takes them, made before any graph capture."""
        self.weight = _aligned(self.weight)
        if self.rotate:
            hadamard.warm(self.rotate, torch.float32, self.weight.device)

    def spec(self) -> dict:
        out = {
            "type": self.SPEC_TYPE,
            "dynamic": self.dynamic,
            "smooth": self.smooth_scale is not None,
            "bias": self.bias is not None,
        }
        if self.rotate:  # absent when 0: artifacts without rotations keep the specs they always had
            out["rotate"] = self.rotate
        return out

    @classmethod
    def from_spec(cls, spec: dict, in_features: int, out_features: int, device=None) -> "W8A8Linear":
        return cls(in_features, out_features, spec["bias"], spec["dynamic"], spec["smooth"], device=device,
                   rotate=spec.get("rotate", 0))

    def kernel(self, dtype: torch.dtype) -> str:
        act = "per-token dynamic" if self.dynamic else "per-tensor static"
        rot = f", rotated in blocks of {self.rotate} (Walsh-Hadamard) before the rounding" if self.rotate else ""
        return (f"int8 x int8 products by torch._int_mm, in fp32, (bf16) through _weight_int8pack_mm or in a tiled "
                f"C++ product (quant.gemm), or the whole Linear in one C++ pass (quant.rows), per row count the "
                f"fastest on the serving CPU; {act} activations{rot}, fp32 rescale")

    def _transform(self, x2: torch.Tensor) -> torch.Tensor:
        """The input the int8 grid sees: divided by the explicit smoothing, then rotated (fp32 when either)."""
        fresh = self.smooth_scale is not None or x2.dtype != torch.float32  # x2 becomes a tensor of our own
        if self.smooth_scale is not None:
            x2 = x2.float() / self.smooth_scale
        if self.rotate:
            x2 = x2.float()
            x2 = hadamard.rotate_(x2, self.rotate) if fresh else hadamard.rotate(x2, self.rotate)  # (M, K)
        return x2

    def _quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = self._transform(x2)
        if self.dynamic:
            return P.quantize_act_dynamic(x2)  # (M, K) int8, (M, 1)
        return P.quantize_act_static(x2, self.input_scale), self.input_scale

    def static_path(self, rows: int, dtype: torch.dtype) -> str:
        """``torch._int_mm`` where it is exact and beats an fp32 product on this device (checked once), else fp32."""
        return "int_mm" if P.int_mm_is_usable(self.weight.device) else "fp32"

    def paths(self, dtype: torch.dtype) -> dict:
        """The same integer product three ways, rescaled in fp32 (the bias added there), then rounded to ``dtype``:
        int_mm: ``torch._int_mm`` (fast with VNNI/AMX or on CUDA, ~25x slower than fp32 on AVX2-only CPUs);
        fp32: the int8 values as fp32 (products exact, sums exact below 2^24); int8pack (bf16, CPU): the
        quantized activations as bf16 (exact) through ``aten._weight_int8pack_mm`` with unit scales, whose sums
        come back rounded to bf16 before the rescale; rows (CPU): all of it in one C++ call (``quant.rows``),
        equal to int_mm bit for bit, for the few-row products where a dozen small ops cost more than the bytes;
        gemm (bf16, CPU): the fp32 path's numbers in one tiled C++ product (``quant.gemm``), for many rows."""
        out = {}
        if P.int_mm_is_exact(self.weight.device):  # not on CPUs without VNNI: oneDNN's sums saturate there
            out["int_mm"] = lambda x: self._finish(*self._int_mm(x), dtype)
        if self.weight.device.type == "cpu":
            out["fp32"] = lambda x: self._finish(*self._fp32_product(x), dtype)
            if dtype == torch.bfloat16:
                ones = torch.ones(self.out_features, dtype=torch.bfloat16, device=self.weight.device)
                out["int8pack"] = lambda x: self._finish(*self._int8pack_product(x, ones), dtype)
            bias = None if self.bias is None else self.bias.data
            if rowops.available(self.weight):
                out["rows"] = rowops.w8a8(self.weight, self.weight_scale, None if self.dynamic else self.input_scale,
                                          self.smooth_scale, bias, self.rotate)
            if gemm.available(self.weight, self.out_features, self.in_features, dtype):
                mm = gemm.w8a8(self.weight, self.weight_scale, bias)
                out["gemm"] = lambda x: mm(*self._quantize_input(x))
        return out

    def _int_mm(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = self._quantize_input(x2)
        m = xq.shape[0]
        if xq.is_cuda and m <= 16:
            # cuBLASLt's int8 GEMM needs more than 16 rows; pad and slice.
            xq = F.pad(xq, (0, 0, 0, 17 - m))
        return torch._int_mm(xq, self.weight.t())[:m], xs  # (M, N) int32

    def _fp32_product(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = self._quantize_input(x2)
        return xq.float() @ self.weight.float().t(), xs  # (M, N)

    def _int8pack_product(self, x2: torch.Tensor, ones: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = self._quantize_input(x2)
        return torch.ops.aten._weight_int8pack_mm(xq.to(torch.bfloat16), self.weight, ones), xs  # (M, N)

    def _finish(self, acc: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = acc.float() * (xs * self.weight_scale)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module's function from its dequantized weight and fake-quantized input, in fp32, or in float64 for
        float64 inputs: there the weight, the quantized input and their products are exact and only the sums
        round (~1e-16), so a rounding to the int8 grid comes out the same on every CPU (`quant eval`, #43)."""
        ct = P.compute_dtype(x.dtype)
        x2 = x.reshape(-1, self.in_features).to(ct)  # (M, K)
        if self.smooth_scale is not None:
            x2 = x2 / self.smooth_scale.to(ct)
        if self.rotate:
            x2 = hadamard.rotate(x2, self.rotate)  # the butterfly's fixed sums: the same on every CPU
        xf = P.fake_quant_act(x2, None if self.dynamic else float(self.input_scale))
        w = P.dequantize_weight(self.weight, self.weight_scale, dtype=ct)  # (N, K)
        b = None if self.bias is None else self.bias.to(ct)
        return F.linear(xf, w, b).reshape(*x.shape[:-1], self.out_features)
