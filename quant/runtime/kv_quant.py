"""Each KV cache format's plain reference (quant/shape/kv_formats.py defines the formats and their bytes): the round
trip of a stored vector, and for the formats the served pool holds (int8, fp8: codes with a float16 scale per
token per KV head; int8's keys and values rotated first, ``rotate``) the codes and scales themselves.

``round_trip`` is what attention sees of a stored vector: quantized then dequantized, in the input's dtype. The
served pool's kernels (server/csrc/kv_rows.h) read back exactly this (their tests hold them to it); ``quant eval
--kv-dtype`` and bench/kv_quality.py measure what it costs.
"""

from __future__ import annotations

from dataclasses import replace

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
    """x (..., tokens, head_dim) as attention reads it back once stored in ``fmt``: quantized, then dequantized
    (with a residual: as the queries of later groups read it, made from the residual's values; :func:`held`)."""
    if fmt.residual:
        x = round_trip(fmt.residual, x, key) if key or fmt.residual_values else x
        fmt = replace(fmt, residual="")
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


def asym_codes(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit codes of x over ``dim``: (codes uint8, scale, minimum as float16), s = (max - min) /
    (2^bits - 1) at least 2^-14, codes round((x - min) / s) within [0, 2^bits - 1] (KIVI's form: no integer zero
    point, so a range that does not straddle zero loses nothing to clamping)."""
    lo = x.amin(dim, keepdim=True).half()
    s = _half((x.amax(dim, keepdim=True) - lo.float()) / (2**bits - 1)).half()
    q = torch.round((x - lo.float()) / s.float()).clamp(0, 2**bits - 1).to(torch.uint8)
    return q, s, lo


def _min_scale(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric ``bits``-bit round trip over ``dim`` (:func:`asym_codes`), back as q s + min in fp32."""
    q, s, lo = asym_codes(x, bits, dim)
    return q.float() * s.float() + lo.float()


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


def held(name: str, x: torch.Tensor, key: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (..., tokens, head_dim) as attention reads position j back: (as the queries of later groups read it, as
    the queries of j's own group of ``key_group`` tokens read it), the second None where every query reads the
    first (a format without a residual, or a residual without the values)."""
    done = round_trip(name, x, key)
    fmt = FORMATS.get(name)
    if fmt is None or not fmt.residual or not (key or fmt.residual_values):
        return done, None
    return done, round_trip(fmt.residual, x, key)


def attend_held(q: torch.Tensor, k: tuple, v: tuple, group: int, qpos: torch.Tensor, visible: torch.Tensor,
                scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Attention over a cache read as :func:`held` gives it, in fp32: q (..., H, C, D) at positions ``qpos`` (C,),
    k and v each a pair (done, own) of (..., Hkv, L, D) (own None: done for every query) at positions 0..L-1,
    H a multiple of Hkv; ``visible`` bool, broadcastable to (..., H, C, L). Query i reads key j from ``own`` where
    j // group == qpos[i] // group, else from ``done``; softcap > 0: scores -> softcap * tanh(scores / softcap).
    Returns (..., H, C, D) fp32."""
    rep = q.shape[-3] // k[0].shape[-3]

    def heads(x):
        return None if x is None else x.float().repeat_interleave(rep, -3)

    (kd, ko), (vd, vo) = map(heads, k), map(heads, v)
    qf = q.float()
    s = qf @ kd.transpose(-1, -2) * scale  # (..., H, C, L)
    own = (torch.arange(kd.shape[-2]) // group)[None, :] == (qpos // group)[:, None]  # (C, L)
    if ko is not None:
        s = torch.where(own, qf @ ko.transpose(-1, -2) * scale, s)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    if vo is None:
        return p @ vd
    return (p * ~own) @ vd + (p * own) @ vo


def round_trip(name: str, x: torch.Tensor, key: bool) -> torch.Tensor:
    """``x`` as a cache of format or float dtype ``name`` gives it back (a float dtype: rounded to it)."""
    if name in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[name]).to(x.dtype)
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"no KV cache format {name!r}; there are {', '.join(names())}")
    return round_trip_format(fmt, x, key)
