"""The Triton glue kernels (server/glue_triton.py, the CUDA glue) against their eager references (server/fastops.py),
on CPU tensors under Triton's interpreter (tests/conftest.py sets it where no GPU is): fp16 and fp32 (the
interpreter rounds bf16 by truncation, so bf16 is held to the references on a GPU, tests/test_cuda.py); strided
rows as the models pass them, partial rotary, and the one-line refusals of shapes they do not take."""

from __future__ import annotations

import pytest
import torch
from glue_cases import (
    assert_close_ulps,
    check_activations,
    check_norms,
    check_rope,
    check_store_kv,
)

from server import fastops
from server.attention.triton_paged import available

pytestmark = [pytest.mark.reference, pytest.mark.skipif(available() is not None, reason="triton is not installed")]

DTYPES = [torch.float16, torch.float32]
REF = fastops.Ops("eager")


@pytest.fixture(scope="module")
def tri():
    return fastops.Ops("triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,n", [(1, 576), (5, 4096), (3, 200)])  # 200: a row narrower than its power-of-two block
def test_norms_match_reference(tri, dtype, T, n):
    check_norms(tri, REF, dtype, T, n)


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
    check_rope(tri, REF, dtype, T, R, H=6, Hkv=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 9])
def test_store_kv_matches_reference_and_writes_nothing_else(tri, dtype, T):
    check_store_kv(tri, REF, dtype, T, Hkv=2, D=64, nslots=96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R", [64, 48])  # partial rotary: the k dims past R reach the cache as they are
def test_rope_and_store_in_one_launch_equal_the_two_references(tri, dtype, R):
    """The triton backend's fused op: q and k rotated in place and k (rotated) and v in the cache, bit for bit what
    rope_ then store_kv give; a slot outside the cache writes nothing."""
    T, H, Hkv, D, nslots = 5, 6, 2, 64, 40
    g = torch.Generator().manual_seed(R)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = torch.rand(T, R // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    slots = torch.tensor([3, 17, 39, 40, 0])  # 40: outside the cache
    outs = []
    for fused in (True, False):
        x = qkv.clone()
        q, k, v = (t.view(T, -1, D) for t in x.split([H * D, Hkv * D, Hkv * D], dim=-1))
        kv = torch.zeros(2, nslots, Hkv, D, dtype=dtype)
        if fused:
            tri.rope_store_kv_(q, k, v, cos, sin, kv, slots)
        else:
            REF.rope_(q, k, cos, sin)
            REF.store_kv(k[slots < nslots], v[slots < nslots], kv, slots[slots < nslots])
        outs.append((x, kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1].abs().sum() > 0


def test_store_kv_outside_the_cache_writes_nothing(tri):
    k = torch.randn(2, 2, 16)
    kv = torch.zeros(2, 8, 2, 16)
    tri.store_kv(k, k, kv, torch.tensor([8, -1]))
    assert kv.abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 1536), (4, 3000)])  # 3000: a partial last block
def test_gated_activations_match_reference(tri, dtype, T, inter):
    # tanh through exp (the interpreter has no libdevice tanh): fp16 GELU within a rounding, absolutely near zero
    check_activations(tri, REF, dtype, T, inter, gelu_tol=dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-3))


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
