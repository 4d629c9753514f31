"""LoRA merging must give bit-for-bit what PEFT's own `merge_and_unload()` gives, or refuse clearly.

Adapters are made by PEFT itself on the tiny Llama (lora_A / lora_B randomised, since PEFT starts B at
zero), saved with `save_pretrained`, then merged twice into fresh base models: by PEFT
(`PeftModel.from_pretrained(...).merge_and_unload()`) and by `quant.build.lora.merge_adapter`. Both compute
the delta as (B @ A) * scaling in fp32 and add it to W rounding once to W's dtype, so every parameter
is compared with torch.equal, not a tolerance.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from conftest import make_adapter
from helpers import hf_causal_lm, peft_merged

from quant.build.lora import AdapterInfo, LoraError, merge_adapter, read_adapter

# peft (~6 s to import) only where a test builds or merges an adapter through it, not at collection
pytestmark = [pytest.mark.reference, pytest.mark.skipif(find_spec("peft") is None, reason="peft is not installed")]


def _edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _check_same_as_peft(model_dir, adapter_dir, dtype=torch.float32, also_changed=()) -> AdapterInfo:
    want = peft_merged(model_dir, adapter_dir, dtype)
    base = hf_causal_lm(model_dir, dtype)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    info = merge_adapter(base, adapter_dir)
    got = base.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == dtype, k
        assert torch.equal(got[k], want[k]), k
    changed = {k.removesuffix(".weight") for k in got if not torch.equal(got[k], before[k])}
    assert changed == set(info.modules) | set(also_changed)  # every merged module moved, nothing else did
    return info


LAYER = "model.layers.{}.{}"


def _names(layers, projs):
    kinds = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return sorted(LAYER.format(i, f"{kinds.get(p, 'mlp')}.{p}") for i in layers for p in projs)


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = {
    "plain": (dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8), _names([0, 1], ["q_proj", "v_proj"])),
    "rslora": (
        dict(target_modules=["q_proj", "v_proj", "down_proj"], r=8, lora_alpha=5, use_rslora=True),
        _names([0, 1], ["q_proj", "v_proj", "down_proj"]),
    ),
    "patterns": (
        dict(
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            r=4,
            lora_alpha=8,
            rank_pattern={"k_proj": 2, r"model\.layers\.1\.self_attn\.q_proj": 6},
            alpha_pattern={".*v_proj": 3, "layers.0.self_attn.o_proj": 32},
        ),
        _names([0, 1], ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ),
    "all_linear": (dict(target_modules="all-linear", r=2, lora_alpha=4), _names([0, 1], ALL)),
    "regex": (dict(target_modules=r".*layers\.0\..*(q|up)_proj", r=4, lora_alpha=16), _names([0], ["q_proj", "up_proj"])),
    "layers_to_transform": (
        dict(target_modules=["q_proj", "o_proj", "gate_proj"], layers_to_transform=[1], r=4, lora_alpha=8),
        _names([1], ["q_proj", "o_proj", "gate_proj"]),
    ),
    "layers_pattern_exclude": (
        dict(
            target_modules=["k_proj", "up_proj", "down_proj"],
            layers_to_transform=0,
            layers_pattern="layers",
            exclude_modules=["down_proj"],
            r=3,
            lora_alpha=6,
        ),
        _names([0], ["k_proj", "up_proj"]),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_merge_and_unload(tiny_model_dir, tmp_path, case):
    kwargs, modules = CASES[case]
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", **kwargs)
    info = _check_same_as_peft(tiny_model_dir, adapter)
    assert list(info.modules) == modules
    assert info.r == kwargs["r"] and info.lora_alpha == kwargs["lora_alpha"]
    assert info.use_rslora == kwargs.get("use_rslora", False)
    assert json.loads(json.dumps(info.to_dict()))["modules"] == modules


def test_literal_all_linear_and_fan_in_fan_out_config(tiny_model_dir, tmp_path):
    # PEFT saves "all-linear" expanded to full names; a hand-written config may keep the shorthand (which
    # skips lm_head). fan_in_fan_out=true is ignored for nn.Linear by PEFT (q_proj is square, so a wrong
    # transpose would still fit the shape and only exact comparison catches it).
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", target_modules="all-linear", r=2, lora_alpha=4)
    _edit_config(adapter, target_modules="all-linear", fan_in_fan_out=True)
    info = _check_same_as_peft(tiny_model_dir, adapter)
    assert list(info.modules) == _names([0, 1], ALL)


def test_bf16_base_rounds_once(tiny_model_dir, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", dtype=torch.bfloat16, target_modules=["q_proj", "down_proj"])
    _check_same_as_peft(tiny_model_dir, adapter, dtype=torch.bfloat16)


def test_conv1d_gpt2_is_transposed(tmp_path):
    # transformers' Conv1D stores W as (in, out): PEFT forces fan_in_fan_out=True there.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    adapter = make_adapter(tmp_path / "gpt2", tmp_path / "a", target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    info = _check_same_as_peft(tmp_path / "gpt2", adapter)
    assert len(info.modules) == 6 and "transformer.h.1.attn.c_attn" in info.modules


def test_tied_lm_head_like_peft(tiny_model_dir, tmp_path):
    # PEFT saves lm_head's base weight with the adapter; the tied embedding moves with lm_head, as in PEFT.
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(tiny_model_dir, tmp_path / "a", target_modules=["lm_head", "q_proj"], r=2)
    info = _check_same_as_peft(tiny_model_dir, adapter, also_changed=["model.embed_tokens"])
    assert "lm_head" in info.modules
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.base_layer.weight"][0, 0] += 1.0  # a retrained head: refused
    save_file(tensors, path)
    _refused(tiny_model_dir, adapter, "'lm_head'", "full base weight")


def test_read_adapter_and_fingerprint(tiny_model_dir, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", target_modules=["q_proj"], r=2)
    config, tensors = read_adapter(adapter)
    assert config["peft_type"] == "LORA" and config["r"] == 2
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    info = merge_adapter(hf_causal_lm(tiny_model_dir), adapter)
    assert info.base_model == str(tiny_model_dir) and len(info.fingerprint) == 64
    _edit_config(adapter, lora_alpha=9)
    assert merge_adapter(hf_causal_lm(tiny_model_dir), adapter).fingerprint != info.fingerprint


# ---- refusals ---------------------------------------------------------------------------------------


@pytest.fixture()
def adapter(tiny_model_dir, tmp_path) -> Path:
    return make_adapter(tiny_model_dir, tmp_path / "a", target_modules=["q_proj", "v_proj"], r=4)


def _refused(model_dir, adapter_dir, *needles) -> str:
    base = hf_causal_lm(model_dir)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(LoraError) as exc:
        merge_adapter(base, adapter_dir)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())  # nothing half-merged
    return msg


def test_dora_refused(tiny_model_dir, tmp_path):
    a = make_adapter(tiny_model_dir, tmp_path / "a", target_modules=["q_proj"], use_dora=True)
    _refused(tiny_model_dir, a, "DoRA")


def test_missing_files_refused(tiny_model_dir, adapter, tmp_path):
    _refused(tiny_model_dir, tmp_path / "nowhere", "does not exist")
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    (adapter / "adapter_model.safetensors").unlink()
    _refused(tiny_model_dir, adapter, "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").write_bytes(weights[:100])
    _refused(tiny_model_dir, adapter, "adapter_model.safetensors", "not a valid safetensors")
    (adapter / "adapter_config.json").unlink()
    _refused(tiny_model_dir, adapter, "adapter_config.json")


def test_module_not_in_base_refused(tiny_model_dir, adapter):
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in load_file(path).items()}
    save_file(tensors, path)
    _refused(tiny_model_dir, adapter, "model.layers.7.self_attn.q_proj", "not in the base model")


def test_config_and_tensors_disagree_refused(tiny_model_dir, adapter):
    _edit_config(adapter, target_modules=["q_proj"])  # tensors still hold v_proj
    _refused(tiny_model_dir, adapter, "model.layers.0.self_attn.v_proj", "does not target")
    _edit_config(adapter, target_modules=["q_proj", "v_proj", "k_proj"])
    _refused(tiny_model_dir, adapter, "model.layers.0.self_attn.k_proj", "without lora_A/lora_B")


def test_shape_mismatch_refused(tokenizer, tiny_model_dir, tmp_path):
    from conftest import make_adapter, make_tiny_llama

    other = make_tiny_llama(tmp_path / "wide", tokenizer, hidden_size=32, intermediate_size=64)
    a = make_adapter(other, tmp_path / "a", target_modules=["q_proj"], r=4)
    _refused(tiny_model_dir, a, "model.layers.0.self_attn.q_proj", "(64, 64)", "(32, 32)")


def test_unsupported_kinds_refused(tiny_model_dir, tmp_path, adapter):
    a = make_adapter(tiny_model_dir, tmp_path / "bias", target_modules=["q_proj"], bias="all")
    _refused(tiny_model_dir, a, "bias='all'")
    a = make_adapter(tiny_model_dir, tmp_path / "emb", target_modules=["embed_tokens"])
    _refused(tiny_model_dir, a, "embedding LoRA not supported")
    a = make_adapter(tiny_model_dir, tmp_path / "mts", target_modules=["q_proj"], modules_to_save=["lm_head"])
    _refused(tiny_model_dir, a, "modules_to_save", "lm_head")
    _edit_config(adapter, peft_type="LOHA")
    _refused(tiny_model_dir, adapter, "LOHA")
    _edit_config(adapter, peft_type="LORA", rank_pattern={"q_proj": 2})  # tensors were saved with r=4
    _refused(tiny_model_dir, adapter, "model.layers.0.self_attn.q_proj", "r=2")


def test_pickled_adapter_refused_without_unpickling(tiny_model_dir, tmp_path, monkeypatch):
    a = make_adapter(tiny_model_dir, tmp_path / "a", safe=False, target_modules=["q_proj"])
    assert (a / "adapter_model.bin").is_file() and not (a / "adapter_model.safetensors").exists()

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    msg = _refused(tiny_model_dir, a, "adapter_model.bin", "only safetensors adapters are loaded")
    assert "nothing is unpickled" in msg
