"""The pipeline's walk over each family's decoder layers (quant.build.families), on every tiny architecture of
tests/archs.py: every layer calibrated with its own kwargs, smoothing folds that leave the float layer unchanged,
staged GPTQ equal to GPTQ through the exact layer forward, and layers the pipeline cannot quantize refused."""

from __future__ import annotations

import copy

import pytest
import torch
from archs import ARCHITECTURES
from transformers import AutoModelForCausalLM

from quant.build import gptq as G
from quant.build import smooth
from quant.build.families import FAMILIES
from quant.build.sequential import (
    capture_layer_inputs,
    decoder_layers,
    layer_plan,
    run_layer,
)

pytestmark = pytest.mark.reference

ARCHS = list(ARCHITECTURES)


def _model_type(arch: str) -> str:
    import transformers

    return getattr(transformers, ARCHITECTURES[arch][0]).model_type


def _model(arch_dirs, arch):
    return AutoModelForCausalLM.from_pretrained(arch_dirs(arch), dtype=torch.float32).eval()


def _ids(n: int = 2, t: int = 48) -> torch.Tensor:  # 48 tokens: past the tiny models' window of 32
    return torch.randint(100, 40000, (n, t), generator=torch.Generator().manual_seed(0))


def _last_layer_output(model, ids) -> torch.Tensor:
    out = []
    handle = decoder_layers(model)[-1].register_forward_hook(lambda _m, _a, o: out.append(o.detach().float()))
    try:
        with torch.no_grad():
            for s in range(ids.shape[0]):
                model(ids[s : s + 1])
    finally:
        handle.remove()
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_run_one_by_one_with_their_own_kwargs_equal_the_model(arch, arch_dirs):
    model = _model(arch_dirs, arch)
    ids = _ids()
    hidden, kws = capture_layer_inputs(model, ids)
    h = hidden
    for layer, kw in zip(decoder_layers(model), kws):
        h = run_layer(layer, h, kw)
    assert torch.allclose(h, _last_layer_output(model, ids), atol=1e-5)
    if model.config.to_dict().get("layer_types") and len(set(model.config.layer_types)) > 1:
        # Sliding and global layers get different masks (and Gemma 3 different rope): layer 0's kwargs for every
        # layer, as the pipeline once did, calibrate the global layer on the wrong attention.
        wrong = run_layer(decoder_layers(model)[1], run_layer(decoder_layers(model)[0], hidden, kws[0]), kws[0])
        assert not torch.allclose(wrong, h, atol=1e-3)


FOLDS = {  # what each family folds: q/k/v's norm, o into v, gate/up's norm, down into up
    "gemma": [False, True, False, True], "gemma2": [False, True, False, True], "gemma3": [False, True, False, True],
    "olmo2": [False, True, False, True], "phi3": [True, False, True, False],
    "phi3-partial-window": [True, False, True, False],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_smoothing_folds_leave_every_layer_unchanged(arch, arch_dirs):
    model = _model(arch_dirs, arch)
    ids = _ids()
    hidden, kws = capture_layer_inputs(model, ids)
    g = torch.Generator().manual_seed(1)
    for layer, kw in zip(decoder_layers(model), kws):
        before = run_layer(layer, hidden, kw)
        lp = layer_plan(model, layer, hidden, kw)
        assert lp.family is FAMILIES[model.config.model_type]
        groups = smooth.layer_groups(layer, lp)
        folds = []
        for grp in groups:
            k = layer.get_submodule(grp.linears[0]).in_features
            s, fold = smooth.compute_scales(layer, grp, torch.rand(k, generator=g) * 10 + 0.1, 0.7, model.config)
            folds.append(fold)
            if fold:  # an explicit scale divides the quantized module's input at run time, not the float layer
                smooth.apply(layer, grp, s, fold, model.config)
        assert folds == FOLDS.get(arch, [True] * 4)
        assert torch.allclose(run_layer(layer, hidden, kw), before, rtol=1e-4, atol=1e-4)
        hidden = before


def _gptq_into_weights(layer, record):
    from quant.build.gptq import Hessian

    def quantize_group(names, inputs):
        hess = Hessian(layer.get_submodule(names[0]).in_features)
        for x in inputs:
            hess.add(x)
        h = hess.value()
        for n in names:
            lin = layer.get_submodule(n)
            q = G.gptq(lin.weight.data, h, 4, 64, True, 0.01, True)
            lin.weight.data = q.dequantize()
            record[n] = q.codes

    return quantize_group


@pytest.mark.parametrize("matmul", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", [a for a in ARCHS if FAMILIES[_model_type(a)].staged])
def test_staged_gptq_equals_gptq_through_the_exact_layer(arch, arch_dirs, matmul):
    from quant.build.sequential import exact_pass, layer_pass, linear_products_in

    model = _model(arch_dirs, arch)
    hidden, kws = capture_layer_inputs(model, _ids(3, 24))
    layer = decoder_layers(model)[0]
    lp = layer_plan(model, layer, hidden, kws[0])
    assert lp.staged
    if arch == "granite":
        assert lp.residual_scale == 0.7  # both residual branches are scaled: a staged pass without it is wrong
    a, b = copy.deepcopy(layer), copy.deepcopy(layer)
    codes_a, codes_b = {}, {}
    out_a = layer_pass(a, hidden, kws[0], _gptq_into_weights(a, codes_a), lp, None, matmul)  # staged
    with torch.inference_mode(), linear_products_in(b, matmul):
        out_b = exact_pass(b, hidden, kws[0], _gptq_into_weights(b, codes_b), lp, smooth.layer_groups(b, lp))
    assert list(codes_a) == list(codes_b) == list(lp.family.linears)
    assert all("forward" not in m.__dict__ for m in a.modules() if type(m) is torch.nn.Linear)  # fp32 again
    # GPTQ's rounding can flip a code where two grid points tie to within float noise; bf16 products, rounded in
    # another order by the two passes, a few more.
    atol, flips = (1e-4, 1e-3) if matmul == torch.float32 else (2e-2, 0.02)
    assert out_a.dtype == torch.float32 and torch.allclose(out_a, out_b, atol=atol)
    if matmul == torch.float32:
        assert torch.allclose(out_a, run_layer(a, hidden, kws[0]), atol=atol)  # the staged output is the layer's
    for n in codes_a:
        assert (codes_a[n] != codes_b[n]).float().mean() < flips, n


def test_an_unknown_family_runs_every_linear_through_the_exact_forward(arch_dirs):
    model = _model(arch_dirs, "llama")
    model.config.model_type = "my-llama"
    hidden, kws = capture_layer_inputs(model, _ids(1, 16))
    layer = decoder_layers(model)[0]
    lp = layer_plan(model, layer, hidden, kws[0])
    assert lp.family is None and not lp.staged
    assert lp.order == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert [g.linears for g in smooth.layer_groups(layer, lp)] == [(n,) for n in lp.order]
    assert lp.stages == tuple((n,) for n in lp.order)


@pytest.mark.parametrize("arch", ARCHS)
def test_w8a8_sequential_calibration_is_what_its_int8_modules_compute(arch, arch_dirs):
    """The layer pass that calibrates W8A8 runs each finished group in float (dequantized weights, fake-quantized
    inputs, smoothing folded into already quantized v/up rows); the int8 modules swapped in afterwards compute
    the same layer output, and the pass is the staged one exactly where the family allows."""
    from quant.build.config import BuildConfig, CalibConfig
    from quant.build.schemes.w8a8 import LayerQuantizer
    from quant.runtime.moe import quantizable_linears
    from quant.runtime.w8a8 import W8A8Linear

    model = _model(arch_dirs, arch)
    cfg = BuildConfig(scheme="w8a8", calib=CalibConfig(samples=2, seqlen=48), search_tokens=64)
    lq = LayerQuantizer(model, _ids(), cfg)
    for li, layer in enumerate(decoder_layers(model)):
        h_in, kw = lq.hidden, lq.kws[li]
        lq.quantize_layer(li, layer)
        assert not quantizable_linears(layer)  # every Linear replaced
        assert all("forward" not in m.__dict__ for m in layer.modules())  # no simulated forward left behind
        assert sum(isinstance(m, W8A8Linear) for m in layer.modules()) == len(FAMILIES[model.config.model_type].linears)
        real = run_layer(layer, h_in, kw)
        rel = (real - lq.hidden).norm() / lq.hidden.norm()
        assert rel < 2e-3, rel  # rounding ties of activations that the int8 kernel's sums flip, nothing more
    folded = [g for g in lq.report["groups"].values() if g.get("folded")]
    assert len(folded) == 2 * FOLDS.get(arch, [True] * 4).count(True)


def test_int8_product_is_the_integer_product_on_either_path(monkeypatch):
    from quant.runtime import primitives as P

    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
    exact = (xq.long() @ wq.long().t()).float()
    for fast in (True, False):
        monkeypatch.setitem(P._INT_MM_FASTER, "cpu", fast)
        assert torch.equal(P.int8_product(xq, wq), exact)


def test_bf16_linear_products_change_only_the_products():
    from quant.build.sequential import linear_products_in

    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False))
    simulated = torch.nn.Linear(16, 8)
    mark = lambda x: x * 0 + 7.0  # noqa: E731 - a forward a scheme set (W8A8's simulation): left alone
    simulated.forward = mark
    layer.append(simulated)
    w0 = layer[0].weight.detach().clone()
    x = torch.randn(5, 64, generator=g)
    want = torch.nn.functional.linear(x.bfloat16(), w0.bfloat16(), layer[0].bias.bfloat16()).float()
    with torch.inference_mode(), linear_products_in(layer, torch.bfloat16):
        y = layer[0](x)
        assert y.dtype == torch.float32 and torch.equal(y, want)
        assert layer[0].weight.dtype == torch.float32 and torch.equal(layer[0].weight, w0)  # the quantizer's W
        layer[0].weight.mul_(2)  # a smoothing fold: in place
        b16 = layer[0].bias.bfloat16()
        assert torch.equal(layer[0](x), torch.nn.functional.linear(x.bfloat16(), (2 * w0).bfloat16(), b16).float())
        layer[0].weight.data = torch.zeros_like(w0)  # a quantized group's dequantized weight: replaced
        assert torch.equal(layer[0](x), b16.float().expand(5, 32))
        assert torch.equal(layer[2](torch.ones(1, 16)), torch.full((1, 16), 7.0))  # its own forward ran
    with torch.inference_mode():
        assert layer[0](x).dtype == torch.float32
        assert torch.equal(layer[0](x), torch.nn.functional.linear(x, layer[0].weight, layer[0].bias))  # fp32 again
        assert layer[2].forward is mark
        with linear_products_in(layer, torch.float32):  # fp32: nothing is wrapped
            assert "forward" not in layer[0].__dict__
