"""Weight-only int8 Linears (int8-sym, int8-affine): one scale (and zero-point) per output channel, float
activations."""

from __future__ import annotations

import torch
from torch import nn

from quant.runtime import primitives as P
from quant.runtime.kernels import dequant, gemm, triton_ops
from quant.runtime.kernels import rows as rowops
from quant.runtime.linear import (
    WeightOnlyLinear,
    _aligned,
    _empty,
    fused_bias,
    view_rows,
)

# Up to this many rows (tokens) the weight-only int8 kernel wins; at 512 rows a dequantized dense
# matmul is faster on CPU (bench/RESULTS.md#cpu-kernels-per-linear-benchlinear_pathspy).
INT8PACK_MAX_ROWS = 64


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
            return ("Triton int8 weight-only kernels (quant.runtime.kernels.triton_ops.int8_matmul): a GEMV at one row, a tiled GEMM "
                    "above, every row count")
        if self.has_kernel(dtype):
            corr = " - rowsum(x)*s*z" if self.affine else ""
            return (f"aten._weight_int8pack_mm{corr}, one C++ pass (quant.runtime.kernels.rows), a tiled C++ product (quant.runtime.kernels.gemm, "
                    f"bf16) or dequantize + matmul (bf16 or fp32), per row count the fastest on the serving CPU "
                    f"(quant serve --kernels; static rule: the kernel up to {INT8PACK_MAX_ROWS} rows)")
        return ("dequantize + matmul, or one C++ pass (quant.runtime.kernels.rows) where measured faster (the fp32 int8pack "
                "kernel is slower than dense on CPU)")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant.int8(self.weight, self.weight_scale, self.weight_zero_point, dtype)

    def paths(self, dtype: torch.dtype) -> dict:
        """As every weight-only module's, and on CPU the rows passes (:meth:`_rows_products`; at a few rows a dozen
        small ops cost more than the bytes); ``gemm`` for many bf16 rows where the CPU has AVX512-BF16
        (``quant.runtime.kernels.gemm``)."""
        out = super().paths(dtype)
        out.update(self._rows_products(dtype))
        if gemm.available(self.weight, self.out_features, self.in_features, dtype):
            bias = None if self.bias is None else self.bias.data
            out["gemm"] = gemm.int8(self.weight, self.weight_scale, self.weight_zero_point, bias)
        return out

    def _rows_products(self, dtype: torch.dtype) -> dict[str, rowops.Product]:
        """The C++ rows passes over the int8 weight (``quant.runtime.kernels.rows``), by path name: ``rows`` (the
        whole Linear in one pass, in fp32, rounded once) and, for 16-bit inputs where the build has it, ``rows16``
        (the same pass on x held as int16 in blocks of 32 with power-of-two scales: exact integer sums, 16 products
        an instruction, within 2^-14 of the exact product's largest output)."""
        if not rowops.available(self.weight):
            return {}
        bias = None if self.bias is None else self.bias.data
        off = self.kernel_offset
        if self.affine and off is None:
            off = self.weight_scale * self.weight_zero_point.float()  # (N,) s * z, once per plan
        out = {"rows": rowops.int8_weight(self.weight, self.weight_scale, off, bias)}
        if dtype in (torch.bfloat16, torch.float16) and self.in_features % 32 == 0 and rowops.rows16_built():
            out["rows16"] = rowops.int8_weight16(self.weight, self.weight_scale, off, bias)
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
