"""Pure unit tests of the quantization arithmetic."""

from __future__ import annotations

import pytest
import torch

from quant.runtime import primitives as P

pytestmark = pytest.mark.unit


def _w(n=64, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_sym_roundtrip_error_is_half_a_step():
    w = _w()
    q, s = P.quantize_weight_sym(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    assert torch.equal(q.abs().amax(1), torch.full((64,), 127, dtype=torch.int8))  # absmax maps to 127
    err = (P.dequantize_weight(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())


def test_affine_roundtrip_and_zero_is_exact():
    w = _w() + 0.7  # skewed rows: the affine grid is worth it here
    w[:, 0] = 0.0
    q, s, z = P.quantize_weight_affine(w)
    assert q.dtype == torch.int8 and z.dtype == torch.int8
    deq = P.dequantize_weight(q, s, z)
    assert bool(((deq - w).abs() <= s[:, None] / 2 + 1e-6).all())
    assert torch.equal(deq[:, 0], torch.zeros(64))  # 0.0 is on the grid
    # The affine grid is finer than the symmetric one on skewed rows.
    _, s_sym = P.quantize_weight_sym(w)
    assert bool((s < s_sym).all())


def test_all_zero_channel_quantizes_to_zero():
    w = _w()
    w[3] = 0
    q, s = P.quantize_weight_sym(w)
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8)) and float(s[3]) > 0
    q, s, z = P.quantize_weight_affine(w)
    assert torch.equal(P.dequantize_weight(q, s, z)[3], torch.zeros(96))


def test_static_activation_quant_saturates_beyond_threshold():
    x = torch.tensor([[-10.0, -1.0, 0.0, 0.5, 1.0, 10.0]])
    q = P.quantize_act_static(x, 1.0 / 127)
    assert q.tolist() == [[-127, -127, 0, 64, 127, 127]]


def test_dynamic_activation_quant_is_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 50.0, -25.0]])
    q, s = P.quantize_act_dynamic(x)
    assert s.shape == (2, 1)
    assert q[:, 1].abs().tolist() == [127, 64] and q[1, 0] == 127
    assert torch.allclose(q.float() * s, x, rtol=0, atol=float(s.max()) / 2 + 1e-6)


def test_smooth_factors_balance_ranges():
    act = torch.tensor([100.0, 1.0, 0.0, 4.0])
    wmax = torch.tensor([0.01, 1.0, 1.0, 0.0])
    s = P.smooth_factors(act, wmax, 0.5)
    assert s[2] == 1 and s[3] == 1  # dead activation or dead weight column: left alone
    # alpha = 0.5: after smoothing, max|X|/s == max|W|*s on live channels.
    assert torch.allclose((act / s)[:2], (wmax * s)[:2], rtol=1e-5)
    assert torch.allclose(P.smooth_factors(act, wmax, 1.0)[:2], act[:2])


@pytest.mark.parametrize("flags,probed", [("fpu sse2 avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                          ("avx2 amx_bf16 amx_tile", True), ("fp asimd sve bf16", True)])
def test_a_cpu_without_a_bf16_dot_product_is_answered_without_the_probe(flags, probed, monkeypatch):
    """bf16 products are emulated, and slower than fp32, on a CPU with none of the bf16 dot-product flags: no
    products are timed there; where one is present the probe decides."""
    timed = []
    monkeypatch.setattr(P, "_BF16_FASTER", {})
    monkeypatch.setattr(P, "cpu_flags", lambda: flags)
    monkeypatch.setattr(P, "_seconds", lambda f, calls=3: timed.append(f) or (1.0 if len(timed) % 2 else 2.0))
    assert P.bf16_matmul_is_faster(torch.device("cpu")) is probed
    assert len(timed) == (2 if probed else 0)


def test_int16_block_activations_hold_a_16_bit_row_exactly_near_each_blocks_max():
    """quantize_act_blocks16: a power-of-two scale per block of 32, so q * d is exact; a bf16 element within 2^7 of
    its block's max magnitude comes back as it was, a smaller one within 2^-15 of that max; all-zero blocks stay
    zero, q never past 32767, and a row that is not finite stays not finite."""
    g = torch.Generator().manual_seed(0)
    narrow = (torch.rand(4, 64, generator=g) + 0.02).bfloat16() * torch.sign(torch.randn(4, 64, generator=g))
    assert torch.equal(P.quantize_act_blocks16(narrow), narrow.float())  # max / min < 2^7 in every block
    wide = (torch.randn(4, 64, generator=g) * torch.logspace(-6, 2, 64)).bfloat16()
    got = P.quantize_act_blocks16(wide)
    top = wide.float().abs().reshape(4, 2, 32).amax(-1, keepdim=True).expand(4, 2, 32).reshape(4, 64)
    assert bool(((got - wide.float()).abs() <= top * 2.0**-15).all())
    assert not torch.equal(got, wide.float())  # the smallest elements were rounded
    near = wide.float().abs() >= top * 2.0**-7
    assert torch.equal(got[near], wide.float()[near])
    edge = torch.zeros(2, 32)
    edge[1] = 2.0**40 * (1 - 2.0**-24)  # q = f 2^15 rounds to 32768 past the 16 bits: held at 32767
    out = P.quantize_act_blocks16(edge)
    assert torch.equal(out[0], edge[0]) and float(out[1, 0]) == 32767 * 2.0**25
    bad = torch.ones(2, 32)
    bad[0, 3] = float("inf")
    assert not bool(P.quantize_act_blocks16(bad)[0].isfinite().all()) and torch.equal(P.quantize_act_blocks16(bad)[1],
                                                                                         bad[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        P.quantize_act_blocks16(torch.randn(2, 40))
