"""W8A8 Linears: int8 weights (one scale per output channel) times int8 activations (one static scale per
tensor, or dynamic per token), with the smoothing divisor and the online rotation the build left on the input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quant.runtime import hadamard
from quant.runtime import primitives as P
from quant.runtime.kernels import gemm
from quant.runtime.kernels import rows as rowops
from quant.runtime.linear import QuantizedLinear, _aligned, _empty


class W8A8Linear(QuantizedLinear):
    """int8 weights (per output channel) x int8 activations (per tensor static, or per token dynamic).

    y = (q_x @ q_w^T) * s_x * s_w with the integer product from `torch._int_mm` (int8 x int8 -> int32).
    `smooth_scale`, when present, is the SmoothQuant divisor that could not be folded into a
    preceding op; activations are divided by it before quantization. `rotate` (a block size, 0: none): the weight
    was stored rotated (W H^T, quant.runtime.hadamard) and the input is rotated after the smoothing, before quantization.

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
                f"C++ product (quant.runtime.kernels.gemm), or the whole Linear in one C++ pass (quant.runtime.kernels.rows), per row count the "
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
        come back rounded to bf16 before the rescale; rows (CPU): all of it in one C++ call (``quant.runtime.kernels.rows``),
        equal to int_mm bit for bit, for the few-row products where a dozen small ops cost more than the bytes;
        gemm (bf16, CPU): the fp32 path's numbers in one tiled C++ product (``quant.runtime.kernels.gemm``), for many rows."""
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
        round (~1e-16), so a rounding to the int8 grid comes out the same on every CPU (`quant eval`)."""
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
