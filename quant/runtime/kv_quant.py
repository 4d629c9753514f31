"""Each KV cache format's plain reference (quant/shape/kv_formats.py defines the formats and their bytes): the round
trip of a stored vector, and for the formats the served pool holds (int8, fp8: codes with a float16 scale per
token per KV head; int8's keys and values rotated first, ``rotate``) the codes and scales themselves.

``round_trip`` is what attention sees of a stored vector: quantized then dequantized, in the input's dtype. The
served pool's kernels (server/csrc/kv_rows.h) read back exactly this (their tests hold them to it); ``quant eval
--kv-dtype`` and bench/kv_quality.py measure what it costs.
"""

from __future__ import annotations

import torch

from quant.runtime import hadamard
from quant.shape.kv_formats import FORMATS, KVFormat, names

FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
POOL_FORMATS = ("int8", "fp8")  # held by the served pool: codes (CODE_DTYPES) and a float16 scale per vector
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (codes (..., head_dim), float16 scales (...)) of a symmetric per-vector format (int8,
    fp8): scale = amax / qmax held as float16 (at least 2^-14), codes = x / scale rounded (int8: to nearest even,
    clamped to +-127; fp8: e4m3 as torch converts, within +-448)."""
    xf = x.float()
    qmax = 448.0 if fmt.fp8 else float(2 ** (fmt.bits - 1) - 1)
    s = _half(xf.abs().amax(-1, keepdim=True) / qmax)
    y = (xf / s).clamp(-qmax, qmax)
    codes = y.to(torch.float8_e4m3fn) if fmt.fp8 else torch.round(y).to(torch.int8)
    return codes, s[..., 0].half()


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """Keys or values (..., head_dim) as a format that rotates them stores them: H x in fp32 (quant.runtime.hadamard's
    butterfly, bit for bit the sums the C++ store makes). The queries that read rotated keys are rotated the same
    way; an output over rotated values is rotated back by the same H (its own inverse). block 0: x."""
    return hadamard.rotate(x.float(), block) if block else x


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., head_dim) and their float16 scales (...) back to values: code * scale in fp32, then ``dtype``."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def round_trip_format(fmt: KVFormat, x: torch.Tensor, key: bool) -> torch.Tensor:
    """x (..., tokens, head_dim) as attention reads it back once stored in ``fmt``: quantized, then dequantized."""
    if key and fmt.key_group:
        return _channel_groups(x, fmt.bits, fmt.key_group)
    block = fmt.key_block(x.shape[-1]) if key else fmt.value_block(x.shape[-1])
    if block:  # H is symmetric and orthonormal: H Q(H x) is the stored vector seen unrotated
        return hadamard.rotate(_per_vector(fmt, hadamard.rotate(x, block)), block)
    return _per_vector(fmt, x)


def _per_vector(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    if fmt.asymmetric:
        return _min_scale(x.float(), fmt.bits, -1).to(x.dtype)
    return dequantize(*quantize(fmt, x), x.dtype)


def _half(s: torch.Tensor) -> torch.Tensor:
    """A scale as float16 holds it, never zero (an all-zero vector stays zero whatever its scale)."""
    return s.clamp(min=2.0**-14).half().float()


def _min_scale(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric ``bits``-bit round trip over ``dim``: codes q = round((x - min) / s), s = (max - min) / (2^bits - 1),
    back as q s + min, the minimum and the scale held as float16 (KIVI's form: no integer zero point, so a range
    that does not straddle zero loses nothing to clamping)."""
    lo = x.amin(dim, keepdim=True).half().float()
    s = _half((x.amax(dim, keepdim=True) - lo) / (2**bits - 1))
    return torch.round((x - lo) / s).clamp(0, 2**bits - 1) * s + lo


def _channel_groups(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric ``bits``-bit round trip with a scale and minimum per channel over each block of ``group`` tokens
    (the last block may be shorter)."""
    t = x.shape[-2]
    pad = (-t) % group
    xf = x.float()
    if pad:
        xf = torch.cat([xf, xf[..., -1:, :].expand(*xf.shape[:-2], pad, xf.shape[-1])], -2)
    g = xf.reshape(*xf.shape[:-2], -1, group, xf.shape[-1])  # (..., groups, group, head_dim)
    return _min_scale(g, bits, -2).reshape(xf.shape)[..., :t, :].to(x.dtype)


def round_trip(name: str, x: torch.Tensor, key: bool) -> torch.Tensor:
    """``x`` as a cache of format or float dtype ``name`` gives it back (a float dtype: rounded to it)."""
    if name in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[name]).to(x.dtype)
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"no KV cache format {name!r}; there are {', '.join(names())}")
    return round_trip_format(fmt, x, key)
