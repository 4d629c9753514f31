"""RMSNorm, as the fused glue op (``server.fastops``) or its eager reference.

Llama-style norms scale by w; Gemma's scale by (1 + w): that weight is formed once at load, in fp32, then cast
to the activation dtype, so both kinds run the same kernel. (transformers multiplies Gemma's fp32 normalised
values by 1 + w before rounding once; in 16-bit dtypes ours rounds the normalised values first, a last-bit
difference. In float32 the two are the same arithmetic.)
"""

from __future__ import annotations

from torch import Tensor


class RMSNorm:
    def __init__(self, weight: Tensor, eps: float, ops, dtype, offset: float = 0.0):
        w = weight.detach()
        self.weight = (w.float() + offset).to(dtype) if offset else w.to(dtype)  # (n,)
        self.eps = float(eps)
        self.ops = ops

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., n) -> rms_norm(x) * w, as contiguous rows (a strided view is copied first)."""
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps).view(shape)

    def add(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)) in one pass: the residual add folded into the next norm."""
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)
