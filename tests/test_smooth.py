"""Smoothing is an exact re-parametrisation: folding scales must not change the float layer."""

from __future__ import annotations

import pytest
import torch

from quant.build import smooth
from quant.build.families import plan
from quant.build.sequential import capture_layer_inputs, decoder_layers, run_layer

pytestmark = pytest.mark.reference


def _tiny(tokenizer, tmp_path, **kw):
    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama(tmp_path / "m", tokenizer, **kw)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # MQA, GQA, MHA
def test_folded_smoothing_preserves_layer_output(tokenizer, tmp_path, kv_heads):
    model = _tiny(tokenizer, tmp_path, num_key_value_heads=kv_heads)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden, kws = capture_layer_inputs(model, ids)
    kw = kws[0]
    layer = decoder_layers(model)[0]
    before = run_layer(layer, hidden, kw)
    groups = smooth.layer_groups(layer, plan(model.config, layer))
    assert [g.producer for g in groups] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"]
    g = torch.Generator().manual_seed(1)
    for grp in groups:
        k = layer.get_submodule(grp.linears[0]).in_features
        act = torch.rand(k, generator=g) * 10 + 0.1
        s, fold = smooth.compute_scales(layer, grp, act, 0.7, model.config)
        assert fold
        smooth.apply(layer, grp, s, fold, model.config)
    after = run_layer(layer, hidden, kw)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4)


def test_gqa_tie_index_maps_query_heads_to_their_kv_head():
    class C:
        num_attention_heads, num_key_value_heads, head_dim = 4, 2, 3

    tie = smooth.gqa_tie_index(C, 12, 6)
    assert tie.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert smooth.gqa_tie_index(C, 12, 7) is None  # shapes that do not follow the head layout


def test_unknown_layer_shape_gets_explicit_groups():
    layer = torch.nn.Sequential()
    layer.add_module("b", torch.nn.Linear(4, 4))
    layer.add_module("a", torch.nn.Linear(4, 4))

    class C:
        model_type = "llama"  # a known family, but not its Linears

    groups = smooth.layer_groups(layer, plan(C, layer, order=lambda: ("a", "b")))
    assert [g.linears for g in groups] == [("a",), ("b",)]  # execution order
    assert [g.producer_kind for g in groups] == ["none", "none"]
    s, fold = smooth.compute_scales(layer, groups[0], torch.ones(4) * 5, 0.5, None)
    assert not fold and s.shape == (4,)
