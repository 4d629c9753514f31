"""End-to-end builds on the tiny model: every scheme through the real CLI, loaded back, compared
with the float model, evaluated, inspected and verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from quant import load
from quant.format import artifact
from quant.format.sources import ModelSource, load_model
from quant.runtime.int4 import GPTQLinear
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.w8a8 import W8A8Linear

pytestmark = pytest.mark.e2e

CALIB = ("--calib-samples", "8", "--calib-seqlen", "64", "--seed", "0")
EVAL = ("--eval-windows", "4", "--eval-seqlen", "64")


def _base(tiny_model_dir):
    return load_model(ModelSource("t", "dir", str(tiny_model_dir), "x"))[0]


def _rel_logit_error(a, b, ids) -> float:
    with torch.inference_mode():
        la = a(ids).logits.float()
        lb = b(ids).logits.float()
    return float((la - lb).norm() / lb.norm())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "scheme,extra,tol,cls",
    [
        ("int8-sym", (), 0.02, Int8WeightLinear),
        ("int8-affine", (), 0.02, Int8WeightLinear),
        ("w8a8", ("--calib-method", "auto"), 0.08, W8A8Linear),
        ("w8a8", ("--calib-method", "kl", "--no-smooth"), 0.15, W8A8Linear),
        ("w8a8", ("--calib-method", "percentile", "--smooth-alpha", "0.5"), 0.15, W8A8Linear),
        ("w8a8", ("--calib-method", "minmax", "--no-rotate"), 0.15, W8A8Linear),
        ("w8a8", ("--act-dynamic",), 0.05, W8A8Linear),
        ("w8a8", ("--act-dynamic", "--no-gptq"), 0.05, W8A8Linear),
        ("rtn-w4", (), 0.25, GPTQLinear),
        ("w4a16", (), 0.25, GPTQLinear),
        ("w4a16", ("--no-act-order", "--asym", "--group-size", "32", "--no-clip-search"), 0.25, GPTQLinear),
    ],
)
def test_build_load_and_match_float(tmp_path, tiny_model_dir, text_file, ids, scheme, extra, tol, cls):
    out = tmp_path / "art"
    rc = run_cli("build", "--scheme", scheme, "--model", tiny_model_dir, "--out", out, "--calib", text_file,
                 *CALIB, *extra, "--dtype", "float32", "--no-progress")
    assert rc == 0
    manifest = artifact.verify(out)
    assert manifest["scheme"] == scheme
    assert set(manifest["files"]) >= {"model.safetensors", "config.json"}
    art = load(out, dtype=torch.float32)
    quantized = [m for m in art.model.modules() if isinstance(m, cls)]
    assert len(quantized) == 2 * 7  # every Linear in both decoder layers
    assert isinstance(art.model.lm_head, torch.nn.Linear)  # lm_head stays float by default
    err = _rel_logit_error(art.model, _base(tiny_model_dir), ids)
    assert err < tol, f"{scheme} {extra}: relative logit error {err:.4f}"
    mem = manifest["memory"]["weights"]
    if cls is GPTQLinear:
        assert mem["quantized_weights"] == sum(m.in_features * m.out_features // 2 for m in quantized)  # 4 bits a weight
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["desc_act"] is False
        assert qc["checkpoint_format"] == ("gptq_v2" if "--asym" in extra else "gptq")
        assert qc["group_size"] == (32 if "32" in extra else 64)  # 64 | hidden 64; 128 does not
        assert (out / "quantize_config.json").is_file()
        if scheme == "w4a16":
            assert manifest["parameters"]["clip_search"] is ("--no-clip-search" not in extra)
    else:
        assert mem["quantized_weights"] == sum(m.weight.numel() for m in quantized)
    if scheme in ("w8a8", "w4a16"):
        assert manifest["calibration"]["windows"] == 8 and manifest["calibration"]["seqlen"] == 64
        report = json.loads((out / "calibration_report.json").read_text())
        assert len(report["linears"]) == 14
    if scheme == "w8a8":  # int8 weights by GPTQ, or rounded with --no-gptq: said per Linear and in the manifest
        want = "rtn" if "--no-gptq" in extra else "gptq"
        assert {info["weights"]["method"] for info in report["linears"].values()} == {want}
        assert manifest["parameters"]["weights"]["method"] == want
        # down_proj's input rotated (intermediate 128: one block of 128) unless --no-rotate; the rotation needs
        # format 2, which readers that predate it refuse instead of ignoring the spec's "rotate"
        rotated = "--no-rotate" not in extra
        assert {m.rotate for m in quantized} == ({0, 128} if rotated else {0})
        assert [n for n, m in art.model.named_modules() if getattr(m, "rotate", 0)] == (
            [f"model.layers.{i}.mlp.down_proj" for i in range(2)] if rotated else [])
        assert manifest["format_version"] == (2 if rotated else 1)
        assert manifest["parameters"]["rotate"] == ({"linear": "down_proj", "blocks": [128], "layers": 2}
                                                    if rotated else None)


def test_w8a8_smoothing_is_folded_and_auto_never_worse_than_minmax(tmp_path, tiny_model_dir, text_file):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "w8a8", "--model", tiny_model_dir, "--out", out, "--calib", text_file,
                   *CALIB, "--no-progress") == 0
    report = json.loads((out / "calibration_report.json").read_text())
    groups = report["groups"]
    assert len(groups) == 2 * 4
    assert all(g["folded"] for g in groups.values())  # Llama shapes, GQA included, fold exactly
    art = load(out)
    assert all(m.smooth_scale is None for m in art.model.modules() if isinstance(m, W8A8Linear))
    for info in report["linears"].values():
        cands = info["candidates"]
        assert set(cands) >= {"minmax", "kl", "percentile-99.99"}
        assert info["rel_error"] <= cands["minmax"]["rel_error"]


def test_include_lm_head_and_eval_report(tmp_path, tiny_model_dir, text_file, ids):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--out", out,
                   "--include-lm-head", "--eval-data", text_file, *EVAL, "--no-progress") == 0
    manifest = artifact.read_manifest(out)
    art = load(out, dtype=torch.float32)
    assert isinstance(art.model.lm_head, Int8WeightLinear)
    assert art.model.model.embed_tokens.weight.dtype == torch.float32
    q = manifest["quality"]
    assert q["tokens"] == 4 * 63
    assert q["mean_kl"] >= 0 and 0 <= q["top1_agreement"] <= 1
    assert abs(q["delta_ppl_pct"]) < 10


def test_eval_command_json_matches_manifest(tmp_path, tiny_model_dir, text_file, capsys):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-affine", "--model", tiny_model_dir, "--out", out,
                   "--eval-data", text_file, *EVAL, "--no-progress") == 0
    capsys.readouterr()
    assert run_cli("eval", out, "--windows", "4", "--seqlen", "64", "--json", "--no-progress") == 0
    result = json.loads(capsys.readouterr().out)
    q = artifact.read_manifest(out)["quality"]
    assert result["ppl"] == pytest.approx(q["ppl"], rel=1e-6)
    assert result["base_ppl"] == pytest.approx(q["base_ppl"], rel=1e-6)
    assert result["data"]["fingerprint"] == q["data"]["fingerprint"]


def test_inspect_and_verify(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--out", out, "--no-progress") == 0
    capsys.readouterr()
    assert run_cli("inspect", out, "--json") == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["source_model"]["kind"] == "dir"
    assert manifest["memory"]["compression_ratio"] > 1.0
    assert run_cli("verify", out) == 0
    assert "match" in capsys.readouterr().out


def test_jsonl_calibration_and_seed_reproducibility(tmp_path, tiny_model_dir, jsonl_file):
    outs = []
    for i in range(2):
        out = tmp_path / f"art{i}"
        assert run_cli("build", "--scheme", "w8a8", "--model", tiny_model_dir, "--out", out, "--calib",
                       jsonl_file, *CALIB, "--no-progress") == 0
        outs.append(artifact.read_manifest(out))
    assert outs[0]["files"]["model.safetensors"] == outs[1]["files"]["model.safetensors"]
    assert outs[0]["calibration"]["fingerprint"] == outs[1]["calibration"]["fingerprint"]


def test_self_generated_calibration(tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "w8a8", "--model", tiny_model_dir, "--out", out,
                   "--calib", "self", "--calib-samples", "4", "--calib-seqlen", "32", "--no-progress") == 0
    cal = artifact.read_manifest(out)["calibration"]
    assert cal["source"] == "self" and cal["windows"] == 4 and cal["seqlen"] == 32


def test_load_is_memory_mapped(tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "int8-sym", "--model", tiny_model_dir, "--out", out, "--no-progress") == 0
    art = load(out)
    lin = next(m for m in art.model.modules() if isinstance(m, Int8WeightLinear))
    # The weight's memory must lie inside a mapping of the artifact's safetensors file (Linux maps).
    addr = lin.weight.data_ptr()
    target = str((out / "model.safetensors").resolve())
    maps = Path("/proc/self/maps").read_text().splitlines()
    hits = [m for m in maps if m.endswith(target) and int(m.split("-")[0], 16) <= addr < int(m.split()[0].split("-")[1], 16)]
    assert hits, "weight is not backed by the artifact file mapping"


def test_group_size_that_does_not_divide_is_refused_before_any_work(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "w4a16", "--model", tiny_model_dir, "--out", out,
                   "--group-size", "128", "--calib-samples", "2", "--calib-seqlen", "16", "--no-progress") == 1
    err = capsys.readouterr().err
    assert "--group-size 128 does not divide" in err and "q_proj" in err
    assert not out.exists()


def test_cholesky_failure_falls_back_to_rtn_and_the_manifest_says_so(tmp_path, tiny_model_dir, text_file, monkeypatch):
    from quant.build import gptq

    real = gptq._inverse_hessian_factor
    calls = []

    def failing_once(h, damp, tries):
        calls.append(1)
        return (None, damp * 10 ** (tries - 1)) if len(calls) == 3 else real(h, damp, tries)

    monkeypatch.setattr(gptq, "_inverse_hessian_factor", failing_once)
    out = tmp_path / "art"
    assert run_cli("build", "--scheme", "w4a16", "--model", tiny_model_dir, "--out", out, "--calib", text_file,
                   *CALIB, "--no-progress") == 0
    fallbacks = artifact.read_manifest(out)["parameters"]["rtn_fallbacks"]
    assert [f["module"] for f in fallbacks] == ["model.layers.0.self_attn.v_proj"]
    assert "Cholesky failed" in fallbacks[0]["reason"]
    assert load(out) is not None


def test_a_source_resolved_for_serving_reads_no_weight_file(tiny_model_dir, cache_dir, monkeypatch):
    """A build records the source's digest; serving and planning resolve without it, so a server's start does not
    hash the model's weights (tens of seconds for an 8B model)."""
    from quant.format import sources

    want = sources.dir_fingerprint(Path(tiny_model_dir))
    assert sources.resolve(str(tiny_model_dir), cache_dir).fingerprint == want
    monkeypatch.setattr(sources, "sha256_file", lambda p: pytest.fail(f"hashed {p}"))
    served = sources.resolve(str(tiny_model_dir), cache_dir, fingerprint=False)
    assert served.fingerprint is None and served.path == str(Path(tiny_model_dir).resolve())
