"""The one-pass C++ dequantizers (quant/runtime/kernels/csrc/dequant_ops.cpp) against their PyTorch references, bit for bit."""

from __future__ import annotations

import pytest
import torch

from quant.runtime import primitives as P
from quant.runtime.kernels import dequant
from quant.runtime.kernels.int4_layout import cpu_layout, pack_for_kernel

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(not dequant.load(), reason=f"dequant ops not built: {dequant.unavailable_reason()}")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (960, 576), (70, 1536)])  # odd sizes, and rows split across threads
def test_int8_equals_reference(dtype, affine, shape):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g) * 0.1
    q, s, *z = P.quantize_weight_affine(w) if affine else P.quantize_weight_sym(w)
    zero = z[0] if affine else None
    assert torch.equal(dequant.int8(q, s, zero, dtype), P.dequantize_weight(q, s, zero, dtype))


def test_int8_bf16_rounding_matches_torch_at_ties_and_specials():
    """bf16 is rounded by hand in the kernel (branch-free): ties to even, infinities and NaN as torch rounds."""
    q = torch.tensor([[1, -1, 127, -128, 3, 0]], dtype=torch.int8)
    for scale in (1.0 + 2**-8, 1.0 + 3 * 2**-8, 3e38, float("inf"), float("nan")):  # ties, overflow, specials
        s = torch.tensor([scale])
        got, want = dequant.int8(q, s, None, torch.bfloat16), P.dequantize_weight(q, s, None, torch.bfloat16)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), (scale, got, want)  # NaN where torch has NaN (any payload)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), (scale, got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [192, 64 * 3 + 32 + 16])  # whole blocks; a partial last block (interleaved)
@pytest.mark.parametrize("permuted", [False, True])  # act-order checkpoints permute the columns
def test_int4pack_equals_reference(dtype, n, permuted):
    layout = cpu_layout()
    if layout is None:
        pytest.skip("this CPU's int4pack layout is not one we read")
    k, gs = 256, 64
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    packed = pack_for_kernel(codes)
    sz = torch.randn(k // gs, n, 2, generator=g).to(torch.bfloat16)  # (G, N, 2) scale, zero
    perm = torch.randperm(k, generator=g) if permuted else None
    got = dequant.int4pack(packed, n, k, layout, sz, gs, perm, dtype)
    want = dequant.int4pack_reference(packed, n, k, layout, sz, gs, perm, dtype)
    assert torch.equal(got, want)


def test_bad_inputs_are_refused_with_the_argument_named():
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.quantserve_quant.dequant_int8(q, torch.ones(3), q.new_empty(0), torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.quantserve_quant.dequant_int8(q, torch.ones(4), q.new_empty(0), torch.empty(4, 7))
    with pytest.raises(RuntimeError, match="zero must be"):
        torch.ops.quantserve_quant.dequant_int8(q, torch.ones(4), torch.zeros(3, dtype=torch.int8), torch.empty(4, 8))
    packed, sz = torch.zeros(16 * 64 // 2, dtype=torch.uint8), torch.zeros(1, 16, 2)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.quantserve_quant.dequant_int4pack(packed[1:], 16, 64, 32, False, sz, 64,
                                                    torch.zeros(0, dtype=torch.long), torch.empty(64, 16))
    with pytest.raises(RuntimeError, match="perm\\[0\\] is outside K"):
        torch.ops.quantserve_quant.dequant_int4pack(packed, 16, 64, 32, False, sz, 64, torch.full((64,), 99),
                                                    torch.empty(64, 16))
    with pytest.raises(RuntimeError, match="multiple of group_size"):
        torch.ops.quantserve_quant.dequant_int4pack(packed, 16, 64, 32, False, sz, 48, torch.zeros(0, dtype=torch.long),
                                                    torch.empty(64, 16))
