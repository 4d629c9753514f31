"""The counter-based random stream of the sampler's draw: uniforms that are a pure function of (seed, step, v).

A draw must be reproducible from ``(seed, step)`` alone: the same request must produce the same tokens whether it
runs alone or batched with others, after preemption and recompute, on CPU or CUDA. The obvious design, one
``torch.Generator`` per request and a Python loop over the batch, breaks all of that cheaply: it costs B small
kernel launches per step, its state depends on how many numbers were drawn before (so on vocab size, retries and
code paths), it must be saved and restored with the request, and CPU and CUDA generators give different streams.
Instead the uniforms are a pure function, a counter-based hash::

    u[b, v] = U(murmur3_32(seed_b, step_b, v; salt A), murmur3_32(seed_b, step_b, v; salt B))

MurmurHash3_x86_32 of the 20-byte message (seed lo, seed hi, step lo, step hi, v) as little-endian 32-bit
words, once per salt; the two 32-bit hashes give 52 random bits and ``u = (x + 0.5) / 2**52``, strictly inside
(0, 1). The sampler (server/sampling.py, step 8) takes the Gumbel-max draw ``argmax_v(log p[b, v] - log(-log
u[b, v]))``, which is distributed exactly as Categorical(p). All of it is vectorised integer tensor arithmetic
over (B, V): no per-row loop, no generator state, no host synchronisation, and row b's result depends only on row
b's logits, params, seed and step (batch-invariant). Token-level batch invariance still needs batch-invariant
logits from the model.

The 32-bit multiplies run on int64 tensors. A 32x32-bit product can overflow int64 (undefined behaviour in the
C++ kernels), so constants are split into 16-bit halves: every partial product stays below 2**48 and the result
is masked back to 32 bits. Its reference is plain MurmurHash3 on bytes (tests/test_sampling.py, checked against
the published test vectors).
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593  # MurmurHash3_x86_32 block constants
_SALTS = (0x9E3779B9, 0x7F4A7C15)  # hash seeds of the two independent 32-bit streams
_MSG_BYTES = 20  # seed lo/hi, step lo/hi, vocab id: five 32-bit words


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): split c in 16-bit halves so no int64 product overflows."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of this product survive mod 2**32
    return (lo + hi) & _M32


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _mix_block(k: Tensor) -> Tensor:
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: Tensor, k: Tensor) -> Tensor:
    h = _rotl32(h ^ _mix_block(k), 13)
    return (h * 5 + 0xE6546B64) & _M32  # h * 5 < 2**35: no overflow


def _mul32_(x: Tensor, c: int, tmp: Tensor) -> Tensor:
    """In-place :func:`_mul32` on a (B, V) tensor; ``tmp`` is scratch of the same shape."""
    torch.mul(x, c >> 16, out=tmp).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_M32)


def random_u32(seeds: Tensor, steps: Tensor, ids: int | Tensor, salt: int) -> Tensor:
    """MurmurHash3_x86_32(seed lo, seed hi, step lo, step hi, v; hash seed ``salt``) for every row and every v below
    ``ids`` (an int: (B, V)) or every v of row b's ``ids[b]`` ((B, K) int64: (B, K))."""
    # The four per-row words are absorbed on (B,) tensors and the vocab word's block mix on (V,), once each;
    # the (B, V) remainder runs in place because fresh (B, V) temporaries per op cost several times the
    # arithmetic on CPU. Same operations as _absorb(h, v), then murmur3's length xor and fmix32 finaliser.
    h = torch.full_like(seeds, salt)  # (B,)
    for word in (seeds & _M32, (seeds >> 32) & _M32, steps & _M32, (steps >> 32) & _M32):
        h = _absorb(h, word)  # (B,)
    if isinstance(ids, int):
        ids = torch.arange(ids, dtype=torch.int64, device=seeds.device)[None, :]  # (1, V)
    x = h[:, None] ^ _mix_block(ids)  # (B, V) or (B, K)
    tmp = torch.empty_like(x)  # (B, V) scratch
    torch.bitwise_right_shift(x, 19, out=tmp)
    x.bitwise_left_shift_(13).bitwise_and_(_M32).bitwise_or_(tmp)  # rotl32(x, 13)
    x.mul_(5).add_(0xE6546B64).bitwise_and_(_M32).bitwise_xor_(_MSG_BYTES)  # last block done; xor length
    for mult, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13)):  # fmix32
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        _mul32_(x, mult, tmp)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))  # (B, V)


def random_uniform(seeds: Tensor, steps: Tensor, ids: int | Tensor) -> Tensor:
    """u[b, v] in (0, 1), float64 with 52 random bits, a pure function of (seed_b, step_b, v), for every v below
    ``ids`` (an int) or of row b's ``ids[b]`` ((B, K) int64). The fused CPU op ``quantserve::random_uniform``
    (server/csrc/sampling_ops.cpp) computes the same bits in one pass."""
    a = random_u32(seeds, steps, ids, _SALTS[0])  # (B, V)
    b = random_u32(seeds, steps, ids, _SALTS[1])  # (B, V)
    x = a.bitwise_left_shift_(20).bitwise_or_(b.bitwise_right_shift_(12))  # (B, V) 52 bits, exact in float64
    # + 0.5 keeps u away from 0 and 1 (2**52 - 0.5 is exactly representable), so -log(-log u) is finite.
    return x.to(torch.float64).add_(0.5).mul_(2.0**-52)  # (B, V)

