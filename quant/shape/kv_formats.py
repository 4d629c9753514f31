"""KV cache formats and what a token costs in each: the pure arithmetic (no torch) that the pool, the capacity plan
and ``quant estimate`` size the cache with. quant/runtime/kv_quant.py holds each format's round trip.

A format holds a K or V vector (one token, one KV head) as ``bits``-bit codes with a scale (and a minimum when
asymmetric) of ``scale_bytes`` each, per token and KV head, or for keys per channel over a group of tokens (KIVI):

- ``int8``: symmetric, a scale per token per KV head (llama.cpp's q8_0, TensorRT-LLM's INT8 KV), keys and values
  rotated first by a Walsh-Hadamard transform over head_dim (QuaRot: it spreads a vector's outlier channels before
  one scale covers them; attention rotates each query the same way, so q.k is unchanged, and its output back);
  ``int8-rotk`` rotates the keys only, ``int8-rotv`` the values only, ``int8-plain`` neither;
- ``fp8``: e4m3 codes with a scale per token per KV head (vLLM's and SGLang's FP8 KV keep one per tensor);
- ``int4-token``: asymmetric (scale and minimum) per token per KV head; ``int4-token-rot`` rotates the keys first;
  ``int4-chan`` scales keys per channel over each block of ``key_group`` tokens (KIVI), values per token;
  ``int4`` as int4-chan over 32-token groups, values rotated, and KIVI's residual: a position whose group
  is not complete yet is held in ``residual`` (int8-rotv: the keys unrotated, as the per-channel codes are made
  from them; the values rotated, as their codes are), so the queries of its own group read it so, and only the
  later groups' queries read the int4 codes, which are made from the residual's values once the group completes
  (with ``residual_values`` the values likewise; without, the values are quantized as they are written).

The float dtypes (``FLOAT_BYTES``) hold K and V as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int
    asymmetric: bool = False
    fp8: bool = False
    rotate_keys: bool = False
    rotate_values: bool = False  # values rotated too (attention's output rotated back)
    key_group: int = 0  # > 0: keys scaled per channel over blocks of this many tokens (KIVI)
    residual: str = ""  # a format: the incomplete group is held in it until the group completes (KIVI's residual)
    residual_values: bool = True  # with a residual: the values held in it too (else quantized as written)
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

    def residual_bytes(self, head_dim: int) -> int:
        """Bytes a sequence's residual costs per KV head: its ``key_group`` tokens' K (and V) in the residual's
        format; 0 without one."""
        if not self.residual:
            return 0
        held = FORMATS[self.residual]
        per_token = held.bytes_per_vector(head_dim, key=True) + (held.bytes_per_vector(head_dim)
                                                                 if self.residual_values else 0)
        return self.key_group * per_token

    def key_block(self, head_dim: int) -> int:
        """The block of the keys' Walsh-Hadamard rotation (the largest power of two dividing head_dim), or 0 where
        the format does not rotate keys or head_dim is odd."""
        return self._block(head_dim) if self.rotate_keys else 0

    def value_block(self, head_dim: int) -> int:
        """The block of the values' rotation, or 0."""
        return self._block(head_dim) if self.rotate_values else 0

    @staticmethod
    def _block(head_dim: int) -> int:
        block = head_dim & -head_dim
        return block if block >= 2 else 0


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("int8", 8, rotate_keys=True, rotate_values=True),
    KVFormat("int8-rotk", 8, rotate_keys=True),
    KVFormat("int8-rotv", 8, rotate_values=True),
    KVFormat("int8-plain", 8),
    KVFormat("fp8", 8, fp8=True),
    KVFormat("int4-token", 4, asymmetric=True),
    KVFormat("int4-token-rot", 4, asymmetric=True, rotate_keys=True),
    KVFormat("int4-chan", 4, asymmetric=True, key_group=16),
    KVFormat("int4", 4, asymmetric=True, key_group=32, rotate_values=True, residual="int8-rotv"),
    KVFormat("int4-kres", 4, asymmetric=True, key_group=32, rotate_values=True, residual="int8-rotv",
             residual_values=False),
)}


def names() -> list[str]:
    return [*FLOAT_BYTES, *FORMATS]


def token_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes one token's K and V of one KV head cost in ``kv_dtype`` (a float dtype's name or a format's)."""
    if kv_dtype in FLOAT_BYTES:
        return 2 * head_dim * FLOAT_BYTES[kv_dtype]
    fmt = FORMATS.get(kv_dtype)
    if fmt is None:
        raise ValueError(f"no KV cache format {kv_dtype!r}; there are {', '.join(names())}")
    return fmt.bytes_per_token(head_dim)
