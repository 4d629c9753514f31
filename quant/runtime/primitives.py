"""Quantization arithmetic shared by the build (offline) and the runtime layers.

Conventions (all per output channel for weights, W of shape (N, K)):
- symmetric int8: q in [-127, 127], W ~ s * q, s = absmax / 127. -128 is never used so that the range
  is symmetric and negation is exact.
- affine int8: the uint8 grid [0, 255] with a rounded zero-point z, stored shifted into int8
  (q8 = q - 128, z8 = z - 128) so that the int8 kernels apply: W ~ s * (q8 - z8). The range always
  contains 0.0 so that zero weights stay exactly zero.
- activations: symmetric int8 in [-127, 127]; per tensor (static, calibrated), per token (dynamic), or per block of
  ACT_BLOCK columns of a token (int4 weights' int8 activations, llama.cpp's Q8 blocks).
"""

from __future__ import annotations

import time

import torch

from quant.runtime.kernels.native import cpu_flags

QMAX = 127
# Scales are never zero: an all-zero channel gets this scale and quantizes to q = 0 exactly.
MIN_SCALE = 1e-8
ACT_BLOCK = 32  # columns per scale of block-quantized activations


def weight_scale_sym(w: torch.Tensor) -> torch.Tensor:
    """The per-row scale of symmetric int8 for w (N, K): absmax / 127, never zero. (N,)"""
    return (w.abs().amax(dim=1) / QMAX).clamp_min(MIN_SCALE)


def quantize_weight_sym(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K), scale fp32 (N,)."""
    w = w.float()
    scale = weight_scale_sym(w)  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # (N, K)
    return q, scale


def quantize_weight_affine(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) shifted uint8 grid, scale fp32 (N,), zero-point int8 (N,)."""
    w = w.float()
    lo = w.amin(dim=1).clamp_max(0.0)  # (N,)
    hi = w.amax(dim=1).clamp_min(0.0)  # (N,)
    scale = ((hi - lo) / 255.0).clamp_min(MIN_SCALE)  # (N,)
    zero = torch.round(-lo / scale).clamp_(0, 255)  # (N,) on the uint8 grid
    q = (torch.round(w / scale[:, None]) + zero[:, None]).clamp_(0, 255)  # (N, K)
    return (q - 128).to(torch.int8), scale, (zero - 128).to(torch.int8)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    ct = compute_dtype(dtype)  # float64: exact
    w = q.to(ct)
    if zero is not None:
        w = w - zero.to(ct)[:, None]
    return (w * scale.to(ct)[:, None]).to(dtype)


def fake_quant_weight(w: torch.Tensor, affine: bool = False) -> torch.Tensor:
    if affine:
        return dequantize_weight(*quantize_weight_affine(w))
    return dequantize_weight(*quantize_weight_sym(w))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a reference computation takes values of ``dtype`` in: fp32, or float64 kept (the reference evaluation's
    arithmetic, the same on every CPU)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x.to(compute_dtype(x.dtype))


def quantize_act_static(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor symmetric int8 with a calibrated scale; values beyond the threshold saturate."""
    return torch.round(_compute(x) / scale).clamp_(-QMAX, QMAX).to(torch.int8)


def quantize_act_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) symmetric int8: (M, K) -> int8 (M, K), scale (M, 1) fp32 (float64 for float64 x)."""
    x = _compute(x)
    scale = (x.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(MIN_SCALE)  # (M, 1)
    return torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_act_blocks(x: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (M, K) fp32 (float64 for float64 x): each row quantized symmetrically in blocks of ACT_BLOCK columns
    (scale max |x| / QMAX, at least MIN_SCALE; round half to even) and dequantized, the activations an int8-activation
    product sees. A row that is not finite comes back not finite."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"block-quantized activations need K a multiple of {ACT_BLOCK}, got {k}")
    return fake_quant_act(x.reshape(-1, ACT_BLOCK), None).reshape(m, k)  # each block a token of its own


ACT16_MAX = 32767  # int16 block activations: |q| at most


def quantize_act_blocks16(x: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (M, K) fp32 (float64 for float64 x): each row as int16 in blocks of ACT_BLOCK columns, the block's
    scale the power of two d = 2^(e - 15) for its max |x| in [2^(e-1), 2^e) (so |x| / d < 2^15), q = x / d rounded
    half to even and held to ACT16_MAX, then q * d: the activations the int4 ``rows16`` path multiplies. x / d is
    exact, so an element within 2^7 of its block's max (within 2^4 in fp16) comes back as it was; below that, what
    lies under d / 2 <= 2^-15 of the block's max is rounded away. A row that is not finite comes back not finite."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"block-quantized activations need K a multiple of {ACT_BLOCK}, got {k}")
    xb = _compute(x).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    e = torch.frexp(top).exponent.clamp_min(-100)  # max |x| = f 2^e, f in [0.5, 1)
    d = torch.ldexp(torch.ones((), dtype=xb.dtype), (e - 15).to(xb.dtype))
    q = torch.round(xb / d).clamp_(-ACT16_MAX, ACT16_MAX) * d
    return torch.where(top.isfinite(), q, xb).reshape(m, k)  # a block that is not finite stays so


def fake_quant_act(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Static (scale given) or dynamic (scale None) activation fake-quantization, in fp32 (float64 for float64
    x)."""
    ct = compute_dtype(x.dtype)
    if scale is None:
        q, s = quantize_act_dynamic(x)
        return q.to(ct) * s
    return quantize_act_static(x, scale).to(ct) * scale


def smooth_factors(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel s = max|X|^alpha / max|W|^(1-alpha).

    X is divided by s and W's columns multiplied by it, so the product is unchanged while activation
    outliers move into the weights. Channels that never fire, or whose weights are all zero, keep s = 1.
    """
    a = act_absmax.float().clamp_min(1e-5)
    w = w_absmax.float().clamp_min(1e-5)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    dead = (act_absmax <= 0) | (w_absmax <= 0)
    return torch.where(dead, torch.ones_like(s), s).clamp_min(1e-5)


def _seconds(f, calls: int = 3) -> float:
    """Wall time of `calls` calls of `f` after one warm-up call: the once-per-process probes below."""
    f()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    return time.perf_counter() - t


_BF16_FASTER: dict[str, bool] = {}
BF16_DOT_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo's names (x86, and Arm's "Features")


def bf16_matmul_is_faster(device: torch.device) -> bool:
    """Whether a bf16 matmul beats an fp32 one on `device`, measured once per device type on a calibration-sized
    product. With AVX512-BF16 or AMX oneDNN's bf16 GEMM is ~4x the fp32 rate; on AVX2-only CPUs bf16 is
    emulated, ~8x slower; CUDA GPUs with bf16 support multiply it faster. A CPU without a bf16 dot-product
    instruction (AVX512-BF16, AMX-BF16, Arm's BF16) is answered without the probe (~1 s of emulated products)."""
    key = torch.device(device).type
    if key not in _BF16_FASTER:
        if key == "cuda":
            _BF16_FASTER[key] = torch.cuda.is_bf16_supported()
        elif not set(cpu_flags().split()) & BF16_DOT_FLAGS:
            _BF16_FASTER[key] = False
        else:
            g = torch.Generator().manual_seed(0)
            a, b = torch.randn(512, 576, generator=g), torch.randn(576, 1536, generator=g)
            a16, b16 = a.bfloat16(), b.bfloat16()
            # a clear win only: noise must not flip it
            _BF16_FASTER[key] = _seconds(lambda: a16 @ b16) < 0.8 * _seconds(lambda: a @ b)
    return _BF16_FASTER[key]


_INT_MM_FASTER: dict[str, bool] = {}


def int_mm_is_faster(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` beats an fp32 matmul on `device`, measured once per device type. On CPUs
    with int8 dot-product instructions (VNNI, AMX) it is ~2x faster; on AVX2-only ones ~25x slower
    (bench/RESULTS.md#cpu-kernels-per-linear-benchlinear_pathspy), so calibration, which only needs the product's value, picks per machine."""
    key = torch.device(device).type
    if key not in _INT_MM_FASTER:
        if key == "cuda":
            _INT_MM_FASTER[key] = True
        else:
            g = torch.Generator().manual_seed(0)
            a = torch.randint(-127, 128, (256, 512), generator=g, dtype=torch.int8)
            b = torch.randint(-127, 128, (512, 512), generator=g, dtype=torch.int8)
            af, bf = a.float(), b.float()
            _INT_MM_FASTER[key] = _seconds(lambda: torch._int_mm(a, b)) < _seconds(lambda: af @ bf)
    return _INT_MM_FASTER[key]


_INT_MM_EXACT: dict[str, bool] = {}


def int_mm_is_exact(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly on `device`, checked once per device type on the worst
    case of our quantizers (every value at +-QMAX). oneDNN's int8 GEMM on a CPU without VNNI (AVX2) adds pairs of
    u8 x s8 products in saturating 16-bit lanes (vpmaddubsw): its sums come back wrong, so there it is not used."""
    key = torch.device(device).type
    if key not in _INT_MM_EXACT:
        a = torch.full((32, 64), QMAX, dtype=torch.int8, device=device)
        b = torch.full((64, 32), QMAX, dtype=torch.int8, device=device)
        b[:, 1::2] = -QMAX
        want = torch.full((32, 32), 64 * QMAX * QMAX, dtype=torch.int32, device=device)
        want[:, 1::2] = -want[:, 1::2]
        _INT_MM_EXACT[key] = bool(torch.equal(torch._int_mm(a, b), want))
    return _INT_MM_EXACT[key]


def int_mm_is_usable(device: torch.device) -> bool:
    """``torch._int_mm`` is both exact and faster than an fp32 product on `device`."""
    return int_mm_is_exact(device) and int_mm_is_faster(device)


def int8_product(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq (M, K) int8 @ wq (N, K)^T int8 -> (M, N) fp32: exact integer products, summed exactly by
    ``torch._int_mm`` where it is exact and this device's faster path, else in fp32 (exact up to 2**24 per partial
    sum)."""
    m, k = xq.shape
    if int_mm_is_usable(xq.device) and m > 16 and k % 8 == 0 and wq.shape[0] % 8 == 0:
        return torch._int_mm(xq, wq.t()).float()
    return xq.float() @ wq.float().t()
