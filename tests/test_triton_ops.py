"""The Triton weight-only GEMMs (quant/runtime/kernels/triton_ops.py) against their plain PyTorch references, on CPU tensors under
Triton's interpreter (tests/conftest.py sets it where no GPU is): fp16 and fp32 (the interpreter has no bf16
tl.dot), decode-shaped inputs (split K, fp32 atomics) and prefill-shaped ones, partial tiles in M and N."""

from __future__ import annotations

import time

import pytest
import torch

from quant.runtime.kernels import triton_ops as T
from quant.runtime.kernels.int4_layout import pack_rows

pytestmark = [pytest.mark.reference, pytest.mark.skipif(T.available() is not None, reason="triton is not installed")]


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


def test_w4_splits_k_for_decode_shapes_and_not_for_prefill():
    assert T._config(1, 4096, 4096, 64)[2] > 1
    assert T._config(512, 4096, 4096, 64)[2] == 1


def test_split_k_products_are_one_launch_deterministic_and_rearm_their_counters():
    """A split product's last program per tile sums the fp32 partials in split order and resets the tile's counter:
    the same inputs give the same bits, and the shared counters are zero after every product."""
    qw, sz, *_ = _w4(192, 1024, 64, seed=7)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(2))
    w = torch.randint(-128, 128, (80, 768), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    xs = torch.randn(3, 768, generator=torch.Generator().manual_seed(4))
    scale = torch.rand(80, generator=torch.Generator().manual_seed(5)) * 0.01
    assert T._config(3, 80, 768, 64)[2] > 1  # both products below do split K
    first = (T.w4_matmul(x, qw, sz, 64), T.int8_matmul(xs, w, scale, None))  # 1 row: GEMV; 3 rows: GEMM
    locks = T._LOCKS[torch.device("cpu")][-1]
    assert locks.numel() >= 4096 and not locks.any()
    again = (T.w4_matmul(x, qw, sz, 64), T.int8_matmul(xs, w, scale, None))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]) and not locks.any()
    torch.testing.assert_close(first[0], T.w4_reference(x, qw, sz, 64), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], T.int8_reference(xs, w, scale, None), atol=1e-4, rtol=1e-4)


def test_w4_refuses_groups_without_a_k_tile():
    qw, sz, *_ = _w4(16, 48, 24, seed=0)
    assert T.w4_block_k(24) is None and T.w4_block_k(4) is None and T.w4_block_k(256, rows=100) == 64
    with pytest.raises(ValueError, match="group size 24 has no K tile"):
        T.w4_matmul(torch.randn(1, 48), qw, sz, 24)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (3, 100, 200), (65, 130, 96)])
def test_int8_matmul_matches_reference(affine, dtype, m, n, k):
    g = torch.Generator().manual_seed(m * n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    zero = torch.randint(-20, 20, (n,), generator=g, dtype=torch.int8) if affine else None
    x = torch.randn(m, k, generator=g).to(dtype)
    got = T.int8_matmul(x, w, scale, zero)
    want = T.int8_reference(x, w, scale, zero)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("config", [None, (32, 64, 1, 4), (16, 32, 8, 2), (128, 128, 2, 8)])
def test_int8_gemv_matches_reference(affine, config):
    """One row takes the int8 GEMV kernel (split K where the rows of W alone are few programs); the configurations
    bench/gpu.py sweeps compute the same product, K not a multiple of the tile included."""
    n, k = 200, 1000
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    zero = torch.randint(-20, 20, (n,), generator=g, dtype=torch.int8) if affine else None
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(1, k, generator=g).to(dtype)
        got = T.int8_gemv(x, w, scale, zero, config) if config else T.int8_matmul(x, w, scale, zero)
        want = T.int8_reference(x, w, scale, zero)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert got.dtype == dtype and got.shape == (1, n)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_linear_in_the_triton_layout_computes_its_weights(act_order):
    """The layout CUDA takes (GPTQ words + one scale/zero table), prepared on CPU tensors: its kernel path, its
    dequantized weights and a fused q/k/v over it all agree with the module's reference."""
    from quant.runtime.int4 import GPTQLinear

    k, gs = 256, 64
    mods = []
    order = torch.randperm(k, generator=torch.Generator().manual_seed(10)) if act_order else torch.arange(k)
    for i, n in enumerate((128, 64, 64)):
        qw, sz, codes, s, zero = _w4(n, k, gs, seed=20 + i)
        m = GPTQLinear(k, n, False, gs, v2=True)
        m.qweight = qw
        m.qzeros = pack_rows(zero.to(torch.int64).t().contiguous()).t().contiguous()
        m.scales = s.half()
        m.g_idx = (order // gs).to(torch.int32)  # act-order: a permuted g_idx, shared by the fused parts
        mods.append(m)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).half()
    want = [m.reference_forward(x) for m in mods]
    weights = [m.dequantized(torch.float32) for m in mods]  # from the GPTQ tensors
    for m in mods:
        m._prepare_as("w4triton", torch.float16)
        assert m.layout == "w4triton" and m.qzeros is None and m.scales is None and (m.perm is not None) == act_order
    for m, w, wt in zip(mods, want, weights):
        torch.testing.assert_close(m.paths(torch.float16)["kernel"](x).float(), w, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(m.dequantized(torch.float32), wt, atol=1e-3, rtol=1e-3)  # fp16 table
    fused = GPTQLinear.fuse(mods)
    assert fused is not None and fused.layout == "w4triton" and all(m.qweight is None for m in mods)
    assert not fused.zero_free  # random zero-points: the one-row kernel reads them
    y = fused.paths(torch.float16)["kernel"](x)
    torch.testing.assert_close(y.float(), torch.cat(want, dim=1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mods[1].dequantized(torch.float32), weights[1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("v2", [False, True])
def test_a_symmetric_gptq_linear_in_the_triton_layout_is_zero_free(v2):
    """Zero-points all 8 (symmetric GPTQ, in either format): the table's zeros are 0 and the module says so, fused
    too, and its one-row kernel path (which then skips them) equals the reference; one asymmetric part makes the
    fused module read them."""
    from quant.runtime.int4 import GPTQLinear

    k, gs = 256, 64
    mods = []
    for i, n in enumerate((64, 32, 32)):
        qw, sz, codes, s, zero = _w4(n, k, gs, seed=30 + i)
        zero = torch.full_like(zero, 8) if i < 2 else zero
        m = GPTQLinear(k, n, False, gs, v2=v2)
        m.qweight, m.scales, m.g_idx = qw, s.half(), (torch.arange(k) // gs).to(torch.int32)
        stored = zero.to(torch.int64) if v2 else (zero.to(torch.int64) - 1) & 0xF  # v1 stores zero - 1
        m.qzeros = pack_rows(stored.t().contiguous()).t().contiguous()
        mods.append(m)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(15)).half()
    want = [m.reference_forward(x) for m in mods]
    for m in mods:
        m._prepare_as("w4triton", torch.float16)
    assert [m.zero_free for m in mods] == [True, True, False]
    assert not mods[0].scales_zeros[..., 1].any()
    torch.testing.assert_close(mods[0].paths(torch.float16)["kernel"](x).float(), want[0], atol=2e-2, rtol=2e-2)
    assert GPTQLinear.fuse(mods[:2]).zero_free
    assert not GPTQLinear.fuse([mods[2]]).zero_free


def test_w4_dequant_matches_the_codes():
    qw, sz, codes, s, zero = _w4(96, 192, 64, seed=3)
    wt = T.w4_dequant(qw, sz.half(), 64, torch.float16)  # (K, N)
    want = (s.repeat_interleave(64, 0) * (codes.t().float() - zero.repeat_interleave(64, 0)))  # (K, N)
    assert wt.shape == (192, 96) and wt.dtype == torch.float16
    torch.testing.assert_close(wt.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n,k,gs", [(96, 256, 32), (200, 576, 64), (64, 1024, 512), (130, 4096, 128)])
def test_w4_gemv_matches_reference(n, k, gs):
    """One row takes the GEMV kernel (split K where the columns alone are few programs)."""
    qw, sz, *_ = _w4(n, k, gs, seed=n)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(dtype)
        got = T.w4_matmul(x, qw, sz.to(dtype), gs)
        want = T.w4_reference(x, qw, sz.to(dtype), gs)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == torch.float16 else 1e-4,
                                   rtol=2e-2 if dtype == torch.float16 else 1e-4)


@pytest.mark.parametrize("config", [(32, 8, 1, 1), (64, 32, 4, 2), (256, 64, 2, 8), (16, 64, 16, 4)])
def test_w4_gemv_configs_the_gpu_sweep_tries_match_reference(config):
    """bench/gpu.py times the one-row kernel over tile shapes, splits and warps: each computes the same product
    (16 splits of 4 K tiles leave some programs without a tile: they store zeros and still count; 72 columns end
    every BLOCK_N's last tile part way)."""
    n, k, gs = 72, 256, 64
    qw, sz, *_ = _w4(n, k, gs, seed=9)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    got = T.w4_gemv(x, qw, sz, gs, config)
    torch.testing.assert_close(got, T.w4_reference(x, qw, sz, gs), atol=1e-4, rtol=1e-4)


def test_w4_gemv_turns_every_code_at_every_place_in_a_word_into_its_value_exactly():
    """The one-row kernel makes q - 8 from each code's bits with no rounding, whatever nibble of its word the code
    is in: with every code at every place, integer x, unit scales and zero zero-points, the product is the exact
    integer sum."""
    k, n, gs = 256, 64, 128
    g = torch.Generator().manual_seed(5)
    codes = (torch.arange(k)[:, None] + torch.arange(n)[None, :] * 3) % 16  # (K, N): each place sees all 16 codes
    codes = codes[torch.randperm(k, generator=g)]
    qw = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qw |= codes[j::8].long() << (4 * j)
    qw = qw.to(torch.int32)  # (K/8, N), words with bit 31 set wrap to negative int32s as GPTQ stores them
    sz = torch.zeros(k // gs, n, 2)
    sz[..., 0] = 1.0
    x = torch.randint(-8, 9, (1, k), generator=g).float()
    want = x @ (codes - 8).float()  # (1, N), integers far below 2^24
    for cfg in ((64, 32, 1, 4), (32, 128, 2, 2)):
        assert torch.equal(T.w4_gemv(x, qw, sz, gs, cfg), want), cfg


@pytest.mark.parametrize("config", [None, (64, 32, 4, 2), (512, 32, 2, 4)])
def test_w4_gemv_of_a_symmetric_table_skips_its_zeros_and_computes_the_same(config):
    """A symmetric checkpoint's zeros are all 0 (z = s (8 - 8)): the kernel told so skips them and their sums of x
    and gives the reference's product."""
    n, k, gs = 200, 512, 64
    qw, sz, *_ = _w4(n, k, gs, seed=13)
    sz[..., 1] = 0
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(14))
    want = T.w4_reference(x, qw, sz, gs)
    torch.testing.assert_close(T.w4_gemv(x, qw, sz, gs, config, zero_free=True), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(T.w4_matmul(x, qw, sz, gs, config, zero_free=True), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act,config,dtype", [("silu_mul", (64, 32, 1, 4), torch.float16),
                                              ("gelu_tanh_mul", (128, 32, 8, 4), torch.float16),
                                              ("silu_mul", (64, 32, 2, 4), torch.float32)])
def test_one_row_products_of_gate_up_end_in_the_gated_activation_exactly(act, config, dtype):
    """At one row a [gate | up] projection's GEMV can end in act(gate) * up (the glue's act_mul) in the same launch:
    each program takes BLOCK_N/2 gate columns and the same of up. The result is bit for bit the plain product's
    output put through the Triton act_mul, for both weight-only kernels, split or not (8 splits of 4 K tiles: some
    programs get none), with and without zero-points."""
    from server import glue_triton as G

    inter, k, gs = 192, 128, 32
    qw, sz, *_ = _w4(2 * inter, k, gs, seed=21)
    sz = sz.to(dtype)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(22)).to(dtype)
    g = torch.Generator().manual_seed(23)
    w8 = torch.randint(-127, 128, (2 * inter, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(2 * inter, generator=g) * 0.01 + 0.001
    z8 = torch.randint(-20, 20, (2 * inter,), dtype=torch.int8, generator=g)
    cases = [(lambda **kw: T.w4_gemv(x, qw, sz, gs, config, **kw)),
             (lambda **kw: T.w4_gemv(x, qw, sz.clone().index_fill_(2, torch.tensor([1]), 0), gs, config,
                                     zero_free=True, **kw)),
             (lambda **kw: T.int8_gemv(x, w8, s8, None, config, **kw)),
             (lambda **kw: T.int8_gemv(x, w8, s8, z8, config, **kw))]
    for i, product in enumerate(cases):
        want = getattr(G, act)(product())  # (1, inter)
        got = product(gated=act)
        assert got.shape == (1, inter) and got.dtype == dtype
        assert torch.equal(got, want), (i, (got.float() - want.float()).abs().max())
        assert not T.split_counters(x.device, 1).any()


@pytest.mark.parametrize("family,n,config,dtype", [
    ("llama", 192, (64, 32, 1, 4), torch.float16),  # add, input norm
    ("llama", 200, (32, 32, 8, 2), torch.float16),
    ("llama", 1100, (128, 32, 4, 4), torch.float32),  # a row over one chunk
    ("gemma2", 192, (64, 32, 2, 4), torch.float16),  # output norm, add, input norm
    ("olmo2", 200, (32, 32, 1, 2), torch.float16),  # output norm and add: the sum is the next input
    ("granite", 192, (64, 32, 2, 4), torch.float16),  # times the residual multiplier, add, input norm
    ("all", 192, (64, 32, 2, 4), torch.float16),  # every step
    ("all", 1100, (128, 32, 4, 4), torch.float32)])
def test_one_row_products_end_in_the_norms_and_residual_add_exactly(family, n, config, dtype):
    """At one row a product that a residual add and norms follow (o, down) can end in them: the program that writes
    the last tile runs them over the whole row, each family's steps in the model's order (server/models/base.py):
    the sub-layer's output RMSNorm (Gemma 2/3, OLMo 2), the residual multiplier (Granite), the add, the next input
    norm or none (OLMo 2). Both results are bit for bit the glue's ops one after another (rows over 1024 summed in
    chunks: within a rounding), for both kernels, split or not, and the counters are left at zero."""
    from server import glue_triton as G

    k, gs = 128, 32
    qw, sz, *_ = _w4(n, k, gs, seed=51)
    sz = sz.to(dtype)
    g = torch.Generator().manual_seed(52)
    x = torch.randn(1, k, generator=g).to(dtype)
    res = (torch.randn(1, n, generator=g) * 3).to(dtype)
    w, pw = ((torch.rand(n, generator=g) + 0.5).to(dtype) for _ in range(2))
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g) * 0.01 + 0.001
    weight = None if family == "olmo2" else w
    post = None if family in ("llama", "granite") else (pw, 0.5)  # an eps that shows (the two norms' not mixed up)
    scale = 0.7 if family in ("granite", "all") else 1.0
    for product in (lambda **kw: T.w4_gemv(x, qw, sz, gs, config, **kw),
                    lambda **kw: T.int8_gemv(x, w8, s8, None, config, **kw)):
        y = product()
        if post is not None:
            y = G.rms_norm(y, *post)
        if scale != 1.0:
            y = y * scale  # as the model's forward: the eager product by a Python float
        want = (res + y, res + y) if weight is None else G.add_rms_norm(res, y, weight, 1e-5)
        got = product(norm=T.AddNorm(res, weight, 1e-5, post, scale))
        if weight is None:
            assert got[1] is got[0]
        for g_, w_ in zip(got, want):
            if n <= 1024:
                assert torch.equal(g_, w_)
            else:  # rows over 1024 summed in chunks: within a rounding
                torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)
        assert not T.split_counters(x.device, 1).any()
    with pytest.raises(ValueError, match="a norm epilogue takes"):
        T.w4_gemv(x, qw, sz, gs, config, norm=T.AddNorm(res[:, :-1], weight, 1e-5, post, scale))
    with pytest.raises(ValueError, match="norm weights in"):
        T.w4_gemv(x, qw, sz, gs, config, norm=T.AddNorm(res, weight, 1e-5, (pw[:-1], 1e-6), scale))


def test_a_gated_one_row_product_needs_tiles_of_the_gate():
    qw, sz, *_ = _w4(2 * 96, 256, 64, seed=1)
    x = torch.randn(1, 256)
    assert T.gated_fits(192, 64) and not T.gated_fits(192, 128) and not T.gated_fits(191, 2)
    with pytest.raises(ValueError, match="BLOCK_N/2 dividing half of 192 columns"):
        T.w4_gemv(x, qw, sz, 64, (128, 32, 1, 4), gated="silu_mul")
    with pytest.raises(ValueError, match="an activation of"):
        T.int8_gemv(x, torch.zeros(192, 256, dtype=torch.int8), torch.ones(192), None, (64, 32, 1, 4), gated="relu")


def test_w4_gemv_refuses_a_tile_across_groups():
    qw, sz, *_ = _w4(64, 256, 32, seed=1)
    with pytest.raises(ValueError, match="BLOCK_K a power of two dividing the group size 32"):
        T.w4_gemv(torch.randn(1, 256), qw, sz, 32, (64, 64, 1, 4))


def test_the_server_does_not_import_triton_until_a_kernel_runs():
    """Importing triton costs ~50 MiB of RSS: a CPU server, which never launches a Triton kernel, must not."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, server.engine, server.serve, quant.cli, quant.runtime.loader; "
            "assert 'triton' not in sys.modules, 'triton imported'; print('clean')")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr[-2000:]


def _neighbours(start, axes):
    """The configurations one axis away from ``start``: every value the search tries in its first pass."""
    return {start[:i] + (v,) + start[i + 1:] for i, vals in enumerate(axes) for v in vals}


@pytest.mark.parametrize("gs", [32, 128])
def test_every_one_row_launch_the_search_starts_with_computes_the_product(gs):
    """The launches a device's search tries first (quant.runtime.kernel_choice.search, from the rule's config): each W4A16
    and int8 one computes the reference product (the search also holds each to it on the device itself)."""
    n, k = 96, 256
    qw, sz, *_ = _w4(n, k, gs, seed=4)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    start, axes = T.w4_gemv_space(n, k, gs)
    assert start in _neighbours(start, axes) and all(gs % bk == 0 for bk in axes[1])
    few_columns, axes_far = T.w4_gemv_space(32, 1 << 16, gs)  # one column tile: the rule splits K past the axis's
    assert few_columns[2] > 32 and all(v in a for v, a in zip(few_columns, axes_far))  # values, which then hold it
    want = T.w4_reference(x, qw, sz, gs)
    for cfg in sorted(_neighbours(start, axes)):
        if T.w4_gemv_words_per_thread(cfg) > T.GEMV_MAX_WORDS_PER_THREAD:  # refused: the search skips it
            with pytest.raises(ValueError, match="words per thread, which spill"):
                T.w4_gemv(x, qw, sz, gs, cfg)
            continue
        torch.testing.assert_close(T.w4_gemv(x, qw, sz, gs, cfg), want, atol=1e-4, rtol=1e-4, msg=str(cfg))
    w = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(6), dtype=torch.int8)
    scale, zero = torch.rand(n) * 0.01 + 0.001, torch.randint(-20, 20, (n,), dtype=torch.int8)
    start, axes = T.int8_gemv_space(n, k)
    want = T.int8_reference(x, w, scale, zero)
    for cfg in sorted(_neighbours(start, axes)):
        torch.testing.assert_close(T.int8_gemv(x, w, scale, zero, cfg), want, atol=1e-4, rtol=1e-4, msg=str(cfg))


def test_a_w4triton_module_is_launched_as_its_device_measured_best(tmp_path, monkeypatch):
    """Bound through the server's projections with a measuring chooser, a W4A16 module in the layout CUDA takes
    searches its one-row launch (here on the interpreter's CPU tensors), keeps it, reports it, and its one-row
    kernel calls then take that launch and still equal the reference."""
    from quant.runtime import kernel_choice
    from quant.runtime.kernel_choice import Chooser
    from server.layers.linear import bind

    def one_call_us(paths, x, budget_s=0.05):  # the interpreter is slow: a call each stands for the median
        out = {}
        for name, fn in paths.items():
            t = time.perf_counter()
            fn(x)
            out[name] = (time.perf_counter() - t) * 1e6
        return out

    monkeypatch.setattr(kernel_choice, "time_paths_us", one_call_us)
    n, k, gs = 64, 256, 64
    m = _w4triton(n, k, gs, 7)
    space = m.launch_space(torch.float16)
    assert space is not None and space.start == T.w4_gemv_config(n, k, gs)
    chooser = Chooser("measure", tmp_path)
    call = bind(m, torch.float16, chooser, max_rows=4)
    assert m.gemv_config is not None and space.holds(m.gemv_config)
    assert any("one row launched with BLOCK_N=" in line for line in chooser.table())
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8)).half()
    torch.testing.assert_close(call(x).float(), m.reference_forward(x), atol=2e-2, rtol=2e-2)
    calls = []  # the plan may take another path at one row (the interpreter is slow): the kernel's, called alone
    real = T.w4_gemv
    monkeypatch.setattr(T, "w4_gemv", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    y = m.paths(torch.float16)["kernel"](x)
    assert calls == [m.gemv_config]
    torch.testing.assert_close(y.float(), m.reference_forward(x), atol=2e-2, rtol=2e-2)


def test_an_int8_head_takes_the_triton_kernels_and_its_measured_launch(tmp_path, monkeypatch):
    """A GPU's int8 head (server.layers.embedding.Int8Rows with the Triton kernels, here on the interpreter's CPU
    tensors): the GEMV at one row, the tiled GEMM at more, each equal to x @ (q * scale)^T; its one-row launch
    searched by a measuring chooser (a small space: the interpreter is slow), kept, reported, and then taken."""
    from quant.runtime import kernel_choice
    from quant.runtime.kernel_choice import Chooser
    from server.layers.embedding import Int8Rows

    monkeypatch.setattr(kernel_choice, "time_paths_us", lambda paths, x, budget_s=0.05: {
        name: float(i) for i, name in enumerate(paths)})  # one launch at a time: its order stands for its time
    g = torch.Generator().manual_seed(3)
    v, h = 200, 96
    rows = Int8Rows(torch.randn(v, h, generator=g), torch.float16, triton=True)
    assert rows.triton and rows.rows is None
    ref = rows.dequantized()  # (V, H) fp32
    for s in (1, 3, 70):
        x = torch.randn(s, h, generator=g).half()
        got = rows.head(x)
        assert got.shape == (s, v) and got.dtype == torch.float16
        torch.testing.assert_close(got.float(), x.float() @ ref.t(), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(T, "int8_gemv_space", lambda n, k, sms: ((32, 64, 1, 4), ((16, 32), (64,), (1, 2), (4,))))
    chooser = Chooser("measure", tmp_path)
    rows.tune(chooser)
    assert rows.gemv_config in {(16, 64, 1, 4), (32, 64, 1, 4), (16, 64, 2, 4), (32, 64, 2, 4)}
    assert chooser.table() == [f"int8_rows[head] {v}x{h} float16: one row launched with BLOCK_N={rows.gemv_config[0]}, "
                               f"BLOCK_K=64, SPLIT_K={rows.gemv_config[2]}, num_warps=4"]
    launched = []
    real = T.int8_gemv
    monkeypatch.setattr(T, "int8_gemv", lambda *a, **kw: launched.append(a[4]) or real(*a, **kw))
    x = torch.randn(1, h, generator=g).half()
    torch.testing.assert_close(rows.head(x).float(), x.float() @ ref.t(), atol=2e-2, rtol=2e-2)
    assert launched == [rows.gemv_config]


def test_split_counters_reset_after_a_refused_launch():
    """quant.runtime.kernel_choice.search resets the split-K counters after a launch it refuses: a counter left mid-count
    would make the next split product reduce too early."""
    qw, sz, *_ = _w4(64, 1024, 64, seed=11)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(12))
    want = T.w4_reference(x, qw, sz, 64)
    cfg = (64, 64, 4, 4)
    torch.testing.assert_close(T.w4_gemv(x, qw, sz, 64, cfg), want, atol=1e-4, rtol=1e-4)
    held = T._LOCKS[x.device][-1]
    held[0] = 2  # as a launch that stopped after two of four programs counted
    T.reset_split_counters(x.device)
    assert int(held.abs().sum()) == 0
    torch.testing.assert_close(T.w4_gemv(x, qw, sz, 64, cfg), want, atol=1e-4, rtol=1e-4)


def _w4triton(n, k, gs, seed, dtype=torch.float16, prepare=True):
    """A GPTQLinear in the layout CUDA takes (the Triton kernels), here on the interpreter's CPU tensors (not
    ``prepare``: as stored, dequantized per call)."""
    from quant.runtime.int4 import GPTQLinear

    qw, sz, codes, s, zero = _w4(n, k, gs, seed=seed)
    m = GPTQLinear(k, n, False, gs, v2=True)
    m.qweight, m.scales, m.g_idx = qw, s.to(dtype), (torch.arange(k) // gs).to(torch.int32)
    m.qzeros = pack_rows(zero.to(torch.int64).t().contiguous()).t().contiguous()
    if prepare:
        m._prepare_as("w4triton", dtype)
    return m


def test_a_one_row_mlp_over_triton_modules_ends_gate_up_in_its_activation(monkeypatch):
    """Bound through the server's projections, a [gate | up] pair in the layout CUDA takes fuses into one module
    whose one-row call ends in the activation (quant.runtime.linear.WeightOnlyLinear.gated_call): a one-row MLP launches no
    activation kernel and equals the unfused MLP bit for bit; more rows take the projection and act_mul as before.
    A module whose one-row path is no Triton kernel (a CPU layout) offers no such call."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    from server import fastops
    from server.layers.linear import Projections
    from server.layers.mlp import GatedMLP

    k, inter, gs = 256, 128, 64
    gate, up, down = _w4triton(inter, k, gs, 31), _w4triton(inter, k, gs, 32), _w4triton(k, inter, gs, 33)
    proj = Projections(torch.float16)
    gate_up, gated = proj.bind_gated("gate_up", [gate, up], "gelu_tanh_mul")
    assert gated is not None and proj.fused_groups == 1
    assert proj.describe() == ["gate_up of 1 layer(s): one-row launches end in gelu_tanh_mul, no activation kernel "
                               "at batch 1"]
    ops = fastops.Ops("triton")
    mlp, plain = (GatedMLP(gate_up, proj.bind("down", [down]), "gelu_pytorch_tanh", ops, g) for g in (gated, None))
    launched: Counter = Counter()
    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *a, **kw: launched.update([self.fn.__name__]) or run(self, *a, **kw))
    for rows, acts in ((1, 0), (3, 1)):
        h = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).half()
        launched.clear()
        got = mlp(h)
        assert launched["_act_mul_kernel"] == acts
        assert torch.equal(got, plain(h))
    stored = _w4triton(2 * inter, k, gs, 34, prepare=False)
    assert stored.launch_space(torch.float16) is None
    assert Projections(torch.float16).bind_gated("gate_up", [stored], "silu_mul")[1] is None


def test_split_counters_made_under_inference_mode_are_rearmed_outside_it(monkeypatch):
    """The engine's first split launch may run under inference mode; a later launch search re-arms the counters in
    place outside it, which an inference tensor would refuse."""
    monkeypatch.setattr(T, "_LOCKS", {})
    with torch.inference_mode():
        held = T.split_counters(torch.device("cpu"), 10)
    assert not held.is_inference()
    held[3] = 2
    T.reset_split_counters(torch.device("cpu"))
    assert not held.any()


def test_the_one_row_epilogues_refuse_what_they_cannot_compute():
    """The gated and norm epilogues are the one-row kernels': more rows, both at once, or a module whose kernel has
    none (a part of a fused projection, the CPU's int8 kernels) are refused in one line."""
    from quant.runtime.int8 import Int8WeightLinear

    qw, sz, *_ = _w4(128, 256, 64, seed=3)
    x2 = torch.randn(2, 256)
    with pytest.raises(ValueError, match="one-row kernel's; x has 2 rows"):
        T.w4_matmul(x2, qw, sz, 64, gated="silu_mul")
    with pytest.raises(ValueError, match="one-row kernel's; x has 2 rows"):
        T.int8_matmul(x2, torch.zeros(128, 256, dtype=torch.int8), torch.ones(128), None,
                      norm=T.AddNorm(torch.zeros(1, 128), torch.ones(128), 1e-5))
    with pytest.raises(ValueError, match="no gated epilogue beside it"):
        T.w4_gemv(x2[:1], qw, sz, 64, (64, 32, 1, 4), gated="silu_mul",
                  norm=T.AddNorm(torch.zeros(1, 128), torch.ones(128), 1e-5))
    cpu = Int8WeightLinear.from_float(torch.nn.Linear(256, 128, bias=False), False)
    cpu.prepare(torch.bfloat16)
    assert cpu.gated_call("silu_mul", torch.bfloat16) is None and cpu.normed_call(torch.ones(128), 1e-5,
                                                                                   torch.bfloat16) is None
    with pytest.raises(ValueError, match="the CPU's int8 kernels have no epilogues"):
        cpu._kernel_matmul(x2[:1].bfloat16(), gated="silu_mul")
    kernel = _w4triton(128, 256, 64, 53)  # a one-row Triton kernel: a norm epilogue binds where its weights fit
    w = torch.ones(128, dtype=torch.float16)
    assert kernel.normed_call(w, 1e-5, torch.float16, (w, 1e-6), 0.5) is not None
    assert kernel.normed_call(w[:-1], 1e-5, torch.float16) is None
    assert kernel.normed_call(w, 1e-5, torch.float16, (w.float(), 1e-6)) is None
    gate, up = _w4triton(64, 256, 64, 51), _w4triton(64, 256, 64, 52)
    from quant.runtime.int4 import GPTQLinear

    fused = GPTQLinear.fuse([gate, up])
    assert fused is not None
    with pytest.raises(ValueError, match="a part of a fused projection has no epilogues"):
        gate._kernel_matmul(x2[:1].half(), gated="silu_mul")
