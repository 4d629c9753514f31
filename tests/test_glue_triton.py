"""The Triton glue kernels (server/glue_triton.py, the CUDA glue) against their eager references (server/fastops.py),
on CPU tensors under Triton's interpreter (tests/conftest.py sets it where no GPU is): fp16 and fp32 (the
interpreter rounds bf16 by truncation, so bf16 is held to the references on a GPU, tests/test_cuda.py); strided
rows as the models pass them, partial rotary, and the one-line refusals of shapes they do not take."""

from __future__ import annotations

import pytest
import torch

from server import fastops
from server.attention.triton_paged import available

pytestmark = pytest.mark.skipif(available() is not None, reason="triton is not installed")

DTYPES = [torch.float16, torch.float32]
REF = fastops.Ops("eager")


@pytest.fixture(scope="module")
def tri():
    return fastops.Ops("triton")


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's resolution at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-3) * eps)).max().item()


def assert_close_ulps(a, b):
    """Equal up to rounding: the row's sum runs in another order and exp/rsqrt may differ in the last bit, which
    in fp16 flips a rounding at a few elements (once before the weight's product, once after)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype != torch.float32:
        differ = (a != b).float().mean().item()
        assert differ <= 0.01, f"{differ:.3%} of elements differ"
    assert ulps(a, b) <= (8.0 if a.dtype == torch.float32 else 2.0), ulps(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,n", [(1, 576), (5, 4096), (3, 200)])  # 200: a row narrower than its power-of-two block
def test_norms_match_reference(tri, dtype, T, n):
    g = torch.Generator().manual_seed(T * n)
    x = (torch.randn(T, n, generator=g) * 3).to(dtype)
    d = torch.randn(T, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    assert_close_ulps(tri.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    xt, ht = tri.add_rms_norm(x, d, w, 1e-6)
    xr, hr = REF.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(xt, xr)  # the residual add rounds once, exactly as the eager add
    assert_close_ulps(ht, hr)
    assert torch.equal(x, (torch.randn(T, n, generator=torch.Generator().manual_seed(T * n)) * 3).to(dtype))


def test_norm_reads_strided_rows(tri):
    """The final norm gets x[idx] rows; a row-strided view (sliced columns are not taken) reads its own rows."""
    big = torch.randn(4, 2 * 256, generator=torch.Generator().manual_seed(0))
    x = big[:, :256]  # (4, 256) rows strided by 512
    w = torch.rand(256) + 0.5
    assert_close_ulps(tri.rms_norm(x, w, 1e-6), REF.rms_norm(x.contiguous(), w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("R", [64, 48])  # full and partial rotary (Phi-3 with partial_rotary_factor)
def test_rope_in_place_matches_reference_on_strided_views(tri, dtype, T, R):
    H, Hkv, D = 6, 2, 64
    g = torch.Generator().manual_seed(T + R)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = torch.rand(T, R // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)  # (T, R), the layout of the rotary tables
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    outs = []
    for ops in (tri, REF):
        x = qkv.clone()
        q, k, _ = x.split([H * D, Hkv * D, Hkv * D], dim=-1)  # strided views, as the models pass them
        ops.rope_(q.view(T, H, D), k.view(T, Hkv, D), cos, sin)
        outs.append(x)
    assert torch.equal(outs[0], outs[1])  # the same roundings in the same order: bit-identical
    assert torch.equal(outs[0][:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])  # v untouched
    assert not torch.equal(outs[0], qkv)  # something was rotated
    if R < D:  # the dims past R are left as they were
        heads = outs[0][:, : (H + Hkv) * D].view(T, H + Hkv, D)
        assert torch.equal(heads[..., R:], qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)[..., R:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 9])
def test_store_kv_matches_reference_and_writes_nothing_else(tri, dtype, T):
    Hkv, D, nslots = 2, 64, 96
    g = torch.Generator().manual_seed(T)
    kvv = torch.randn(T, 4 * Hkv * D, generator=g).to(dtype)
    k, v = kvv[:, : Hkv * D].view(T, Hkv, D), kvv[:, 2 * Hkv * D: 3 * Hkv * D].view(T, Hkv, D)  # strided rows
    slots = torch.randperm(nslots, generator=g)[:T]
    kv_t = torch.zeros(2, nslots, Hkv, D, dtype=dtype)
    kv_r = torch.zeros_like(kv_t)
    tri.store_kv(k, v, kv_t, slots)
    REF.store_kv(k, v, kv_r, slots)
    assert torch.equal(kv_t, kv_r)
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots] = False
    assert kv_t[:, untouched].abs().sum() == 0


def test_store_kv_outside_the_cache_writes_nothing(tri):
    k = torch.randn(2, 2, 16)
    kv = torch.zeros(2, 8, 2, 16)
    tri.store_kv(k, k, kv, torch.tensor([8, -1]))
    assert kv.abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 1536), (4, 3000)])  # 3000: a partial last block
def test_gated_activations_match_reference(tri, dtype, T, inter):
    g = torch.Generator().manual_seed(T)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
    assert_close_ulps(tri.silu_mul(gu), REF.silu_mul(gu))
    # 1 + tanh(u) cancels for very negative inputs, so a last-bit tanh difference is a large relative one on
    # values near zero: those compare absolutely.
    got, want = tri.gelu_tanh_mul(gu), REF.gelu_tanh_mul(gu)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


def test_shapes_the_kernels_do_not_take_are_refused_in_one_line(tri):
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight must be"):
        tri.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="delta must match"):
        tri.add_rms_norm(x, torch.randn(3, 32), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        tri.rms_norm(x.t(), torch.ones(3), 1e-6)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="even R"):
        tri.rope_(q, q[:, :2], torch.ones(2, 20), torch.ones(2, 20))
    with pytest.raises(ValueError, match="gate_up"):
        tri.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="store_kv: k"):
        tri.store_kv(q, q, torch.zeros(2, 8, 2, 16), torch.tensor([0, 1]))
