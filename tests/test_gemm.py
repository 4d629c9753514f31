"""The tiled many-row int4 and int8 products (quant/runtime/kernels/gemm.py, quant/runtime/kernels/csrc/gemm_ops.cpp) against the modules' fp32
references and the dequantize-then-matmul paths they stand in for; where they are offered; their one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rerun_capped_to_avx2
from helpers import gptq_linear

from quant.runtime import int4
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.kernels import gemm

pytestmark = pytest.mark.reference


def _int8(n: int, k: int, bias: bool, affine: bool, seed: int = 0) -> Int8WeightLinear:
    torch.manual_seed(seed)
    m = Int8WeightLinear.from_float(torch.nn.Linear(k, n, bias=bias), affine)
    m.prepare(torch.bfloat16)
    return m


def _gemm_path(m):
    path = m.paths(torch.bfloat16).get("gemm")
    if path is None:
        pytest.skip(f"no gemm path here ({gemm.unavailable_reason() or 'no AVX512-BF16, or another layout'})")
    return path


# K = 768: three K-tiles of 256 columns (a tile holds at most 32 KiB of expanded weights, 128 bytes a column);
# rows 1, 7, 13, 70: a lone row, strips of 6 with remainders, and more rows than one strip and one chunk
@pytest.mark.parametrize("n,k,group", [(64, 128, 64), (192, 768, 128), (128, 320, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows_", [1, 7, 13, 70])
def test_gemm_computes_the_dequantize_then_matmul_product(n, k, group, bias, act_order, rows_):
    _check_dequantized_product(gptq_linear(n, k, bias, act_order, group=group), rows_)


def _check_dequantized_product(m, rows_: int) -> None:
    """The gemm path of m on rows_ random rows: held to the module's fp32 reference, and to the dequantizer's W in
    the tiles' dtype (what the dequant path hands oneDNN or MKL) summed in fp32 and rounded once: the same numbers
    up to the order of the fp32 sums, so equal after rounding almost everywhere; a wrong lane, pair, group, tile or
    permutation could not hide under the tolerance of the first check and this."""
    path = _gemm_path(m)
    x = torch.randn(rows_, m.in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = path(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows_, m.out_features)
    ref = m.reference_forward(x)
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 8e-3
    w = m.dequantized(gemm.tile_dtype()).float()  # (N, K)
    want = F.linear(x.float(), w, None if m.bias is None else m.bias.float()).bfloat16()
    assert float((y == want).float().mean()) > 0.99


# K = 200: one K-tile ending in a partial 32-column step; 1000: four tiles, the last one partial
@pytest.mark.parametrize("n,k", [(64, 200), (192, 1000)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("rows_", [1, 7, 70])
def test_int8_gemm_computes_the_dequantize_then_matmul_product(n, k, bias, affine, rows_):
    _check_dequantized_product(_int8(n, k, bias, affine), rows_)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_each_row_is_computed_alone(scheme):
    """Rows fall into strips of 6 and chunks per thread by their count; a row's sums must not depend on either."""
    m = gptq_linear(128, 256, True, False) if scheme == "int4" else _int8(128, 256, True, True)
    path = _gemm_path(m)
    x = torch.randn(41, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = path(x)
    assert torch.equal(whole, torch.cat([path(x[i: i + 1]) for i in range(41)]))
    assert path(x[:0]).shape == (0, 128)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_non_finite_sums_come_out_as_c10_rounds_them(scheme):
    """The epilogue rounds fp32 sums to bf16 as c10 does (AVX2's in vector integer steps): a NaN in x makes its row
    NaN, an infinity makes its row +-inf, or NaN where a weight is 0, as the dequantized product says, a sum past
    bf16's largest finite value rounds to inf; every other row is untouched."""
    m = gptq_linear(64, 128, False, False) if scheme == "int4" else _int8(64, 128, False, True)
    path = _gemm_path(m)
    w = m.dequantized(torch.float32)  # (N, K)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = (3e38 * torch.sign(w[0])).bfloat16()  # output 0's products all positive and huge: +inf in any order
    y = path(x)
    want = F.linear(x.float(), w).bfloat16()
    assert torch.isnan(y[1]).all()
    assert torch.equal(torch.isnan(y[2]), torch.isnan(want[2])) and torch.equal(y[2][~torch.isnan(y[2])],
                                                                                 want[2][~torch.isnan(want[2])])
    assert torch.isinf(y[2]).sum() + torch.isnan(y[2]).sum() == 64
    assert y[3, 0] == float("inf")
    assert torch.equal(y[[0, 4]], path(x[[0, 4]]))


def test_gemm_of_a_fused_module_is_its_parts_products():
    """Parts of 64 and 128 rows end on block boundaries, so each output's sums are the same."""
    fused = int4.GPTQLinear.fuse([gptq_linear(n, 128, False, False, seed=n) for n in (64, 128)])
    if fused is None:
        pytest.skip("parts of these sizes do not fuse on this CPU's layout")
    y = _gemm_path(fused)(x := torch.randn(9, 128, generator=torch.Generator().manual_seed(7)).bfloat16())
    want = torch.cat([gptq_linear(n, 128, False, False, seed=n).paths(torch.bfloat16)["gemm"](x) for n in (64, 128)], 1)
    assert torch.equal(y, want)


def test_gemm_is_offered_only_where_it_computes():
    """bf16 activations and whole 64-row blocks: fp16/fp32 inputs and an N with a partial block take other paths."""
    _gemm_path(gptq_linear(64, 128, False, False))  # skips where the op is not built for this CPU
    assert "gemm" not in gptq_linear(64, 128, False, False).paths(torch.float32)
    m = gptq_linear(80, 128, False, False)  # one full block and a partial, interleaved one
    assert "gemm" not in m.paths(torch.bfloat16) and "rows" in m.paths(torch.bfloat16)
    assert "gemm" in _int8(64, 128, False, False).paths(torch.bfloat16)
    assert "gemm" not in _int8(72, 128, False, False).paths(torch.bfloat16)  # blocks of 64 (AVX-512) or 16 (AVX2)
    assert "gemm" not in _int8(64, 127, False, False).paths(torch.bfloat16)  # K odd: pairs of columns
    from quant.runtime.w8a8 import W8A8Linear

    for k, offered in ((128, True), (127, False)):
        a8 = W8A8Linear.from_float(torch.nn.Linear(k, 64), 0.05)
        a8.prepare(torch.bfloat16)
        assert ("gemm" in a8.paths(torch.bfloat16)) == offered


def test_bad_operands_get_one_line_errors():
    m = gptq_linear(64, 128, False, False)
    _gemm_path(m)
    packed, sz = m.packed, m.scales_zeros
    x = torch.zeros(2, 128).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU \\(M, K\\) bf16 tensor"):
        gemm.int4(packed, 64, 128, sz, 64, None)(x.float())
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU \\(M, K\\) bf16 tensor"):
        gemm.int4(packed, 64, 128, sz, 64, None)(x[:, :64])
    with pytest.raises(RuntimeError, match="packed must be a contiguous CPU uint8 tensor of N \\* K / 2 bytes"):
        gemm.int4(packed.flatten()[1:], 64, 128, sz, 64, None)(x)
    with pytest.raises(RuntimeError, match="N must be a multiple of (64|32)"):
        gemm.int4(packed.flatten()[: 16 * 128 // 2], 16, 128, sz[:, :16], 64, None)(x)
    with pytest.raises(RuntimeError, match="scales_zeros must be a contiguous \\(K / group_size, N, 2\\) tensor"):
        gemm.int4(packed, 64, 128, sz[:1], 64, None)(x)
    with pytest.raises(RuntimeError, match="K must be a multiple of group_size, an even number"):
        gemm.int4(packed, 64, 128, sz, 3, None)(x)
    with pytest.raises(RuntimeError, match="bias must be a contiguous \\(64,\\) fp32 tensor, or empty"):
        gemm.int4(packed, 64, 128, sz, 64, torch.ones(63))(x)
    q, s = torch.zeros(64, 128, dtype=torch.int8), torch.ones(64)
    with pytest.raises(RuntimeError, match="weight must be a contiguous CPU \\(N, K\\) int8 tensor"):
        gemm.int8(q.float(), s, None, None)(x)
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU \\(M, K\\) bf16 tensor"):
        gemm.int8(q[:, :64].contiguous(), s, None, None)(x)
    with pytest.raises(RuntimeError, match="N must be a multiple of (64|16) and K even"):
        gemm.int8(q[:8], s[:8], None, None)(x)
    with pytest.raises(RuntimeError, match="weight_scale must be a contiguous \\(N,\\) fp32 tensor"):
        gemm.int8(q, s.bfloat16(), None, None)(x)
    with pytest.raises(RuntimeError, match="zero must be a contiguous \\(N,\\) int8 tensor, or empty"):
        gemm.int8(q, s, torch.zeros(64, dtype=torch.int32), None)(x)
    xq = torch.zeros(2, 128, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="xq must be a contiguous CPU \\(M, K\\) int8 tensor"):
        gemm.w8a8(q, s, None)(xq.float(), torch.ones(2))
    with pytest.raises(RuntimeError, match="x_scale must be a contiguous \\(M,\\) fp32 tensor"):
        torch.ops.quantserve_gemm.w8a8_gemm(xq, torch.ones(3), q, s, q.sum(1, dtype=torch.int32), torch.empty(0))
    with pytest.raises(RuntimeError, match="weight_sums must be a contiguous \\(N,\\) int32 tensor"):
        torch.ops.quantserve_gemm.w8a8_gemm(xq, torch.ones(2), q, s, q.sum(1), torch.empty(0))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 7, 70])
def test_bf16_gemm_computes_the_fp32_product(bias, rows_):
    """Only where the CPU has no fast bf16 GEMM (AVX2): a bf16 Linear's many-row product in fp32 tiles."""
    from quant.runtime.kernel_choice import dense_paths

    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 200, generator=g).bfloat16()  # K = 200: a last 8-column step of its own
    b = torch.randn(48, generator=g) if bias else None
    paths = dense_paths(w, b, torch.bfloat16)
    if not gemm.available(w, 48, 200, torch.bfloat16, dense=True):
        assert "gemm" not in paths
        with pytest.raises(RuntimeError, match="bf16_gemm is built only for CPUs without AVX512-BF16"):
            gemm.bf16(w, b)(torch.zeros(1, 200).bfloat16())
        pytest.skip("bf16 weights take oneDNN's bf16 GEMM on this CPU")
    x = torch.randn(rows_, 200, generator=g).bfloat16()
    y = paths["gemm"](x)
    want = F.linear(x.float(), w.float(), b).bfloat16()
    assert y.shape == (rows_, 48) and float((y == want).float().mean()) > 0.99
    with pytest.raises(RuntimeError, match="weight must be a contiguous CPU \\(N, K\\) bf16 tensor"):
        gemm.bf16(w.float(), b)(x)
    with pytest.raises(RuntimeError, match="N must be a multiple of 16"):
        gemm.bf16(w[:40].contiguous(), None)(x)


def test_the_avx2_kernels_under_an_avx2_cap():
    """A CPU without AVX-512 gets the fp32-tile kernels (gemm_avx2.h): this file's tests, bf16 ones included, run
    again under an AVX2 cap."""
    rerun_capped_to_avx2(__file__, "not under_an_avx2_cap")


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 7, 70])
@pytest.mark.parametrize("k", [200, 198])  # 198: not a multiple of 4, so fp32 sums with AVX512-BF16 even with VNNI
def test_w8a8_gemm_computes_the_fp32_paths_numbers(dynamic, smooth, bias, rows_, k):
    """The same integer products and fp32 rescale as W8A8Linear's fp32 path: equal after rounding (fp32 sums in
    another order; with AVX2 or AVX512-VNNI, int32 sums, so int_mm's exactly), and held to the module's
    reference."""
    from quant.runtime.w8a8 import W8A8Linear

    torch.manual_seed(3)
    lin = torch.nn.Linear(k, 64, bias=bias)
    calib = torch.randn(32, k) * 2
    m = W8A8Linear.from_float(lin, None if dynamic else float(calib.abs().max() / 127),
                              torch.rand(k) + 0.5 if smooth else None)
    m.prepare(torch.bfloat16)
    paths = m.paths(torch.bfloat16)
    path = _gemm_path(m)
    x = torch.randn(rows_, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = path(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows_, 64)
    assert float((y == paths["fp32"](x)).float().mean()) > 0.99
    if gemm.w8a8_integer_sums(k):  # AVX2, AVX512-VNNI: exact int32 sums, the rows path's (int_mm's) bit for bit
        assert torch.equal(y, paths["rows"](x))
    ref = m.reference_forward(x)
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 8e-3


def test_int8_product_is_the_exact_integer_product_by_the_avx2_op_or_the_primitive():
    """gemm.int8_product (what the w8a8 build scores its candidates with): xq @ wq^T as fp32 of the exact integer
    sums, by the AVX2 build's int16 op where it has one (N in whole blocks, K even), else primitives.int8_product;
    the op's sums stay exact where fp32 sums of the codes would round (K = 2048 at +-127: 33 million)."""
    g = torch.Generator().manual_seed(3)
    for m, n, k in [(0, 16, 2), (1, 16, 2), (70, 48, 200), (13, 40, 200), (9, 32, 199), (30, 96, 1536)]:
        xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        assert torch.equal(gemm.int8_product(xq, wq), (xq.long() @ wq.long().t()).float()), (m, n, k)
    op = torch.ops.quantserve_gemm.int8_sums if gemm.unavailable_reason() is None else None
    xq, wq = torch.full((5, 2048), 127, dtype=torch.int8), torch.full((32, 2048), -127, dtype=torch.int8)
    if gemm.tile_dtype() != torch.float32:  # an AVX512-BF16 build (or none): no op, the primitive's paths
        if op is not None:
            with pytest.raises(RuntimeError,
                               match="int8_sums is built only for CPUs with AVX2 and without AVX512-BF16"):
                op(xq, wq)
        return
    assert torch.equal(op(xq, wq), torch.full((5, 32), -2048.0 * 127 * 127))
    with pytest.raises(RuntimeError, match="xq must be a contiguous CPU \\(M, K\\) int8 tensor"):
        op(xq.float(), wq)
    with pytest.raises(RuntimeError, match="weight must be a contiguous CPU \\(N, K\\) int8 tensor"):
        op(xq, wq.t())
    with pytest.raises(RuntimeError, match="N must be a multiple of 16 and K even"):
        op(xq, wq[:8])
