"""The glue ops' cases, shared by the fused CPU kernels' tests (tests/test_fastops.py) and the Triton kernels'
(tests/test_glue_triton.py): each takes the ops under test and the eager reference ops (server.fastops.Ops)."""

from __future__ import annotations

import torch


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's resolution at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-3) * eps)).max().item()


def assert_close_ulps(a, b):
    """Equal up to rounding: sums run in another order and exp/rsqrt differ in the last bit. In 16-bit dtypes
    that flips a rounding at only a few elements; in fp32 many elements differ, each by a few ulps."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype != torch.float32:
        differ = (a != b).float().mean().item()
        assert differ <= 0.01, f"{differ:.3%} of elements differ"
    # A 16-bit result can flip one rounding before the weight product and one after; fp32 accumulates more.
    assert ulps(a, b) <= (8.0 if a.dtype == torch.float32 else 2.0), ulps(a, b)


def check_norms(ops, ref, dtype, T: int, n: int) -> None:
    g = torch.Generator().manual_seed(T * n)
    x = (torch.randn(T, n, generator=g) * 3).to(dtype)
    d = torch.randn(T, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    x0 = x.clone()
    assert_close_ulps(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    xo, ho = ops.add_rms_norm(x, d, w, 1e-6)
    xr, hr = ref.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(xo, xr)  # the residual add rounds once, exactly as the eager add
    assert_close_ulps(ho, hr)
    assert torch.equal(x, x0)  # the input is left as it was


def check_rope(ops, ref, dtype, T: int, R: int, H: int, Hkv: int, D: int = 64) -> None:
    """q and k rotated in place as strided views of a fused qkv output, bit-identical to the reference (the same
    roundings in the same order); v and the dims past R untouched."""
    g = torch.Generator().manual_seed(T + R)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = torch.rand(T, R // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)  # (T, R), the layout of HF's rotary_emb
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    outs = []
    for o in (ops, ref):
        x = qkv.clone()
        q, k, _ = x.split([H * D, Hkv * D, Hkv * D], dim=-1)  # strided views, as the models pass them
        o.rope_(q.view(T, H, D), k.view(T, Hkv, D), cos, sin)
        outs.append(x)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])  # v untouched
    assert not torch.equal(outs[0], qkv)  # something was rotated
    if R < D:
        heads = outs[0][:, : (H + Hkv) * D].view(T, H + Hkv, D)
        assert torch.equal(heads[..., R:], qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)[..., R:])


def check_store_kv(ops, ref, dtype, T: int, Hkv: int, D: int, nslots: int) -> None:
    """k and v (strided rows) into shuffled slots: what the reference writes, and nothing elsewhere."""
    g = torch.Generator().manual_seed(T)
    kvv = torch.randn(T, 4 * Hkv * D, generator=g).to(dtype)
    k, v = kvv[:, : Hkv * D].view(T, Hkv, D), kvv[:, 2 * Hkv * D: 3 * Hkv * D].view(T, Hkv, D)
    slots = torch.randperm(nslots, generator=g)[:T]
    got = torch.zeros(2, nslots, Hkv, D, dtype=dtype)
    want = torch.zeros_like(got)
    ops.store_kv(k, v, got, slots)
    ref.store_kv(k, v, want, slots)
    assert torch.equal(got, want)
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots] = False
    assert got[:, untouched].abs().sum() == 0


def check_activations(ops, ref, dtype, T: int, inter: int, gelu_tol: dict | None = None) -> None:
    """silu(gate) * up and gelu_tanh(gate) * up. 1 + tanh(u) cancels for very negative inputs, so a last-bit tanh
    difference is a large relative one on values near zero: in fp32 (and with ``gelu_tol``, for a tanh computed
    through exp) GELU compares with absolute and relative tolerances."""
    g = torch.Generator().manual_seed(T)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
    assert_close_ulps(ops.silu_mul(gu), ref.silu_mul(gu))
    got, want = ops.gelu_tanh_mul(gu), ref.gelu_tanh_mul(gu)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif gelu_tol is not None:
        torch.testing.assert_close(got, want, **gelu_tol)
    else:
        assert_close_ulps(got, want)
