"""The engine's per-layer glue as Triton kernels: the CUDA counterpart of the fused CPU ops (server/fastops.py holds
the eager reference of each, and the tests hold these to them under ``TRITON_INTERPRET=1`` on a CPU).

Why they exist: on CUDA the eager glue is ~30 small kernels per decoder layer (the RMSNorm's casts and
reductions, rotate-half's slices, negation, concatenation and products, two index copies, SiLU and the product)
around five real ones. A CUDA graph removes their launch cost but not their execution: each still takes a couple
of microseconds of a mostly idle GPU, ~1000 of them per decode step of a 30-layer model, which is most of a
batch-1 step of the default model and a third of Llama-3-8B's (bench/RESULTS.md#gpu-figures-not-re-measured-since-benchgpupy). Here each op is
one kernel:

- ``rms_norm`` / ``add_rms_norm``: one program per row; the residual add rounds once to the dtype (as the eager
  add), the norm runs in fp32, its result rounds to the dtype before the weight's product (as ``ref_rms_norm``);
- ``rope_``: q and k rotated in place in one launch (one program per token and head), rotate-half convention,
  partial rotary (the first R dims of a head), each product and the sum rounded like the eager ops;
- ``store_kv``: one program per token writes its k and v rows to their slot of the paged cache;
- ``rope_store_kv_``: the two above in one launch (the triton attention backend's for prefill chunks; a k head's
  program writes its rotated k and its v head to the cache; decode steps do both inside the attention kernel);
- ``silu_mul`` / ``gelu_tanh_mul``: act(gate) rounded to the dtype, times up. GELU-tanh is computed as
  x·sigmoid(2u), the same function as 0.5·x·(1 + tanh u) without its cancellation for negative x, so it is closer
  to the exact value than the eager op, which it then differs from by more than a rounding near zero.

The arithmetic follows the eager ops' roundings; exp, rsqrt and the order of a row's sum are the GPU's own, so
16-bit results can differ from the eager ones by a rounding at a few elements (the fused CPU ops' bound).
Imported on the first launch: importing triton costs ~50 MiB of RSS, which a CPU server should not pay.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from quant.runtime.kernels.triton_kernels import (  # the arithmetic the fused epilogues share
    gated_act,
    inv_rms,
    rms_normed,
)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return 1 if block <= 256 else (4 if block <= 2048 else 8)


# ----------------------------------------------------------------------------------------------- RMSNorm

@triton.jit
def _norm_kernel(X, Dlt, XO, W, Hout, n, sx, sd, sxo, sh, eps,
                 HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n
    x = tl.load(X + row * sx + c, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(Dlt + row * sd + c, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(XO + row * sxo + c, x, mask=ok)  # the residual, rounded once as the eager add
    xf = x.to(tl.float32)
    inv = inv_rms(tl.sum(xf * xf, axis=0), n, eps)
    w = tl.load(W + c, mask=ok, other=0.0)
    tl.store(Hout + row * sh + c, rms_normed(x, inv, w).to(Hout.dtype.element_ty), mask=ok)


def _check_rows(x: Tensor, w: Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm takes (rows, n) with contiguous rows, got shape {tuple(x.shape)}")
    if w.shape != (x.shape[1],) or w.dtype != x.dtype:
        raise ValueError(f"rms_norm weight must be ({x.shape[1]},) in {x.dtype}, got {tuple(w.shape)} {w.dtype}")


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x (rows, n) -> rms_norm(x) * w."""
    _check_rows(x, w)
    h = x.new_empty(x.shape)
    rows, n = x.shape
    if rows:
        block = _pow2(n)
        _norm_kernel[(rows,)](x, x, x, w, h, n, x.stride(0), 0, 0, h.stride(0), eps,
                              HAS_DELTA=False, BLOCK=block, num_warps=_warps(block))
    return h


def add_rms_norm(x: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta) * w) in one pass over (rows, n)."""
    _check_rows(x, w)
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(1) != 1:
        raise ValueError(f"delta must match x {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    xo, h = x.new_empty(x.shape), x.new_empty(x.shape)
    rows, n = x.shape
    if rows:
        block = _pow2(n)
        _norm_kernel[(rows,)](x, delta, xo, w, h, n, x.stride(0), delta.stride(0), xo.stride(0), h.stride(0), eps,
                              HAS_DELTA=True, BLOCK=block, num_warps=_warps(block))
    return xo, h


# ----------------------------------------------------------------------------------------------- rotary

def _check_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.dtype != cos.dtype:
            raise ValueError(f"rope_: {name} must be (T, heads, D) with contiguous heads in {cos.dtype}")
    T, _, D = q.shape
    R = cos.shape[1]
    if k.shape[0] != T or k.shape[2] != D or R % 2 or R > D or cos.shape != (T, R) or sin.shape != cos.shape \
            or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"rope_: cos and sin must be (T, R) rows with an even R <= {D}, got {tuple(cos.shape)}")


def rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """In place: q (T, H, D), k (T, Hkv, D) with contiguous heads (rows may be strided: slices of a fused qkv
    output); cos, sin (T, R), R <= D even: the first R dims of each head are rotated."""
    _check_rope(q, k, cos, sin)
    _launch_rope(q, k, None, cos, sin, None, None)


@triton.jit
def _rope_kernel(Q, K, V, COS, SIN, KV, SLOTS, H, nslots, sq, sk, sv, sc, HKV: tl.constexpr, HALF: tl.constexpr,
                 D: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr,
                 STORE: tl.constexpr):
    # One program per (token, head of q then k): the head's first 2 HALF dims rotated in place. With STORE, a k head's
    # program then writes the rotated k and its v head to the token's cache slot.
    t = tl.program_id(0)
    head = tl.program_id(1)
    if head < H:
        X = Q + t * sq + head * D
    else:
        X = K + t * sk + (head - H) * D
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    a = tl.load(X + j, mask=ok, other=0.0)
    b = tl.load(X + HALF + j, mask=ok, other=0.0)
    c_lo = tl.load(COS + t * sc + j, mask=ok, other=0.0).to(tl.float32)
    c_hi = tl.load(COS + t * sc + HALF + j, mask=ok, other=0.0).to(tl.float32)
    s_lo = tl.load(SIN + t * sc + j, mask=ok, other=0.0).to(tl.float32)
    s_hi = tl.load(SIN + t * sc + HALF + j, mask=ok, other=0.0).to(tl.float32)
    dt = a.dtype
    af, bf = a.to(tl.float32), b.to(tl.float32)
    lo = ((af * c_lo).to(dt).to(tl.float32) + (-bf * s_lo).to(dt).to(tl.float32)).to(dt)
    hi = ((bf * c_hi).to(dt).to(tl.float32) + (af * s_hi).to(dt).to(tl.float32)).to(dt)
    tl.store(X + j, lo, mask=ok)
    tl.store(X + HALF + j, hi, mask=ok)
    if STORE and head >= H:
        kvh = head - H
        slot = tl.load(SLOTS + t)
        in_cache = (slot >= 0) & (slot < nslots)  # a slot outside the cache writes nothing
        kc = KV + (slot * HKV + kvh) * D
        tl.store(kc + j, lo, mask=ok & in_cache)
        tl.store(kc + HALF + j, hi, mask=ok & in_cache)
        p = 2 * HALF + tl.arange(0, PASS_BLOCK)  # the dims past the rotary ones (partial rotary), as they are
        p_ok = (p < D) & in_cache
        tl.store(kc + p, tl.load(X + p, mask=p_ok, other=0.0), mask=p_ok)
        d = tl.arange(0, V_BLOCK)
        d_ok = (d < D) & in_cache
        tl.store(KV + ((nslots + slot) * HKV + kvh) * D + d, tl.load(V + t * sv + kvh * D + d, mask=d_ok), mask=d_ok)


def rope_store_kv_(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, slots: Tensor) -> None:
    """:func:`rope_` then :func:`store_kv` in one launch: q and k rotated in place, the rotated k and v written to
    their slots of one layer's cache kv (2, slots, Hkv, D)."""
    _check_rope(q, k, cos, sin)
    _check_store(k, v, kv, slots)
    _launch_rope(q, k, v, cos, sin, kv, slots)


def _launch_rope(q, k, v, cos, sin, kv, slots) -> None:
    T, H, D = q.shape
    R = cos.shape[1]
    store = kv is not None
    if T:
        _rope_kernel[(T, H + k.shape[1])](
            q, k, v if store else k, cos, sin, kv if store else k, slots if store else cos, H,
            kv.shape[1] if store else 0, q.stride(0), k.stride(0), v.stride(0) if store else 0, cos.stride(0),
            HKV=k.shape[1], HALF=R // 2, D=D, BLOCK=_pow2(R // 2), PASS_BLOCK=_pow2(max(1, D - R)),
            V_BLOCK=_pow2(D), STORE=store, num_warps=_warps(_pow2(D) if store else _pow2(R // 2)))


# ----------------------------------------------------------------------------------------------- K/V cache write

@triton.jit
def _store_kv_kernel(Kin, Vin, KV, SLOTS, nslots, sk, sv, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    c = tl.arange(0, BLOCK)
    ok = (c < ROW) & (slot >= 0) & (slot < nslots)  # a slot outside the cache writes nothing
    tl.store(KV + slot * ROW + c, tl.load(Kin + t * sk + c, mask=ok), mask=ok)
    tl.store(KV + (nslots + slot) * ROW + c, tl.load(Vin + t * sv + c, mask=ok), mask=ok)


def _check_store(k: Tensor, v: Tensor, kv: Tensor, slots: Tensor) -> None:
    if kv.dim() != 4 or kv.shape[0] != 2 or not kv.is_contiguous():
        raise ValueError("store_kv: kv must be a contiguous (2, slots, Hkv, D) tensor")
    _, nslots, hkv, d = kv.shape
    T = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (T, hkv, d) or t.stride(2) != 1 or t.stride(1) != d or t.dtype != kv.dtype:
            raise ValueError(f"store_kv: {name} must be (T, {hkv}, {d}) with contiguous heads in {kv.dtype}")
    if slots.shape != (T,) or not slots.is_contiguous():
        raise ValueError("store_kv: slots must be a contiguous (T,) tensor")


def store_kv(k: Tensor, v: Tensor, kv: Tensor, slots: Tensor) -> None:
    """k, v (T, Hkv, D), heads contiguous, into their slots of one layer's cache kv (2, slots, Hkv, D). Slots come
    from the block pool (server/kv_pool.py); one outside the cache is not written (checking it here would cost a
    device-to-host read per layer)."""
    _check_store(k, v, kv, slots)
    _, nslots, hkv, d = kv.shape
    T = k.shape[0]
    if T:
        block = _pow2(hkv * d)
        _store_kv_kernel[(T,)](k, v, kv, slots, nslots, k.stride(0), v.stride(0), ROW=hkv * d, BLOCK=block,
                               num_warps=_warps(block))


# ----------------------------------------------------------------------------------------------- gated activations

@triton.jit
def _act_mul_kernel(GU, O, inter, sg, so, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    g = tl.load(GU + t * sg + c, mask=ok, other=0.0)
    u = tl.load(GU + t * sg + inter + c, mask=ok, other=0.0).to(tl.float32)
    act = gated_act(g.to(tl.float32), GELU).to(g.dtype).to(tl.float32)  # rounded before the product, as eager
    tl.store(O + t * so + c, (act * u).to(O.dtype.element_ty), mask=ok)


def _act_mul(gate_up: Tensor, gelu: bool) -> Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be (T, 2I) with contiguous rows, got shape {tuple(gate_up.shape)}")
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = gate_up.new_empty(T, inter)
    if T:
        block = min(1024, _pow2(inter))
        _act_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                         GELU=gelu, BLOCK=block, num_warps=_warps(block))
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for a (T, 2I) [gate | up] output -> (T, I)."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up for a (T, 2I) [gate | up] output -> (T, I)."""
    return _act_mul(gate_up, gelu=True)
