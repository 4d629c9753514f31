"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): experts as per-expert Linears compute what transformers'
fused experts compute; every scheme quantizes them (nothing of the experts left in float), the artifact
names them as the checkpoint does, loads through quant.load and evaluates; routers stay float; an expert
the calibration set does not reach falls back, and the manifest says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from quant.errors import UnsupportedModelError
from quant.runtime import moe

pytestmark = pytest.mark.reference

CALIB = ("--calib-samples", "8", "--calib-seqlen", "64")
EVAL = ("--eval-windows", "2", "--eval-seqlen", "64")

ARCHS = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                     "shared_expert_intermediate_size": 256, "intermediate_size": 256}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                     "intermediate_size": 256}),
}


def _config(name: str, tokenizer, **over):
    import transformers

    cls, kw = ARCHS[name]
    return getattr(transformers, cls)(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.08,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **{**kw, **over})


def _model(name: str, tokenizer, **over):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(name, tokenizer, **over), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    out = {}
    for name in ("mixtral", "qwen2_moe"):
        d = tmp_path_factory.mktemp(name)
        _model(name, tokenizer).save_pretrained(d)
        tokenizer.save_pretrained(d)
        out[name] = d
    return out


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_unfused_experts_compute_the_fused_forward(name, tokenizer):
    model = _model(name, tokenizer)
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        assert moe.unfuse_experts(model) == 2
        got = model(ids).logits
    # gate and up as two matmuls instead of one: equal up to rounding
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    expert = model.model.layers[0].mlp.experts[3]
    names = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert [n for n, _ in expert.named_children() if n != "act_fn"] == list(names)


def test_unsupported_experts_are_refused_by_name(tokenizer):
    model = _model("mixtral", tokenizer)
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.experts .*transposed"):
        moe.unfuse_experts(model)


def test_names_map_mixtral_blocks_both_ways(tokenizer):
    names = moe.Names(_config("mixtral", tokenizer))
    assert names.to_checkpoint("model.layers.12.mlp.experts.3.w1.qweight") == \
        "model.layers.12.block_sparse_moe.experts.3.w1.qweight"
    assert names.to_model("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert names.to_model("model.embed_tokens.weight") == "model.embed_tokens.weight"
    qwen = moe.Names(_config("qwen2_moe", tokenizer))
    assert qwen.to_checkpoint("model.layers.0.mlp.experts.0.up_proj.weight") == "model.layers.0.mlp.experts.0.up_proj.weight"


def _stored(art: Path) -> dict[str, tuple[str, int]]:
    out = {}
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            n = 1
            for d in s.get_shape():
                n *= d
            out[k] = (s.get_dtype(), n * {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "I32": 4}[s.get_dtype()])
    return out


@pytest.mark.parametrize("scheme", ["int8-sym", "w8a8", "w4a16"])
def test_mixtral_experts_are_quantized_and_evaluate(scheme, moe_dirs, tmp_path, text_file):
    import quant

    art = tmp_path / "art"
    assert run_cli("build", "--scheme", scheme, "--model", moe_dirs["mixtral"], "--out", art, "--calib", text_file,
                   *CALIB, "--eval-data", text_file, *EVAL, "--no-progress") == 0
    stored = _stored(art)
    experts = {k: v for k, v in stored.items() if ".experts." in k}
    # The checkpoint's own names (vLLM and the GPTQ checkpoints of other tools use them).
    assert all(".block_sparse_moe.experts." in k for k in experts) and experts
    expert_weights = [k for k in experts if k.endswith((".weight", ".qweight"))]
    assert len(expert_weights) == 2 * 4 * 3
    float_bytes = sum(b for k, (dt, b) in experts.items() if k.endswith(".weight") and dt in ("F32", "BF16", "F16"))
    assert float_bytes <= 0.05 * sum(b for k, (_, b) in experts.items() if k in expert_weights)
    assert stored["model.layers.0.block_sparse_moe.gate.weight"][0] == "BF16"  # the router stays float
    manifest = json.loads((art / "quant_manifest.json").read_text())
    assert manifest["build"]["streamed"] is True
    assert manifest["quality"]["mean_kl"] < 0.5
    loaded = quant.load(art)
    assert isinstance(loaded.model.model.layers[0].mlp.experts, moe.ExpertLinears)
    assert run_cli("eval", art, "--data", text_file, "--windows", "2", "--seqlen", "64", "--no-progress") == 0


def test_qwen2_moe_shared_expert_quantized_and_gate_kept(moe_dirs, tmp_path, text_file):
    art = tmp_path / "art"
    assert run_cli("build", "--scheme", "w4a16", "--model", moe_dirs["qwen2_moe"], "--out", art, "--calib",
                   text_file, *CALIB, "--no-progress") == 0
    stored = _stored(art)
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in stored
    assert "model.layers.0.mlp.shared_expert.gate_proj.qweight" in stored
    assert stored["model.layers.0.mlp.shared_expert_gate.weight"][0] == "BF16"
    assert "model.layers.0.mlp.shared_expert_gate.qweight" not in stored


def test_an_expert_no_token_reaches_falls_back_and_is_named(tokenizer, tmp_path, text_file):
    """Five experts whose router always prefers one of (v, -v) and one of (u, -u) over the zero row of
    expert 4: no calibration token reaches expert 4, so GPTQ uses RTN and W8A8 a dynamic input scale there."""
    model = _model("mixtral", tokenizer, num_local_experts=5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            v, u = torch.randn(2, 128, generator=g) * 0.05  # small logits: no probability underflows to a tie with 0
            layer.mlp.gate.weight.copy_(torch.stack([v, -v, u, -u, torch.zeros(128)]))
    src = tmp_path / "src"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    for scheme in ("w4a16", "w8a8"):
        art = tmp_path / scheme
        assert run_cli("build", "--scheme", scheme, "--model", src, "--out", art, "--calib", text_file, *CALIB,
                       "--no-progress") == 0
        report = json.loads((art / "calibration_report.json").read_text())
        if scheme == "w4a16":
            fell = {f["module"] for f in report["fallbacks"]}
            assert fell == {f"model.layers.{li}.mlp.experts.4.{p}" for li in (0, 1) for p in ("w1", "w3", "w2")}
            assert all("0 calibration tokens" in f["reason"] for f in report["fallbacks"])
        else:
            dyn = {k for k, v in report["linears"].items() if "fallback" in v}
            assert dyn == {f"model.layers.{li}.mlp.experts.4.{p}" for li in (0, 1) for p in ("w1", "w3", "w2")}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_experts_are_calibrated_in_two_stages_not_one_pass_per_expert(name, tokenizer):
    """Every expert's gate/up read the block's input and its down their product: one layer pass captures all the
    gate/up inputs, one more all the downs', so a layer costs 5 passes whatever the expert count (it was 3E + 5)."""
    from quant.build.families import plan
    from quant.build.schemes.w4 import LayerQuantizer
    from quant.build.sequential import decoder_layers

    model = _model(name, tokenizer)
    moe.unfuse_experts(model)
    layer = decoder_layers(model)[0]
    lp = plan(model.config, layer)
    lay = moe.layout_of(model.config)
    assert lp.family is not None and not lp.staged and len(lp.stages) == 4
    assert {n.rpartition(".")[2] for n in lp.stages[2]} == {lay.gate, lay.up}
    assert {n.rpartition(".")[2] for n in lp.stages[3]} == {lay.down}
    assert sorted(n for st in lp.stages for n in st) == sorted(moe.quantizable_linears(layer))
    ids = torch.randint(100, 40000, (3, 32), generator=torch.Generator().manual_seed(0))
    lq = LayerQuantizer(model, ids, "gptq", 32, True, 0.01, True)
    calls = []
    handle = layer.register_forward_hook(lambda *_: calls.append(1))
    lq.quantize_layer(0, layer)
    handle.remove()
    assert len(calls) == 3 * (len(lp.stages) + 1)
    assert not moe.quantizable_linears(layer)
    assert all(info["fallback"] is None or "calibration tokens" in info["fallback"]
               for info in lq.report["linears"].values())
