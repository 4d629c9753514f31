"""The Triton weight-only GEMMs (quant/triton_ops.py) against their plain PyTorch references, on CPU tensors under
Triton's interpreter (tests/conftest.py sets it where no GPU is): fp16 and fp32 (the interpreter has no bf16
tl.dot), decode-shaped inputs (split K, fp32 atomics) and prefill-shaped ones, partial tiles in M and N."""

from __future__ import annotations

import pytest
import torch

from quant import triton_ops as T
from quant.int4 import pack_rows

pytestmark = pytest.mark.skipif(T.available() is not None, reason="triton is not installed")


def _w4(n, k, gs, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)  # (N, K)
    s = torch.rand(k // gs, n, generator=g) * 0.02 + 0.005  # (G, N)
    zero = torch.randint(0, 16, (k // gs, n), generator=g).float()
    sz = torch.stack([s, s * (8 - zero)], dim=-1)  # (G, N, 2): W = (code - 8) * s + z_f = s * (code - zero)
    return pack_rows(codes.t().contiguous()), sz, codes, s, zero


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,gs", [(1, 96, 256, 32), (5, 80, 512, 128), (40, 200, 192, 64), (70, 144, 128, 128),
                                      (2, 64, 576, 64), (1, 64, 512, 256), (90, 64, 320, 32), (3, 64, 96, 16)])
def test_w4_matmul_matches_reference(dtype, m, n, k, gs):
    qw, sz, codes, s, zero = _w4(n, k, gs, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = T.w4_matmul(x, qw, sz.to(dtype), gs)
    want = T.w4_reference(x, qw, sz.to(dtype), gs)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the reference itself is the GPTQ formula W[n, k] = s * (code - zero)
    w = (s.repeat_interleave(gs, 0) * (codes.t().float() - zero.repeat_interleave(gs, 0))).t()  # (N, K)
    torch.testing.assert_close(T.w4_reference(x.float(), qw, sz, gs), x.float() @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("zero_free", [False, True])
@pytest.mark.parametrize("m,n,k,gs", [(2, 80, 256, 128), (17, 144, 512, 256), (32, 64, 384, 128), (50, 300, 256, 128)])
def test_w4_code_planes_compute_the_product(m, n, k, gs, zero_free, monkeypatch):
    """Up to 64 rows of 16-bit x in groups of >= 128 (the H100's rules, which the interpreter runs), the planes kernel
    multiplies the codes' eight planes, q - 8 made from bits (no conversion), by x and scales the sums per group:
    the launch takes it, and equals the reference, with a symmetric table's zeros skipped or an asymmetric one's
    added through x's sums. Rows of the identity read single weights back: every code 0..15 through the bit trick."""
    qw, sz, codes, s, zero = _w4(n, k, gs, seed=m * 3 + n)
    if zero_free:
        sz[..., 1] = 0  # a symmetric checkpoint's table
    sz = sz.half()
    launched = []
    real = T._launch
    monkeypatch.setattr(T, "_launch", lambda *a, **kw: launched.append((a[0], kw)) or real(*a, **kw))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    got = T.w4_matmul(x, qw, sz, gs, zero_free=zero_free)
    eye = torch.eye(k)[torch.randperm(k, generator=torch.Generator().manual_seed(5))[:m]].half()  # (m, K)
    read = T.w4_matmul(eye, qw, sz, gs, zero_free=zero_free)
    planes = m <= 32 or zero_free  # 33-64 rows: symmetric tables only (triton_ops.w4_planes_tile)
    assert [name for name, _ in launched] == ["w4_planes_kernel" if planes else "w4_kernel"] * 2
    assert not planes or launched[0][1]["HAS_ZERO"] is (not zero_free)
    torch.testing.assert_close(got.float(), T.w4_reference(x, qw, sz, gs).float(), atol=2e-2, rtol=2e-2)
    # a single weight back, to the fp16 rounding of (q - 8) s + z
    torch.testing.assert_close(read.float(), T.w4_reference(eye, qw, sz, gs).float(), atol=0, rtol=2 ** -10)


def test_w4_code_planes_are_taken_only_where_they_hold(monkeypatch):
    """fp32 x, groups under 128, more than 64 rows, and 33-64 rows before sm_90 dequantize each weight whole."""
    qw, sz, *_ = _w4(64, 256, 64, seed=3)
    qw2, sz2, *_ = _w4(64, 256, 128, seed=4)
    launched = []
    real = T._launch
    monkeypatch.setattr(T, "_launch", lambda *a, **kw: launched.append(a[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(6)
    for x, q, t, gs in ((torch.randn(4, 256, generator=g).half(), qw, sz.half(), 64),
                        (torch.randn(4, 256, generator=g), qw2, sz2, 128),
                        (torch.randn(65, 256, generator=g).half(), qw2, sz2.half(), 128),
                        (torch.randn(4, 256, generator=g).half(), qw2, sz2.half(), 128)):
        torch.testing.assert_close(T.w4_matmul(x, q, t, gs).float(), T.w4_reference(x, q, t, gs).float(),
                                   atol=2e-2, rtol=2e-2)
    sym = sz2.half()
    sym[..., 1] = 0
    x = torch.randn(40, 256, generator=g).half()
    for cap in ((9, 0), (8, 0)):  # 40 rows of a symmetric table: planes on an H100, whole weights on an A100
        monkeypatch.setattr(T, "capability", lambda device, cap=cap: cap)
        torch.testing.assert_close(T.w4_matmul(x, qw2, sym, 128, zero_free=True).float(),
                                   T.w4_reference(x, qw2, sym, 128).float(), atol=2e-2, rtol=2e-2)
    assert launched == ["w4_kernel", "w4_kernel", "w4_kernel", "w4_planes_kernel", "w4_planes_kernel", "w4_kernel"]


def test_w4_planes_tiles_follow_the_compute_capability():
    assert T.w4_planes_tile(16, (9, 0), False) == T.w4_planes_tile(16, (8, 0), False) == (16, 128, 4)
    assert T.w4_planes_tile(64, (9, 0), True) == (64, 128, 8)
    assert T.w4_planes_tile(64, (9, 0), False) is None and T.w4_planes_tile(64, (8, 6), True) is None
    assert T.w4_planes_tile(65, (9, 0), True) is None
