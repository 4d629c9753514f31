"""The memory model against the artifacts it describes and against measured activation peaks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from quant import load
from quant.build.memory import TrainSetup, lora_params, training_bytes, weight_bytes
from quant.runtime.measure import MemoryTracker, float_model_bytes, weight_report
from quant.shape.memory import (
    dtype_bytes,
    kv_bytes_per_token,
    parse_bytes,
    prefill_activation_bytes,
)
from quant.shape.model import KNOWN_SHAPES, ModelShape, parse_size, shape_for_params


def _tiny(tokenizer, tmp_path, **kw):
    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama(tmp_path / "m", tokenizer, **kw)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.e2e
@pytest.mark.parametrize("scheme,dtype", [
    ("int8-sym", "bfloat16"), ("int8-affine", "float32"), ("w8a8", "bfloat16"), ("rtn-w4", "bfloat16"),
    ("w4a16", "float32"),
])
def test_predicted_weight_bytes_equal_the_artifact(tmp_path, tiny_model_dir, text_file, scheme, dtype):
    out = tmp_path / "a"
    assert run_cli("build", "--scheme", scheme, "--model", tiny_model_dir, "--out", out, "--dtype", dtype,
                   "--calib", text_file, "--calib-samples", "2", "--calib-seqlen", "32", "--no-progress") == 0
    from quant.format.artifact import mmap_safetensors

    art = load(out, verify=True)
    shape = ModelShape.from_config(art.model.config)
    fb = dtype_bytes(getattr(torch, dtype))
    predicted = weight_bytes(shape, scheme, float_bytes=fb, group_size=64)
    stored = mmap_safetensors(out / "model.safetensors")
    assert predicted["total"] == sum(t.numel() * t.element_size() for t in stored.values())
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert manifest["memory"]["weights"] == predicted
    # Loaded for serving in its float dtype, the model holds its runtime layout (int4: repacked for the kernel).
    assert weight_bytes(shape, scheme, float_bytes=fb, group_size=64, served=True) == weight_report(art.model)


@pytest.mark.unit
def test_float_prediction_and_params(tokenizer, tmp_path):
    _, model = _tiny(tokenizer, tmp_path)
    shape = ModelShape.from_config(model.config)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert weight_bytes(shape, "float", 4)["total"] == float_model_bytes(model)
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2  # 2 layers, 2 kv heads of 16


@pytest.mark.reference
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,seq", [(1, 256), (2, 512)])
def test_activation_estimate_within_15_percent_of_measurement(tokenizer, tmp_path, attn, dtype, batch, seq):
    # Wider than the default tiny model so activations, not the fixed logits row, dominate.
    _, model = _tiny(tokenizer, tmp_path, hidden_size=256, intermediate_size=768, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=1024)
    model = model.to(dtype)
    model.config._attn_implementation = attn
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), MemoryTracker() as tr:
        model(ids, use_cache=False, logits_to_keep=1)
    est = prefill_activation_bytes(ModelShape.from_config(model.config), batch, seq, attn, dtype_bytes(dtype))
    assert abs(est / tr.peak - 1) < 0.15, (est, tr.peak)


@pytest.mark.unit
def test_eager_is_quadratic_and_sdpa_linear():
    s = KNOWN_SHAPES["135M"]
    eager = [prefill_activation_bytes(s, 1, n, "eager", 2) for n in (2048, 4096)]
    sdpa = [prefill_activation_bytes(s, 1, n, "sdpa", 2) for n in (2048, 4096)]
    assert 3.5 < eager[1] / eager[0] < 4.1
    assert 1.9 < sdpa[1] / sdpa[0] < 2.1


@pytest.mark.unit
def test_memory_tracker_sees_frees():
    with MemoryTracker() as tr:
        a = torch.ones(1024)  # 4 KiB
        b = a * 2
        del a
        c = b + 1  # a is gone by now
    assert tr.peak == 3 * 4096 - 4096 or tr.peak == 3 * 4096  # frees are observed at the next op
    assert tr.current == 2 * 4096
    del b, c


@pytest.mark.unit
def test_training_classes():
    s = KNOWN_SHAPES["7B"]
    P = s.params()
    full = training_bytes(s, TrainSetup("mixed", 32), 1, 2048)
    assert (full["W"], full["G"], full["O"]) == (6 * P, 2 * P, 8 * P)
    fp32 = training_bytes(s, TrainSetup("fp32", 32), 1, 2048)
    assert (fp32["W"], fp32["G"], fp32["O"]) == (4 * P, 4 * P, 8 * P)
    assert training_bytes(s, TrainSetup("mixed", 8), 1, 2048)["O"] == 2 * P
    assert training_bytes(s, TrainSetup("mixed", 4), 1, 2048)["O"] == P
    lora = training_bytes(s, TrainSetup("mixed", 32, lora_rank=16, base_scheme="w4a16"), 1, 2048)
    assert lora["trainable_params"] == lora_params(s, 16) == 32 * 16 * sum(n + k for _, n, k in s.linears())
    assert lora["G"] == 4 * lora["trainable_params"] and lora["W"] < full["W"] / 5
    ckpt = training_bytes(s, TrainSetup("mixed", 32, checkpointing=True), 1, 2048)
    assert ckpt["A"] < full["A"] / 5


@pytest.mark.unit
def test_sizes_parse_and_known_shapes():
    assert parse_size("7B") == 7e9 and parse_size("135M") == 135e6
    assert shape_for_params(7e9).name == "Llama-2-7B"
    assert shape_for_params(1.35e8).name == "SmolLM2-135M"
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(ValueError):
        parse_size("seven")
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.e2e
def test_estimate_cli(tiny_model_dir, capsys):
    assert run_cli("estimate", "--model", tiny_model_dir, "--scheme", "w4a16", "--group-size", "64",
                   "--batch", "2", "--context", "128", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["classes"]["KV"] == 2 * 128 * r["kv_bytes_per_token"]
    assert r["gpus"] == 1
    # an int8 KV cache: per head and token, 2 x (head_dim codes + a float16 scale) instead of 2 x head_dim x 2 bytes
    assert run_cli("estimate", "--model", tiny_model_dir, "--scheme", "w4a16", "--group-size", "64",
                   "--batch", "2", "--context", "128", "--kv-dtype", "int8", "--json") == 0
    q = json.loads(capsys.readouterr().out)
    assert q["kv_bytes_per_token"] * 2 * 16 == r["kv_bytes_per_token"] * (16 + 2)  # tiny model: head_dim 16, bf16
    assert q["classes"]["KV"] == 2 * 128 * q["kv_bytes_per_token"] and "KV int8" in q["setup"]
    assert run_cli("estimate", "--params", "70B", "--scheme", "float", "--gpu-memory", "80GiB", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["gpus"] == -(-r["total"] // (80 * 2**30)) and r["gpus"] >= 2


@pytest.mark.unit
@pytest.mark.parametrize("args,needle", [
    (("--params", "7B", "--scheme", "int3"), "--scheme"),
    (("--params", "seven"), "--params"),
    (("--params", "7B", "--gpu-memory", "lots"), "--gpu-memory"),
    (("--params", "7B", "--batch", "0"), "--batch"),
    (("--params", "7B", "--attn", "magic"), "--attn"),
    (("--params", "7B", "--train", "--optimizer-bits", "3"), "--optimizer-bits"),
    (("--params", "7B", "--train", "--scheme", "w4a16"), "LoRA"),
    (("--params", "7B", "--layers", "0"), "--layers"),
])
def test_estimate_bad_input(capsys, args, needle):
    assert run_cli("estimate", *args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quant estimate: error:") and needle in err[0]


@pytest.mark.e2e
def test_estimate_model_and_params_conflict(tiny_model_dir, capsys):
    assert run_cli("estimate", "--model", tiny_model_dir, "--params", "7B") == 1
    assert "not both" in capsys.readouterr().err
