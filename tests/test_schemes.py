"""The scheme registry: every registered scheme quantizes a layer into its runtime modules, whose specs
round-trip through an empty (meta) module, whose stored bytes are what the scheme predicts, and which fuse
(where the scheme says they can) into a module computing exactly the concatenation of the parts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quant.build import schemes
from quant.build.config import BuildConfig
from quant.errors import ConfigError
from quant.runtime.linear import QuantizedLinear
from quant.runtime.registry import module_from_spec
from server.fuse import fuse_linears

pytestmark = pytest.mark.unit

IN, OUTS = 128, (128, 64, 64)  # multiples of 64: every 4-bit part takes the int4 kernel, as fused


class _Layer(nn.Module):
    """A decoder-layer stand-in: three Linears reading one input, one with a bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, OUTS[0], bias=False)
        self.b = nn.Linear(IN, OUTS[1], bias=True)
        self.c = nn.Linear(IN, OUTS[2], bias=False)


def _quantized_layer(name: str) -> nn.Module:
    """`name`'s runtime modules for a random layer. Schemes that need no model run their own layer quantizer;
    the others get their runtime modules from the float Linears as their quantizers make them (W8A8 with a
    fixed input scale, 4-bit from RTN codes): no model or calibration set is needed."""
    from quant.build import gptq as G
    from quant.runtime.int4 import GPTQLinear

    torch.manual_seed(0)
    layer = _Layer()
    scheme = schemes.get(name)
    cls = scheme.runtime[0]
    for n in ("a", "b", "c"):
        lin = getattr(layer, n)
        if cls is GPTQLinear:
            setattr(layer, n, cls.from_quantized(G.rtn(lin.weight.data, 4, 64, True), lin.bias, v2=False))
        elif name == "w8a8":
            setattr(layer, n, cls.from_float(lin, input_scale=0.02))
    if cls not in (GPTQLinear,) and name != "w8a8":
        scheme.layer_quantizer(BuildConfig(scheme=name), None, None, {}).quantize_layer(0, layer)
    return layer


@pytest.mark.parametrize("name", schemes.names())
def test_runtime_modules_roundtrip_their_spec(name):
    layer = _quantized_layer(name)
    for n in ("a", "b", "c"):
        m = getattr(layer, n)
        assert isinstance(m, QuantizedLinear) and type(m) in schemes.get(name).runtime
        empty = module_from_spec(m.spec(), m.in_features, m.out_features, device="meta")
        empty.load_state_dict(m.state_dict(), assign=True, strict=True)
        empty.prepare(torch.bfloat16)
        m.prepare(torch.bfloat16)
        x = torch.randn(3, IN, dtype=torch.bfloat16)
        assert torch.equal(empty(x), m(x))


@pytest.mark.parametrize("name", schemes.names())
def test_predicted_bytes_are_the_stored_bytes(name):
    layer = _quantized_layer(name)
    scheme = schemes.get(name)
    for n in ("a", "c"):  # no bias: every tensor is the scheme's
        m = getattr(layer, n)
        stored = {k: t.numel() * t.element_size() for k, t in m.state_dict().items()}
        data = sum(v for k, v in stored.items() if k in m.DATA_TENSORS)
        params = sum(v for k, v in stored.items() if k in m.PARAM_TENSORS)
        assert data + params == sum(stored.values()), f"{name}: a tensor of no class: {sorted(stored)}"
        assert scheme.linear_bytes(m.out_features, m.in_features, 64) == (data, params)


@pytest.mark.parametrize("layout_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", schemes.names())
def test_fused_module_is_the_concatenation(name, layout_dtype):
    layer = _quantized_layer(name)
    parts = [layer.a, layer.b, layer.c]
    for m in parts:
        m.prepare(layout_dtype)  # int4: the kernel's layout (bf16) or the stored GPTQ tensors (fp32)
    x = torch.randn(5, IN, dtype=torch.bfloat16)
    expect = torch.cat([m(x) for m in parts], dim=-1)
    fused = fuse_linears(parts)
    if name == "w8a8":
        assert fused is None  # one static input scale per Linear: not fusable
        return
    assert fused is not None and type(fused) is type(parts[0])
    assert torch.equal(fused(x), expect)
    # The parts still compute their own rows, holding nothing beside the fused module's tensors (views of them,
    # or, int4 in the kernel's layout, nothing: they compute through the fused module).
    fused_storage = {t.untyped_storage().data_ptr() for t in fused.buffers()}
    for m, (a, b) in zip(parts, [(0, 128), (128, 192), (192, 256)]):
        torch.testing.assert_close(m(x), expect[:, a:b], rtol=2e-2, atol=2e-2)
        own = [n for n, t in m.named_buffers() if t is not None and t.dim() > 1
               and t.untyped_storage().data_ptr() not in fused_storage]
        assert not own, f"{name}: a part still holds {own}"


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ConfigError, match="'int3'.*int8-sym, int8-affine, w8a8, w4a16, rtn-w4"):
        schemes.validated(BuildConfig(scheme="int3"))


def test_every_scheme_predicts_build_memory_and_weights():
    from quant.build.memory import build_peak_bytes, weight_bytes
    from quant.shape.model import KNOWN_SHAPES

    shape = next(iter(KNOWN_SHAPES.values()))
    float_total = weight_bytes(shape, "float")["total"]
    for name in schemes.names():
        w = weight_bytes(shape, name, include_lm_head=schemes.get(name).supports_lm_head)
        assert 0 < w["total"] < float_total
        peak = build_peak_bytes(shape, name, 4096)
        assert peak["total"] == peak["part"] + peak["activations"] + peak["solver"] > 0
        assert (peak["activations"] > 0) == schemes.get(name).needs_calibration
    # bf16 calibration products keep a bf16 cast of a layer's Linear weights through its pass (7B: a layer
    # outweighs the embedding, so the part is the layer)
    big = KNOWN_SHAPES["7B"]
    lin = sum(n * k for _, n, k in big.linears())
    fp32, bf16 = (build_peak_bytes(big, "w4a16", 4096, matmul_bytes=b) for b in (4, 2))
    assert fp32["part"] == (lin + 2 * big.hidden) * 4 and bf16["part"] == fp32["part"] + 2 * lin
