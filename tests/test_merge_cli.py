"""`quant merge` and `quant build --lora` end to end, held to PEFT's merge_and_unload."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_adapter, run_cli
from helpers import hf_causal_lm, peft_merged

from quant import load
from quant.format import artifact

pytestmark = pytest.mark.e2e


def test_merge_command_equals_peft(tmp_path, tiny_model_dir):
    adapter = make_adapter(tiny_model_dir, tmp_path / "ad", r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    out = tmp_path / "merged"
    assert run_cli("merge", "--lora", adapter, "--model", tiny_model_dir, "--out", out) == 0
    got = hf_causal_lm(out).state_dict()
    want = peft_merged(tiny_model_dir, adapter)
    assert all(torch.equal(got[k], want[k]) for k in want)
    info = json.loads((out / "quantserve_merge.json").read_text())
    assert info["adapter"]["use_rslora"] is True and len(info["adapter"]["modules"]) == 6
    assert run_cli("merge", "--lora", adapter, "--model", tiny_model_dir, "--out", out) == 1  # exists


def test_merge_writes_the_base_dtype_bit_exact_with_peft_in_it(tmp_path, tiny_model_dir, capsys):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    base = tmp_path / "bf16-base"
    hf_causal_lm(tiny_model_dir, torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    adapter = make_adapter(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])

    def stored(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {f.get_tensor(k).dtype for k in f.keys()}

    for flag, dtype in ((), torch.bfloat16), (("--dtype", "float32"), torch.float32):
        out = tmp_path / f"merged-{dtype}"
        assert run_cli("merge", "--lora", adapter, "--model", base, "--out", out, *flag) == 0
        assert stored(out) == {dtype}  # a bf16 base was written as fp32, twice its size
        got = hf_causal_lm(out, dtype).state_dict()
        want = peft_merged(base, adapter, dtype)  # PEFT on the base loaded in that dtype
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert json.loads((out / "quantserve_merge.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    capsys.readouterr()
    assert run_cli("merge", "--lora", adapter, "--model", base, "--out", tmp_path / "x", "--dtype", "int8") == 1
    err = capsys.readouterr().err
    assert "--dtype must be one of auto, float32, bfloat16, float16" in err and not (tmp_path / "x").exists()


def test_build_with_lora_records_adapter_and_evaluates_against_the_merged_model(tmp_path, tiny_model_dir, text_file):
    adapter = make_adapter(tiny_model_dir, tmp_path / "ad", r=8, lora_alpha=16, target_modules="all-linear")
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--lora", adapter, "--out", out,
                   "--eval-data", text_file, "--eval-windows", "2", "--eval-seqlen", "64", "--no-progress") == 0
    manifest = artifact.read_manifest(out)
    assert manifest["adapter"]["fingerprint"] and len(manifest["adapter"]["modules"]) == 14
    # Against the merged model int8 is nearly lossless; against the bare base it would not be.
    assert manifest["quality"]["mean_kl"] < 0.01
    art = load(out, dtype=torch.float32)
    ids = torch.randint(0, 1000, (1, 16))
    merged = hf_causal_lm(tiny_model_dir)
    from quant.build.lora import merge_adapter

    merge_adapter(merged, adapter)
    with torch.inference_mode():
        a, b, c = art.model(ids).logits, merged(ids).logits, hf_causal_lm(tiny_model_dir)(ids).logits
    assert (a - b).norm() < 0.2 * (c - b).norm()


def test_build_with_bad_lora_is_refused(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--lora", tmp_path / "nope",
                   "--out", out, "--no-progress") == 1
    assert "nope" in capsys.readouterr().err and not out.exists()


def test_eval_of_a_lora_artifact_uses_the_merged_reference_and_checks_the_adapter(tmp_path, tiny_model_dir, text_file,
                                                                                   capsys):
    adapter = make_adapter(tiny_model_dir, tmp_path / "ad", r=8, lora_alpha=16, target_modules="all-linear")
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--lora", adapter, "--out", out,
                   "--eval-data", text_file, "--eval-windows", "2", "--eval-seqlen", "64", "--no-progress") == 0
    capsys.readouterr()
    assert run_cli("eval", out, "--windows", "2", "--seqlen", "64", "--json", "--no-progress") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mean_kl"] == artifact.read_manifest(out)["quality"]["mean_kl"]
    (adapter / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text() + " ")
    assert run_cli("eval", out, "--windows", "2", "--seqlen", "64", "--no-progress") == 1
    assert "has changed since the build" in capsys.readouterr().err
