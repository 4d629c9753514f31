"""KV cache formats: how a K or V vector (one token, one KV head) may be held, and the plain reference of each.

A format quantizes a vector of ``head_dim`` values to ``bits``-bit codes with a scale (and a minimum when
asymmetric) of ``scale_bytes`` each, per token and KV head, or for keys per channel over a group of tokens (KIVI):

- ``int8``: symmetric, a scale per token per KV head (llama.cpp's q8_0, TensorRT-LLM's INT8 KV);
- ``fp8``: e4m3 codes with a scale per token per KV head (vLLM's and SGLang's FP8 KV keep one per tensor);
- ``int4``: asymmetric (scale and minimum) per token per KV head; ``int4-rot`` rotates the keys first by a
  Walsh-Hadamard transform over head_dim (QuaRot: attention's q.k is unchanged when q is rotated too, and the
  rotation spreads a key's outlier channels); ``int4-chan`` scales keys per channel over each block of
  ``group`` tokens (KIVI), values per token.

``round_trip`` is what attention sees of a stored vector: quantized then dequantized, in the input's dtype. The
served pool's kernels must read back exactly this (their tests hold them to it); ``quant eval --kv-dtype`` and
bench/kv_quality.py measure what it costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.runtime import hadamard

FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int
    asymmetric: bool = False
    fp8: bool = False
    rotate_keys: bool = False
    key_group: int = 0  # > 0: keys scaled per channel over blocks of this many tokens (KIVI)
    scale_bytes: int = 2  # each scale (and minimum) held as float16

    def bytes_per_vector(self, head_dim: int, key: bool = False) -> int:
        """Bytes one token's K (``key``) or V of one KV head costs: its codes and its scale (and minimum). Per-channel
        key scales are a scale and minimum per channel per group of tokens: head_dim * 2 * scale_bytes / key_group
        a token."""
        codes = math.ceil(head_dim * self.bits / 8)
        params = 2 if self.asymmetric else 1
        if key and self.key_group:
            return codes + math.ceil(head_dim * params * self.scale_bytes / self.key_group)
        return codes + params * self.scale_bytes

    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes one token's K and V of one KV head cost together."""
        return self.bytes_per_vector(head_dim, key=True) + self.bytes_per_vector(head_dim)

    def round_trip(self, x: torch.Tensor, key: bool) -> torch.Tensor:
        """x (..., tokens, head_dim) as attention reads it back once stored: quantized, then dequantized."""
        if key and self.key_group:
            return _channel_groups(x, self.bits, self.key_group)
        if key and self.rotate_keys:  # H is symmetric and orthonormal: H Q(H x) is the stored key seen unrotated
            block = x.shape[-1] & -x.shape[-1]
            return hadamard.rotate(self._per_vector(hadamard.rotate(x, block)), block)
        return self._per_vector(x)

    def _per_vector(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.fp8:
            s = _half(xf.abs().amax(-1, keepdim=True) / 448.0)
            return ((xf / s).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
        if self.asymmetric:
            return _min_scale(xf, self.bits, -1).to(x.dtype)
        qmax = 2 ** (self.bits - 1) - 1
        s = _half(xf.abs().amax(-1, keepdim=True) / qmax)
        return (torch.round(xf / s).clamp(-qmax, qmax) * s).to(x.dtype)


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


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("int8", 8),
    KVFormat("fp8", 8, fp8=True),
    KVFormat("int4", 4, asymmetric=True),
    KVFormat("int4-rot", 4, asymmetric=True, rotate_keys=True),
    KVFormat("int4-chan", 4, asymmetric=True, key_group=16),
)}


def round_trip(name: str, x: torch.Tensor, key: bool) -> torch.Tensor:
    """``x`` as a cache of format or float dtype ``name`` gives it back (a float dtype: rounded to it)."""
    if name in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[name]).to(x.dtype)
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"no KV cache format {name!r}; there are {', '.join([*FLOAT_DTYPES, *FORMATS])}")
    return fmt.round_trip(x, key)
