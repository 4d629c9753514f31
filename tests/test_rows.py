"""The one-call int8 and int4 Linears (quant/runtime/kernels/rows.py, quant/runtime/kernels/csrc/rows_ops.cpp) against exact and fp32 references,
the check that keeps an inexact ``torch._int_mm`` out of the W8A8 paths, and the ISA cap of the C++ builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import gptq_linear
from torch import nn

from quant.runtime import int4
from quant.runtime import primitives as P
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.kernels import int4_layout, native, rows
from quant.runtime.w8a8 import W8A8Linear

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.reference, pytest.mark.skipif(not rows.available(torch.empty(0, dtype=torch.int8)),
                                                          reason="the C++ int8 ops cannot be built here")]


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _exact_w8a8(m: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The module's own quantization and rescale around an integer product summed in int64 (exact)."""
    xq, xs = m._quantize_input(x)
    acc = (xq.long() @ m.weight.long().t()).to(torch.int32)  # (M, N), |sum| < 2^31 here
    return m._finish(acc, xs, x.dtype)


# K = 200 and N = 98: neither a multiple of the vector width nor of the four rows taken at once (the tails).
@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_w8a8_rows_equals_the_exact_integer_product_bit_for_bit(dynamic, smooth, bias, dtype, rows):
    lin = _linear(200, 98, bias)
    s = torch.rand(200, generator=torch.Generator().manual_seed(1)) + 0.5 if smooth else None
    m = W8A8Linear.from_float(lin, None if dynamic else 0.01, s)  # static: some inputs saturate
    m.prepare()
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = m.paths(dtype)["rows"](x)
    assert y.dtype == dtype and torch.equal(y, _exact_w8a8(m, x))


def test_w8a8_rows_is_exact_where_16_bit_pair_sums_would_saturate():
    """Every activation and weight at +-127: the case oneDNN's AVX2 int8 GEMM gets wrong."""
    m = W8A8Linear.from_float(_linear(256, 8, False), 1.0)
    m.weight = torch.full((8, 256), 127, dtype=torch.int8)
    m.weight[1::2] = -127
    x = torch.full((2, 256), 500.0)  # quantized to 127 (saturated)
    y = m.paths(torch.float32)["rows"](x)
    want = 256 * 127 * 127 * m.weight_scale * torch.tensor([1.0, -1.0] * 4)
    assert torch.equal(y, want.expand(2, 8).float())


def test_w8a8_rows_keeps_a_nan_row_nan_as_the_module_does():
    """A NaN activation makes its row's dynamic scale NaN, and the whole output row NaN (torch's amax propagates it);
    the other rows are untouched."""
    m = W8A8Linear.from_float(_linear(64, 8, False), None)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    x[1, 5] = float("nan")
    y = m.paths(torch.float32)["rows"](x)
    assert bool(y[1].isnan().all())
    assert torch.equal(y[[0, 2]], _exact_w8a8(m, x[[0, 2]]))


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_weight_rows_matches_the_fp32_reference(affine, bias, dtype, rows):
    m = Int8WeightLinear.from_float(_linear(200, 98, bias, seed=3), affine)
    m.prepare(dtype)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = m.reference_forward(x)
    y = m.paths(dtype)["rows"](x)
    # fp32 sums in another order than the reference's, rounded once: fp32 accuracy, or half a bf16 ulp
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    assert y.dtype == dtype and float((y.float() - ref).abs().max() / ref.abs().max()) < tol


def test_int8_weight_rows_of_a_fused_module_are_its_parts_products():
    parts = [Int8WeightLinear.from_float(_linear(64, n, False, seed=n), True) for n in (32, 16)]
    fused = Int8WeightLinear.fuse(parts)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = fused.paths(torch.bfloat16)["rows"](x)
    want = torch.cat([p.paths(torch.bfloat16)["rows"](x) for p in parts], dim=1)
    assert torch.equal(y, want)


def _int8_rows16(m: Int8WeightLinear, dtype: torch.dtype):
    if not rows.rows16_built():
        pytest.skip("the passes on 16-bit block activations are built for AVX2 CPUs without AVX-512 only")
    return m.paths(dtype)["rows16"]


def _assert_rows16_product(op, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, equal: float) -> None:
    """A rows16 pass ``op`` on x, W (N, K) and the bias in float64: within its dtype's rounding of the product of x as
    P.quantize_act_blocks16 holds it, equal to that product once rounded on more than ``equal`` of the outputs, that
    product within 2^-14 of the exact one's largest output (rounded, far below the 16-bit output's), and each row
    what it is alone, bit for bit."""
    ref = torch.nn.functional.linear(P.quantize_act_blocks16(x).double(), w, b)
    exact = torch.nn.functional.linear(x.double(), w, b)
    y = op(x)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < (8e-3 if x.dtype == torch.bfloat16 else 1e-3)
    assert float((y == ref.to(x.dtype)).float().mean()) > equal
    assert 0 < float((ref - exact).abs().max() / exact.abs().max()) < 2.0**-14
    assert torch.equal(y, torch.cat([op(x[i:i + 1]) for i in range(x.shape[0])]))


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_weight_rows16_is_the_exact_product_to_16_bit_rounding(affine, bias, rows_, dtype):
    """The int8 rows16 path: the module's weights times its input held as int16 in blocks of 32
    (P.quantize_act_blocks16), each block's sums exact: within 2^-14 of the exact product's largest output before
    rounding, equal to that product computed in float64 once rounded to x's dtype almost everywhere (the blocks' sum
    is an fp32 one, so an output on a rounding boundary may fall to its other side), and each row what it is alone,
    bit for bit. N = 98: four weight rows at a time and a tail of two."""
    m = Int8WeightLinear.from_float(_linear(256, 98, bias, seed=5), affine)
    m.prepare(dtype)
    op = _int8_rows16(m, dtype)
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(rows_, 256, generator=g) * torch.logspace(-4, 1, 256)).to(dtype)  # wide ranges in blocks too
    _assert_rows16_product(op, x, m.dequantized(torch.float64), None if m.bias is None else m.bias.double(), 0.98)


def test_int8_weight_rows16_at_full_scale_and_with_a_nan_row_and_no_rows():
    """Weights and activations at full scale (a block's integer sums at their largest) give the exact product; a
    row with a NaN gives NaN and leaves the others as they are alone; no rows give an empty result (the head of a
    step that samples nothing)."""
    m = Int8WeightLinear.from_float(_linear(64, 8, False, seed=6), False)
    m.weight = torch.full((8, 64), 127, dtype=torch.int8)
    m.weight[1::2] = -127
    m.prepare(torch.bfloat16)
    op = _int8_rows16(m, torch.bfloat16)
    x = torch.full((3, 64), 3.0).bfloat16()
    x[1, 5] = float("nan")
    y = op(x)
    want = (64 * 3.0 * 127 * m.weight_scale.double() * torch.tensor([1.0, -1.0] * 4, dtype=torch.float64))
    assert torch.equal(y[[0, 2]], want.to(torch.bfloat16).expand(2, 8))
    assert bool(y[1].isnan().all())
    assert torch.equal(y[[0, 2]], op(x[[0, 2]]))
    assert op(x[:0]).shape == (0, 8)


def test_int8_rows16_is_offered_for_16_bit_inputs_with_k_a_multiple_of_32():
    if not rows.rows16_built():
        pytest.skip("the passes on 16-bit block activations are built for AVX2 CPUs without AVX-512 only")
    m = Int8WeightLinear.from_float(_linear(64, 16, False), True)
    m.prepare(torch.bfloat16)
    assert "rows16" in m.paths(torch.bfloat16) and "rows16" in m.paths(torch.float16)
    assert "rows16" not in m.paths(torch.float32)  # fp32 x would lose bits past int16's: the exact paths only
    odd = Int8WeightLinear.from_float(_linear(200, 16, False), True)
    odd.prepare(torch.bfloat16)
    assert "rows16" not in odd.paths(torch.bfloat16) and "rows" in odd.paths(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        rows.int8_weight16(odd.weight, odd.weight_scale, None, None)(torch.zeros(1, 200).bfloat16())
    with pytest.raises(RuntimeError, match="offset must be a contiguous \\(16,\\) fp32 tensor, or empty"):
        rows.int8_weight16(m.weight, m.weight_scale, torch.ones(15), None)(torch.zeros(1, 64).bfloat16())
    with pytest.raises(RuntimeError, match="weight_scale must be a contiguous \\(N,\\) fp32 tensor \\(or bf16\\)"):
        rows.int8_weight16(m.weight, m.weight_scale.half(), None, None)(torch.zeros(1, 64).bfloat16())


# N = 80: one full block of the AVX-512 layout (64 rows) and a partial, interleaved one; 2 and a half of AVX2's.
@pytest.mark.parametrize("n", [80, 192])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows_", [1, 5])
@pytest.mark.parametrize("sym", [True, False])  # asymmetric: each row's zero point enters every group's sum
def test_int4_rows_matches_the_fp32_reference(n, bias, act_order, rows_, sym):
    m = gptq_linear(n, 128, bias, act_order, sym=sym)
    if int4_layout.cpu_layout() is None:
        pytest.skip("this CPU's int4pack layout is not one the C++ ops read")
    assert (m.perm is not None) == act_order
    x = torch.randn(rows_, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = m.reference_forward(x)
    paths = m.paths(torch.bfloat16)
    y = paths["rows"](x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows_, n)
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 8e-3
    # fp32 sums rounded once (in bf16 pairs with AVX512-BF16, fp32 FMAs elsewhere): the correctly rounded
    # reference almost everywhere, so a wrong lane, scale or group cannot hide under the bf16 tolerance above
    assert float((y == ref.bfloat16()).float().mean()) > 0.97
    # the same sums as the dequantizing fp32 path, up to fp32 ordering: equal after rounding almost everywhere
    assert float((y.float() - paths["dequant-fp32"](x).float()).abs().max() / ref.abs().max()) < 8e-3


def _int4_fp32(n: int = 192, k: int = 256, seed: int = 0):
    m = gptq_linear(n, k, True, False, seed=seed)
    m.prepare(torch.float32)
    if m.layout != "int4pack":
        pytest.skip("float32 keeps the GPTQ layout on this machine")
    return m


@pytest.mark.parametrize("magnitude", [1.0, 2.0**-100, 2.0**80])
def test_int4_rows_in_fp32_hold_the_reference_at_every_magnitude(magnitude):
    """AVX2's kernel codes each 4-bit weight as a subnormal number and scales x by a power of two chosen per row:
    exact products at any magnitude of x, even a row whose values span 2^60 (the smallest still counted), and the
    fp32 reference to fp32 accuracy (elsewhere the FMA kernel, held the same way)."""
    m = _int4_fp32()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 256, generator=g) * magnitude
    x[1] *= torch.where(torch.arange(256) % 3 == 0, 2.0**30, 2.0**-30)  # one row spanning 2^60
    ref = m.reference_forward(x)
    y = m.paths(torch.float32)["rows"](x)
    for r in range(5):
        assert float((y[r] - ref[r]).abs().max() / ref[r].abs().max()) < 1e-5, r


def test_int4_rows_in_fp32_propagate_a_nan_row_and_leave_the_others():
    m = _int4_fp32()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    x[1, 7] = float("nan")
    y = m.paths(torch.float32)["rows"](x)
    ref = m.reference_forward(x)
    assert bool(y[1].isnan().all()) and bool(ref[1].isnan().all())
    assert float((y[[0, 2]] - ref[[0, 2]]).abs().max() / ref[[0, 2]].abs().max()) < 1e-5


def test_int4_rows_are_right_where_subnormal_inputs_read_as_zero():
    """With the calling thread's DAZ set (``torch.set_flush_denormal``), its share of the blocks takes the FMA
    kernel: the subnormal-coded weights would read as zeros there."""
    m = _int4_fp32()
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(10))
    ref = m.reference_forward(x)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        y = m.paths(torch.float32)["rows"](x)
    finally:
        torch.set_flush_denormal(False)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


def test_int4_rows_of_a_fused_module_are_its_parts_products():
    """Parts of 64 and 128 rows end on block boundaries of every layout, so each row's sums are the same."""
    fused = int4.GPTQLinear.fuse([gptq_linear(n, 128, False, False, seed=n) for n in (64, 128)])
    if fused is None or int4_layout.cpu_layout() is None:
        pytest.skip("parts of these sizes do not fuse on this CPU's layout")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = fused.paths(torch.bfloat16)["rows"](x)
    want = torch.cat([gptq_linear(n, 128, False, False, seed=n).paths(torch.bfloat16)["rows"](x) for n in (64, 128)], 1)
    assert torch.equal(y, want)


def _int4_quantized(m: int4.GPTQLinear, op=rows.int4_a8):
    """The module's int4 product on int8 (``rows.int4_a8``) or int16 (``rows.int4_a16``) block activations."""
    if int4_layout.cpu_layout() != (32, True) or m.packed is None:
        pytest.skip("quantized activations are built for AVX2's int4pack layout (32-row split blocks) only")
    bias = None if m.bias is None else m.bias.data.float()
    return op(m.packed, m.out_features, m.in_features, m.scales_zeros, m.group_size, bias)


def _int4_a8(m: int4.GPTQLinear):
    return _int4_quantized(m, rows.int4_a8)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 3, 6])  # up to four rows share each decoded column pair: 6 is 4 + 2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_rows_with_int8_activations_match_their_reference(sym, bias, rows_, dtype):
    """The module's weights times its input quantized in blocks of 32 columns (P.quantize_act_blocks): the integer
    sums are exact, so the product equals that reference to fp32 ordering; each row is what it is alone, bit for
    bit."""
    m = gptq_linear(96, 256, bias, False, sym=sym)
    m.prepare(dtype)
    op = _int4_a8(m)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(rows_, 256, generator=g) * torch.linspace(0.01, 4.0, 256)).to(dtype)  # blocks' scales differ
    ref = torch.nn.functional.linear(P.quantize_act_blocks(x), m.dequantized(torch.float32),
                                     None if m.bias is None else m.bias.float())
    y = op(x)
    assert y.dtype == dtype and y.shape == (rows_, 96)
    if dtype == torch.float32:
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-6
    else:
        assert float((y == ref.to(dtype)).float().mean()) > 0.97
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < 8e-3
    assert torch.equal(y, torch.cat([op(x[i:i + 1]) for i in range(rows_)]))
    # and it is not the exact product: the activations' rounding shows (the reference tells them apart)
    exact = torch.nn.functional.linear(x.float(), m.dequantized(torch.float32), None if m.bias is None else m.bias.float())
    assert float((ref - exact).abs().max() / exact.abs().max()) > 1e-4


def test_int4_rows_with_int8_activations_propagate_a_nan_row_and_leave_the_others():
    m = _int4_fp32()
    op = _int4_a8(m)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(12))
    x[1, 7] = float("inf")
    y = op(x)
    ref = torch.nn.functional.linear(P.quantize_act_blocks(x), m.dequantized(torch.float32), m.bias.float())
    assert bool(y[1].isnan().all()) and bool(ref[1].isnan().all())
    assert float((y[[0, 2]] - ref[[0, 2]]).abs().max() / ref[[0, 2]].abs().max()) < 1e-6


def test_int4_rows_with_int8_activations_refuse_what_they_cannot_compute():
    m = _int4_fp32()
    _int4_quantized(m)  # skips where the quantized-activation ops are not built (an AVX-512 CPU)
    x = torch.randn(1, 256)
    sz, op = m.scales_zeros, rows._op("int4_rows_a8")
    with pytest.raises(RuntimeError, match="qmax must be in"):
        op(x, m.packed, 192, 256, sz, 64, torch.empty(0), 128.0, 1e-8)  # 16-bit sums would saturate
    with pytest.raises(RuntimeError, match="multiples of 32"):
        op(x[:, :200], m.packed[: 192 * 200 // 2], 192, 200, sz, 64, torch.empty(0), 127.0, 1e-8)
    a16 = rows._op("int4_rows_a16")  # the same checks before the int16 pass
    with pytest.raises(RuntimeError, match="multiples of 32"):
        a16(x[:, :200], m.packed[: 192 * 200 // 2], 192, 200, sz, 64, torch.empty(0))
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 32"):
        a16(x, m.packed, 192, 256, sz, 48, torch.empty(0))
    with pytest.raises(ValueError, match="multiple of 32"):
        P.quantize_act_blocks(torch.randn(2, 200))


def _int4_a16(m: int4.GPTQLinear):
    return _int4_quantized(m, rows.int4_a16)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 3, 6])  # up to four rows share each decoded column pair: 6 is 4 + 2
@pytest.mark.parametrize("dtype,group", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)])
def test_int4_rows_with_int16_activations_are_the_exact_product_to_16_bit_rounding(sym, bias, rows_, dtype, group):
    """The rows16 path: the module's weights times its input held as int16 in blocks of 32 (P.quantize_act_blocks16),
    the integer sums exact: equal, once rounded to x's dtype, to that product computed in float64 (every output
    here), within 2^-14 of the exact product's largest output, and each row what it is alone, bit for bit."""
    m = gptq_linear(96, 512, bias, False, group=group, sym=sym)
    m.prepare(dtype)
    op = _int4_a16(m)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(rows_, 512, generator=g) * torch.logspace(-4, 1, 512)).to(dtype)  # wide ranges in blocks too
    _assert_rows16_product(op, x, m.dequantized(torch.float32).double(), None if m.bias is None else m.bias.double(),
                           0.99)


def test_int4_rows_with_int16_activations_propagate_a_nan_row_and_leave_the_others():
    m = gptq_linear(192, 256, True, False)
    m.prepare(torch.bfloat16)
    op = _int4_a16(m)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(12)).bfloat16()
    x[1, 7] = float("nan")
    y = op(x)
    ref = torch.nn.functional.linear(P.quantize_act_blocks16(x), m.dequantized(torch.float32), m.bias.float())
    assert bool(y[1].isnan().all()) and bool(ref[1].isnan().all())
    assert float((y[[0, 2]].float() - ref[[0, 2]]).abs().max() / ref[[0, 2]].abs().max()) < 8e-3
    assert op(x[:0]).shape == (0, 192)  # no rows: an empty result


def test_the_rows16_path_is_offered_for_16_bit_activations_only():
    m = gptq_linear(96, 256, False, False)
    m.prepare(torch.bfloat16)
    _int4_a16(m)
    assert "rows16" in m.paths(torch.bfloat16) and "rows16" in m.paths(torch.float16)
    assert "rows16" not in m.paths(torch.float32)  # fp32 x would lose bits past int16's: the exact paths only
    m.use_int8_activations()
    assert "rows16" not in m.paths(torch.bfloat16)  # int8 activations are another function


def _products(m: int4.GPTQLinear, dtype: torch.dtype) -> dict:
    """The module's C++ rows passes for ``dtype`` and their epilogues, by path name (rows16 where it is built)."""
    m.prepare(dtype)
    return m._rows_products(dtype)


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2", "granite", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_", [1, 3])
def test_a_rows_pass_ends_in_the_glue_ops_bit_for_bit(family, dtype, rows_):
    """Each int4 rows pass (rows; rows16 and the int8-activation pass where built), each int8-weight one (rows;
    rows16 where built) and a float Linear's ends in the gated activation or
    in the norm epilogue inside its call (csrc/epilogue.h): the sub-layer's output norm, the residual multiplier
    (the eager product by a Python float), the residual add and the next norm (or none), each family's steps in
    the model's order. Both are the product then the glue ops (server/fastops.py's C++ ops), bit for bit."""
    from server import fastops

    if not fastops.load():
        pytest.skip(f"the glue ops are not built: {fastops.unavailable_reason()}")
    ops = fastops.Ops("fused")
    g = torch.Generator().manual_seed(61)
    n, k = 192, 256
    m = gptq_linear(n, k, True, False, seed=62)
    x = torch.randn(rows_, k, generator=g).to(dtype)
    res = (torch.randn(rows_, n, generator=g) * 3).to(dtype)
    w, pw = ((torch.rand(n, generator=g) + 0.5).to(dtype) for _ in range(2))
    weight = None if family == "olmo2" else w
    post = None if family in ("llama", "granite") else (pw, 0.5)  # an eps that shows (the two norms' not mixed up)
    scale = 0.7 if family in ("granite", "all") else 1.0
    products = _products(m, dtype)
    if int4_layout.cpu_layout() == (32, True):
        assert set(products) == ({"rows"} if dtype == torch.float32 else {"rows", "rows16"})
        m.use_int8_activations()
        products["rows on int8 activations"] = m._rows_products(dtype)["rows"]
    int8 = Int8WeightLinear.from_float(_linear(k, n, True, seed=66), True)
    int8.prepare(dtype)
    products.update({f"int8 weights, {name}": p for name, p in int8._rows_products(dtype).items()})
    if dtype != torch.float16:  # a float Linear's pass: bf16 or fp32 weights
        dense = _linear(k, n, True, seed=69)
        products["float weights, rows"] = rows.dense(dense.weight.data.to(dtype), dense.bias.data.float())
    for name, product in products.items():
        y = product(x)
        gu = product.gated("gelu_tanh_mul" if family == "gemma2" else "silu_mul")(x)
        want_gu = (ops.gelu_tanh_mul if family == "gemma2" else ops.silu_mul)(y)
        assert torch.equal(gu, want_gu), name
        if post is not None:
            y = ops.rms_norm(y, *post)
        if scale != 1.0:
            y = y * scale
        want = (res + y, res + y) if weight is None else ops.add_rms_norm(res, y, weight, 1e-5)
        got = product.normed(weight, 1e-5, post, scale)(x, res)
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
        if weight is None:
            assert got[1] is got[0]


def test_a_module_takes_the_epilogues_of_its_one_row_pass(monkeypatch):
    """GPTQLinear's gated and normed calls on a CPU are its one-row path's rows pass with the epilogue (in an
    act-order checkpoint's column order too); on any other one-row path none (the glue ops run apart)."""
    m = gptq_linear(192, 256, False, True, seed=63)  # act order: x is permuted into the kernel's order first
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(64)).bfloat16()
    res, w = torch.randn(1, 192).bfloat16(), torch.rand(192).bfloat16()
    monkeypatch.setattr(int4.GPTQLinear, "static_path", lambda self, rows, dtype: "kernel")
    assert m.gated_call("silu_mul", torch.bfloat16) is None and m.normed_call(w, 1e-5, torch.bfloat16) is None
    monkeypatch.setattr(int4.GPTQLinear, "static_path", lambda self, rows, dtype: "rows")
    y = m.call2d(x)
    assert torch.equal(m.gated_call("silu_mul", torch.bfloat16)(x), torch.ops.quantserve_rows.int4_rows_gated.default(
        x.index_select(1, m.perm), *m._rows_products(torch.bfloat16)["rows"].args, "silu_mul"))
    from server import fastops

    if fastops.load():
        want = fastops.Ops("fused").add_rms_norm(res, y, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(m.normed_call(w, 1e-5, torch.bfloat16)(x, res), want))
    assert m.gated_call("relu", torch.bfloat16) is None  # an activation without an epilogue
    assert m.normed_call(w[:-1], 1e-5, torch.bfloat16) is None  # weights that are not (N,) in the dtype
    assert m.normed_call(w.float(), 1e-5, torch.bfloat16) is None


def test_an_int8_module_takes_the_epilogues_of_its_one_row_pass(monkeypatch):
    """Int8WeightLinear's gated and normed calls on a CPU are its one-row path's rows pass with the epilogue; on any
    other one-row path none (the glue ops run apart)."""
    m = Int8WeightLinear.from_float(_linear(256, 192, True, seed=67), True)
    m.prepare(torch.bfloat16)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(68)).bfloat16()
    res, w = torch.randn(1, 192).bfloat16(), torch.rand(192).bfloat16()
    monkeypatch.setattr(Int8WeightLinear, "static_path", lambda self, rows, dtype: "kernel")
    assert m.gated_call("silu_mul", torch.bfloat16) is None and m.normed_call(w, 1e-5, torch.bfloat16) is None
    for path in m._rows_products(torch.bfloat16):
        monkeypatch.setattr(Int8WeightLinear, "static_path", lambda self, rows, dtype, path=path: path)
        product = m._rows_products(torch.bfloat16)[path]
        assert torch.equal(m.gated_call("silu_mul", torch.bfloat16)(x), product.gated("silu_mul")(x)), path
        got, want = m.normed_call(w, 1e-5, torch.bfloat16)(x, res), product.normed(w, 1e-5)(x, res)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), path
        assert m.gated_call("relu", torch.bfloat16) is None and m.normed_call(w[:-1], 1e-5, torch.bfloat16) is None


def test_a_float_projection_takes_the_epilogues_of_its_planned_one_row_pass():
    """A float Linear (the unquantized model's) has no module of its own: where its plan takes the C++ ``rows`` pass
    at one row, ``Projections`` gives its gated and normed calls from that pass (the glue ops' bits); where the plan
    takes PyTorch's product there, or nothing was measured, none."""
    from types import SimpleNamespace

    from quant.runtime.kernel_choice import ROW_BUCKETS, RowPlan
    from server.layers.linear import Projections

    class Planned:  # a chooser whose plans take `path` at every row count
        def __init__(self, path):
            self.path, self.chosen = path, {}

        def plan(self, key, paths, in_features, dtype, device, max_rows=None):
            self.chosen[key] = RowPlan((self.path,) * len(ROW_BUCKETS), {})
            return self.chosen[key]

    dt = torch.bfloat16
    gate, up, o = (_linear(128, n, False, seed=70 + n).to(dt) for n in (96, 96, 128))
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(71)).to(dt)
    res = torch.randn(1, 128, generator=torch.Generator().manual_seed(72)).to(dt)
    norm = SimpleNamespace(weight=(torch.rand(128) + 0.5).to(dt), eps=1e-5)
    proj = Projections(dt, Planned("rows"))
    call, gated = proj.bind_gated("gate_up", [gate, up], "silu_mul")
    o_call = proj.bind("o", [o])
    from server import fastops

    if not fastops.load():
        pytest.skip(f"the glue ops are not built: {fastops.unavailable_reason()}")
    ops = fastops.Ops("fused")
    assert torch.equal(gated(x), ops.silu_mul(call(x)))
    got, want = proj.normed(o, norm)(x, res), ops.add_rms_norm(res, o_call(x), norm.weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert proj.describe()[0].startswith("gate_up of 1 layer(s): one-row launches end in silu_mul")
    assert proj.normed(o, SimpleNamespace(weight=norm.weight.float(), eps=1e-5)) is None  # not in the dtype
    for chooser in (Planned("dense"), None):
        other = Projections(dt, chooser)
        assert other.bind_gated("gate_up", [gate, up], "silu_mul")[1] is None
        other.bind("o", [o])
        assert other.normed(o, norm) is None


def test_an_epilogue_refuses_what_it_cannot_compute_in_one_line():
    m = gptq_linear(192, 256, False, False, seed=65)
    product = _products(m, torch.bfloat16)["rows"]
    x, res, w = torch.randn(1, 256).bfloat16(), torch.randn(1, 192).bfloat16(), torch.rand(192).bfloat16()
    with pytest.raises(RuntimeError, match="no gated activation relu"):
        product.gated("relu")(x)
    with pytest.raises(RuntimeError, match="residual must be \\(1, 192\\)"):
        product.normed(w, 1e-5)(x, res[:, :-1])
    with pytest.raises(RuntimeError, match="residual must be"):
        product.normed(w, 1e-5)(x, res.float())
    with pytest.raises(RuntimeError, match="w must be a contiguous"):
        product.normed(w[:-1], 1e-5)(x, res)
    with pytest.raises(RuntimeError, match="w must be a contiguous"):
        product.normed(w, 1e-5, (w.float(), 1e-6))(x, res)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_", [1, 2, 5, 8, 15])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_rows_match_the_fp32_product(bias, rows_, dtype):
    """Within the dtype's rounding of the product; and each row is what it is alone, bit for bit (rows are taken two
    at a time, each row's sums formed as one row's are)."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(98, 200, generator=g).to(dtype)  # N, K: tails of the four rows and of the vector width
    b = torch.randn(98, generator=g).to(dtype) if bias else None
    x = torch.randn(rows_, 200, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    op = rows.dense(w, None if b is None else b.float())
    y = op(x)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    assert y.dtype == dtype and float((y.double() - ref).abs().max() / ref.abs().max()) < tol
    assert torch.equal(y, torch.cat([op(x[i:i + 1]) for i in range(rows_)]))


def test_bad_operands_get_one_line_errors():
    q = torch.zeros(8, 64, dtype=torch.int8)
    s = torch.ones(8)
    with pytest.raises(RuntimeError, match="weight must be a contiguous CPU \\(N, K\\) int8 tensor with x's K"):
        rows.int8_weight(q, s, None, None)(torch.zeros(1, 32))
    with pytest.raises(RuntimeError, match="weight_scale must be a contiguous \\(N,\\) fp32 tensor"):
        rows.w8a8(q, s.double(), None, None, None)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="smooth_scale must be a contiguous \\(64,\\) fp32 tensor"):
        rows.w8a8(q, s, None, torch.ones(63), None)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="bias must be a contiguous \\(8,\\) fp32 tensor, or empty"):
        rows.int8_weight(q, s, None, torch.ones(7))(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="input_scale must be a 0-dim fp32 tensor"):
        rows.w8a8(q, s, torch.ones(2), None, None)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="weight must be a contiguous CPU \\(N, K\\) tensor of x's dtype"):
        rows.dense(torch.zeros(8, 64).bfloat16(), None)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU \\(M, K\\) bf16 or fp32 tensor"):
        rows.dense(torch.zeros(8, 64).half(), None)(torch.zeros(1, 64).half())
    with pytest.raises(RuntimeError, match="weight_scale must be a contiguous \\(N,\\) fp32 tensor \\(or bf16\\)"):
        rows.int8_weight(q, s.half(), None, None)(torch.zeros(1, 64))
    packed = torch.zeros(64 * 128 // 2, dtype=torch.uint8)
    sz = torch.ones(2, 64, 2)
    with pytest.raises(RuntimeError, match="N and the block \\(<= 64\\) must be even"):
        rows.int4(packed, 64, 128, (128, True), sz, 64, None)(torch.zeros(1, 128))
    with pytest.raises(RuntimeError, match="scales_zeros must be \\(K / group_size, N, 2\\)"):
        rows.int4(packed, 64, 128, (64, True), sz[:1], 64, None)(torch.zeros(1, 128))
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU \\(M, K\\) tensor"):
        rows.int4(packed, 64, 128, (64, True), sz, 64, None)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="rotate must be 0 or a power of two dividing K"):
        rows.w8a8(q, s, None, None, None, rotate=24)(torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="hadamard_: the block must be a power of two dividing K"):
        rows.hadamard_(torch.zeros(2, 64), 128)
    with pytest.raises(RuntimeError, match="hadamard_: x must be fp32 or fp64"):
        rows.hadamard_(torch.zeros(2, 64).bfloat16(), 64)
    with pytest.raises(RuntimeError, match="hadamard_: x must be a contiguous \\(M, K\\) tensor"):
        rows.hadamard_(torch.zeros(64, 2).t(), 64)


def test_an_inexact_int_mm_is_not_offered(monkeypatch):
    """Where ``torch._int_mm`` saturates (oneDNN without VNNI), the probe says so and the W8A8 module neither
    offers nor statically picks it; calibration's product takes fp32."""
    real = torch._int_mm

    def saturating(a, b):  # what 16-bit pair sums do to the worst case
        return real(a, b).clamp(-(2 ** 15), 2 ** 15 - 1)

    monkeypatch.setattr(P, "_INT_MM_EXACT", {})
    monkeypatch.setattr(P, "_INT_MM_FASTER", {"cpu": True})
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not P.int_mm_is_exact(torch.device("cpu"))
    m = W8A8Linear.from_float(_linear(64, 32, False), None)
    assert "int_mm" not in m.paths(torch.bfloat16) and m.static_path(64, torch.bfloat16) == "fp32"
    xq = torch.full((32, 64), 127, dtype=torch.int8)
    assert torch.equal(P.int8_product(xq, xq), torch.full((32, 32), 64.0 * 127 * 127))
    monkeypatch.setattr(P, "_INT_MM_EXACT", {})
    monkeypatch.setattr(torch, "_int_mm", real)
    assert P.int_mm_is_exact(torch.device("cpu")) == torch.equal(
        real(xq, xq.t()), torch.full((32, 32), 64 * 127 * 127, dtype=torch.int32))


@pytest.mark.skipif("avx512f" not in native.cpu_flags().split(), reason="the CPU has no AVX-512 to cap")
def test_kernels_built_under_an_avx2_cap_leave_out_avx512():
    code = "from quant.runtime.kernels import native; print(native.isa_cap())"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    capped = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True)
    assert capped.stdout.strip() == "('-mno-avx512f',)"
    env.pop("ATEN_CPU_CAPABILITY")
    plain = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           check=True)
    assert plain.stdout.strip() == "()"


@pytest.mark.parametrize("path", ["rows", "rows16", "gemm"])
def test_a_native_path_counts_its_staging_in_the_projection_transients(path):
    """The rows, rows16 and gemm ops stage x and their tiles in C++ vectors the allocator tracker cannot see; the
    engine's transients add them."""
    from quant.runtime.kernel_choice import ROW_BUCKETS, RowPlan
    from quant.runtime.kernels import gemm
    from server.layers.linear import Projections

    m = gptq_linear(192, 128, False, False)
    if path not in m.paths(torch.bfloat16):
        pytest.skip(f"no {path} path on this CPU")
    staging = {"rows": rows.staging_bytes, "rows16": rows.staging_bytes, "gemm": gemm.staging_bytes}[path]

    class Fixed:  # a chooser whose plan is the path at every row count
        chosen: dict = {}

        def plan(self, key, paths, k, dtype, device, max_rows=None):
            self.chosen[key] = RowPlan((path,) * len(ROW_BUCKETS), {})
            return self.chosen[key]

    proj = Projections(torch.bfloat16, Fixed())
    proj.bind("gate_up", [m])
    assert proj.transients(16)["gate_up"] >= staging(16, 128) >= 4 * 16 * 128
