"""Reference equivalence: every runtime module's fast path against its plain dequantize-then-matmul
reference, on every dispatch branch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quant.runtime import hadamard
from quant.runtime import primitives as P
from quant.runtime.int8 import INT8PACK_MAX_ROWS, Int8WeightLinear
from quant.runtime.kernels import rows as rowops
from quant.runtime.registry import module_from_spec
from quant.runtime.w8a8 import W8A8Linear

pytestmark = pytest.mark.reference


def _linear(k=128, n=96, bias=True, seed=0, shift=0.0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.add_(shift)
    return lin


def _x(m, k=128, dtype=torch.float32, seed=1):
    return torch.randn(2, m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 3), (torch.bfloat16, 64), (torch.float32, 3)])
def test_int8_weight_fast_path_matches_reference(affine, dtype, rows):
    m = Int8WeightLinear.from_float(_linear(shift=0.05 if affine else 0.0), affine)
    x = _x(rows, dtype=dtype)
    fast = m(x).float()
    ref = m.reference_forward(x)
    assert fast.shape == (2, rows, 96)
    # bf16 output rounding bounds the difference; fp32 paths agree to float accuracy.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((fast - ref).abs().max() / ref.abs().max()) < tol


def test_int8pack_branch_is_taken_for_short_bf16_inputs(monkeypatch):
    m = Int8WeightLinear.from_float(_linear(), affine=True)
    calls = []
    real = torch.ops.aten._weight_int8pack_mm

    class Spy:
        def __call__(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", Spy())
    m(_x(2, dtype=torch.bfloat16))
    m(_x(INT8PACK_MAX_ROWS + 1, dtype=torch.bfloat16))
    assert calls == [(4, 128)]  # only the short input went through the int8 kernel


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_int_mm_matches_fake_quant_reference(dynamic, smooth, dtype):
    lin = _linear(bias=True)
    x = _x(17, dtype=dtype)
    s = torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5 if smooth else None
    scale = None if dynamic else float(x.float().abs().amax()) / 127 * 0.8  # some saturation
    m = W8A8Linear.from_float(lin, scale, s)
    fast = m(x).float()
    ref = m.reference_forward(x)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((fast - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_rotated_input_every_path_matches_reference(dynamic, dtype):
    """A rotated module (weight stored as W H^T, input rotated after the explicit smoothing) on each of its paths,
    the C++ one-pass kernel included, against its float64 reference; the one-pass kernel and the integer product
    quantize the same rotated values, so they agree bit for bit (decode and prefill round alike)."""
    lin = _linear(bias=True)
    x = _x(5, dtype=dtype).reshape(-1, 128)  # (10, 128)
    s = torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5
    scale = None if dynamic else float(x.float().abs().amax()) / 127 * 0.5
    m = W8A8Linear.from_float(lin, scale, s, rotate=64)
    m.prepare(dtype)
    ref = m.reference_forward(x.double()).float()  # (10, 96)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    paths = m.paths(dtype)
    assert "rows" in paths or not rowops.available(m.weight)
    for name, path in paths.items():
        y = path(x.contiguous()).float()
        assert float((y - ref).abs().max() / ref.abs().max()) < tol, name
    if dtype == torch.float32 and "rows" in paths:
        exact = "int_mm" if "int_mm" in paths else "fp32"
        assert torch.equal(paths["rows"](x.contiguous()), paths[exact](x.contiguous()))


def test_w8a8_rotation_spreads_an_outlier_channel():
    """What the rotation is for: one input channel 50x the others costs a per-tensor static scale most of the
    other channels' resolution; rotated (the same function, y = (W H^T)(H x)), the grid fits the spread input."""
    lin = _linear(bias=False)
    x = _x(32).reshape(-1, 128)  # (64, 128)
    x[:, 7] *= 50.0
    y = lin(x).detach()  # (64, 96)
    plain = W8A8Linear.from_float(lin, float(x.abs().amax()) / 127)
    rot = nn.Linear(128, 96, bias=False)
    rot.weight.data = hadamard.rotate(lin.weight.data, 128)
    rotated = W8A8Linear.from_float(rot, float(hadamard.rotate(x, 128).abs().amax()) / 127, rotate=128)
    err = {n: float((m(x) - y).norm() / y.norm()) for n, m in (("plain", plain), ("rotated", rotated))}
    assert err["rotated"] < err["plain"] / 4, err


@pytest.mark.parametrize("bad", [3, 256, "64", True, 0.5, None])
def test_w8a8_rotation_block_that_cannot_tile_is_refused(bad):
    spec = {"type": "w8a8", "dynamic": True, "smooth": False, "bias": False, "rotate": bad}
    with pytest.raises(ValueError, match="rotate must be a power of two"):
        module_from_spec(spec, 128, 96)


@pytest.mark.parametrize("dynamic,smooth", [(True, False), (False, True)])
def test_w8a8_in_float64_is_the_exact_integer_product(dynamic, smooth):
    """A float64 input takes the reference path in float64 (what `quant eval` computes on every CPU): the int8
    activations it forms are the fp64 rounding of x / scale, and its output is their exact integer product with
    the weight (summed in int64 here), rescaled, to float64 accuracy; the fp32 path's rounding of the same x
    agrees everywhere but at ties."""
    lin = _linear(bias=True)
    x = _x(17, dtype=torch.float64)  # (2, 17, 128)
    s = torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5 if smooth else None
    scale = None if dynamic else float(x.abs().amax()) / 127 * 0.8
    m = W8A8Linear.from_float(lin, scale, s)
    y = m(x)
    assert y.dtype == torch.float64 and y.shape == (2, 17, 96)
    x2 = x.reshape(-1, 128) / (s.double() if smooth else 1.0)  # (34, 128)
    if dynamic:
        xs = x2.abs().amax(-1, keepdim=True) / 127  # (34, 1)
    else:
        xs = torch.tensor(float(m.input_scale), dtype=torch.float64)
    xq = torch.round(x2 / xs).clamp(-127, 127).long()  # (34, 128)
    exact = (xq @ m.weight.long().t()).double() * xs * m.weight_scale.double() + m.bias.double()  # (34, 96)
    torch.testing.assert_close(y.reshape(-1, 96), exact, rtol=1e-12, atol=1e-12)
    assert float((m(x.float()).double().reshape(-1, 96) - exact).abs().max() / exact.abs().max()) < 1e-5


@pytest.mark.parametrize("affine", [False, True])
def test_int8_weight_in_float64_uses_the_exact_weight(affine):
    m = Int8WeightLinear.from_float(_linear(shift=0.05 if affine else 0.0), affine)
    x = _x(5, dtype=torch.float64)
    z = m.weight_zero_point.double()[:, None] if affine else 0.0
    w = (m.weight.double() - z) * m.weight_scale.double()[:, None]  # (96, 128) exact
    torch.testing.assert_close(m(x), x @ w.t() + m.bias.double(), rtol=1e-12, atol=1e-12)


def test_w8a8_is_close_to_float_when_unclipped():
    lin = _linear(bias=False)
    x = _x(32)
    m = W8A8Linear.from_float(lin, float(x.abs().amax()) / 127)
    y = lin(x)
    assert float((m(x) - y).norm() / y.norm()) < 0.02


@pytest.mark.parametrize("factory", [
    lambda lin: Int8WeightLinear.from_float(lin, False),
    lambda lin: Int8WeightLinear.from_float(lin, True),
    lambda lin: W8A8Linear.from_float(lin, 0.01),
    lambda lin: W8A8Linear.from_float(lin, None, torch.ones(128) * 2),
])
def test_spec_roundtrip_through_meta_and_assign(factory):
    m = factory(_linear())
    empty = module_from_spec(m.spec(), 128, 96, device="meta")
    empty.load_state_dict(m.state_dict(), assign=True, strict=True)
    x = _x(5)
    assert torch.equal(empty(x), m(x))


def test_unknown_spec_is_refused():
    with pytest.raises(ValueError, match="unknown quantized module type"):
        module_from_spec({"type": "int3"}, 4, 4)


def test_dequantized_weight_matches_primitives():
    lin = _linear()
    m = Int8WeightLinear.from_float(lin, False)
    assert torch.equal(m.dequantized(torch.float32), P.fake_quant_weight(lin.weight))


@pytest.mark.parametrize("factory", [lambda lin: Int8WeightLinear.from_float(lin, False),
                                     lambda lin: W8A8Linear.from_float(lin, 0.05)])
def test_prepare_realigns_a_misaligned_memory_mapped_weight(factory):
    """A file written by another tool may place an int8 weight 8 bytes off a 64-byte boundary, where the
    CPU int8 GEMM faults: after loading, `prepare` gives the module an aligned copy with the same values."""
    torch.manual_seed(0)
    m = factory(nn.Linear(64, 32))
    buf = torch.empty(m.weight.numel() + 128, dtype=torch.int8)
    off = (-buf.data_ptr()) % 64 + 8  # 8 bytes past an aligned address
    m.weight = buf[off : off + m.weight.numel()].view(32, 64).copy_(m.weight)
    before = m.weight.clone()
    assert m.weight.data_ptr() % 64 == 8
    m.prepare()
    assert m.weight.data_ptr() % 64 == 0 and torch.equal(m.weight, before)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(m(x).float(), m.reference_forward(x).float(), atol=0.05, rtol=0.05)
