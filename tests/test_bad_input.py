"""Bad input to the `quant` CLI: each case gets one error line naming the problem, a non-zero exit,
and leaves nothing half-written next to the requested output dir.

Every test drives the real CLI (`quant.cli.main`) on the tiny random-weight Llama from conftest; the
builds that get as far as loading the model are kept to a few 32-token windows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

from quant.errors import ArtifactError

pytestmark = pytest.mark.e2e

CALIB = ("--calib-samples", "4", "--calib-seqlen", "32")
EVAL = ("--eval-windows", "2", "--eval-seqlen", "32")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No test writes into the user cache or the current directory."""
    monkeypatch.setenv("QUANTSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def error_line(capsys, cmd: str) -> str:
    """The single `quant <cmd>: error:` line on stderr; it must be the last thing printed, so a
    message spanning several lines (or a traceback after it) fails here."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    prefix = f"quant {cmd}: error: "
    lines = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"expected exactly one {prefix!r} line, got stderr:\n{err}"
    rest = [ln for ln in err.splitlines() if ln.strip()]
    assert rest[-1] == lines[0], f"the error message spans more than one line:\n{err}"
    return lines[0][len(prefix):]


def assert_nothing_written(out: Path) -> None:
    """Neither the target nor a staging / old-copy sibling of it exists."""
    assert not out.exists(), f"{out} was created by a failing build"
    if out.parent.is_dir():
        leftovers = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
        assert leftovers == [], f"staging dirs left behind: {leftovers}"


def build_args(model, out, *extra, scheme="int8-sym"):
    return ["build", "--scheme", scheme, "--model", str(model), "--out", str(out), "--no-progress", *map(str, extra)]


def failing_build(capsys, out: Path, *args) -> str:
    code = run_cli(*args)
    msg = error_line(capsys, "build")
    assert code == 1
    assert_nothing_written(out)
    return msg


# ------------------------------------------------------------------------------------------------
# 1. option values


@pytest.mark.parametrize(
    "extra, names",
    [
        (("--scheme", "int3"), ["'int3'", "scheme", "int8-sym"]),
        (("--calib-method", "magic"), ["--calib-method", "'magic'"]),
        (("--smooth-alpha", "1.5"), ["--smooth-alpha", "1.5"]),
        (("--calib-samples", "0"), ["--calib-samples", "0"]),
        (("--dtype", "float8"), ["--dtype", "'float8'"]),
    ],
    ids=["scheme-int3", "calib-method", "smooth-alpha-1.5", "calib-samples-0", "dtype-float8"],
)
def test_bad_option_value(capsys, tmp_path, tiny_model_dir, extra, names):
    out = tmp_path / "art"
    args = build_args(tiny_model_dir, out, scheme="w8a8")
    if extra[0] == "--scheme":
        args[2] = extra[1]
    else:
        args += list(extra)
    msg = failing_build(capsys, out, *args)
    for name in names:
        assert name in msg, msg


def test_include_lm_head_refused_by_a_4bit_scheme(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    msg = failing_build(capsys, out, *build_args(tiny_model_dir, out, "--include-lm-head", scheme="w4a16"))
    assert "--include-lm-head" in msg and "w4a16" in msg and "GPTQ" in msg, msg


# ------------------------------------------------------------------------------------------------
# 2. the model


def test_model_path_missing(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    msg = failing_build(capsys, tmp_path / "art", *build_args(missing, tmp_path / "art"))
    assert str(missing) in msg and "not found" in msg


def test_model_empty(capsys, tmp_path):
    msg = failing_build(capsys, tmp_path / "art", *build_args("", tmp_path / "art"))
    assert "--model" in msg and "empty" in msg


def test_model_dir_without_config(capsys, tmp_path, tiny_model_dir):
    model = tmp_path / "noconfig"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").unlink()
    msg = failing_build(capsys, tmp_path / "art", *build_args(model, tmp_path / "art"))
    assert str(model) in msg and "config.json" in msg


def test_model_dir_without_weights(capsys, tmp_path, tiny_model_dir):
    model = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir, model)
    for p in list(model.glob("*.safetensors")) + list(model.glob("*.bin")):
        p.unlink()
    msg = failing_build(capsys, tmp_path / "art", *build_args(model, tmp_path / "art"))
    assert str(model) in msg and "weight" in msg


def test_model_gguf_missing(capsys, tmp_path):
    gguf = tmp_path / "nothere.gguf"
    msg = failing_build(capsys, tmp_path / "art", *build_args(gguf, tmp_path / "art"))
    assert str(gguf) in msg and "GGUF" in msg
    assert not (tmp_path / "cache").exists(), "a missing GGUF must not touch the cache"


def test_model_config_not_json(capsys, tmp_path, tiny_model_dir):
    model = tmp_path / "badconfig"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text("{oops")
    msg = failing_build(capsys, tmp_path / "art", *build_args(model, tmp_path / "art"))
    assert str(model) in msg and "config.json" in msg


def test_model_weights_corrupt(capsys, tmp_path, tiny_model_dir):
    model = tmp_path / "badweights"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"garbage" * 10)
    msg = failing_build(capsys, tmp_path / "art", *build_args(model, tmp_path / "art"))
    assert str(model) in msg


def test_model_path_is_a_plain_file(capsys, tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("not a model")
    msg = failing_build(capsys, tmp_path / "art", *build_args(f, tmp_path / "art"))
    assert str(f) in msg


# ------------------------------------------------------------------------------------------------
# 3. calibration data (only read for w8a8)


def w8a8_args(model, out, calib, *extra):
    return build_args(model, out, "--calib", calib, *CALIB, *extra, scheme="w8a8")


def test_calib_file_missing(capsys, tmp_path, tiny_model_dir):
    calib = tmp_path / "nope.txt"
    msg = failing_build(capsys, tmp_path / "art", *w8a8_args(tiny_model_dir, tmp_path / "art", calib))
    assert str(calib) in msg and "not found" in msg


@pytest.mark.parametrize("content", ["", "   \n\t\n  \n"], ids=["empty", "whitespace"])
def test_calib_file_empty(capsys, tmp_path, tiny_model_dir, content):
    calib = tmp_path / "calib.txt"
    calib.write_text(content)
    msg = failing_build(capsys, tmp_path / "art", *w8a8_args(tiny_model_dir, tmp_path / "art", calib))
    assert str(calib) in msg and "empty" in msg


def test_calib_file_shorter_than_one_window(capsys, tmp_path, tiny_model_dir):
    calib = tmp_path / "short.txt"
    calib.write_text("five words and no more")
    args = w8a8_args(tiny_model_dir, tmp_path / "art", calib, "--calib-seqlen", "512")
    msg = failing_build(capsys, tmp_path / "art", *args)
    assert str(calib) in msg and "512" in msg and "--calib-seqlen" in msg
    assert re.search(r"has \d+ tokens", msg), msg


def test_calib_jsonl_malformed_line(capsys, tmp_path, tiny_model_dir, jsonl_file):
    lines = jsonl_file.read_text().splitlines()
    lines[3] = '{"text": "unterminated'
    jsonl_file.write_text("\n".join(lines) + "\n")
    msg = failing_build(capsys, tmp_path / "art", *w8a8_args(tiny_model_dir, tmp_path / "art", jsonl_file))
    assert f"{jsonl_file}:4" in msg and "JSON" in msg


@pytest.mark.parametrize("bad", ['{"content": "no text field"}', '{"text": 3}', '["text"]'],
                         ids=["no-text-field", "text-not-string", "not-an-object"])
def test_calib_jsonl_line_without_text(capsys, tmp_path, tiny_model_dir, jsonl_file, bad):
    lines = jsonl_file.read_text().splitlines()
    lines[1] = bad
    jsonl_file.write_text("\n".join(lines) + "\n")
    msg = failing_build(capsys, tmp_path / "art", *w8a8_args(tiny_model_dir, tmp_path / "art", jsonl_file))
    assert f"{jsonl_file}:2" in msg and "'text'" in msg


def test_calib_file_not_utf8(capsys, tmp_path, tiny_model_dir):
    calib = tmp_path / "binary.txt"
    calib.write_bytes(b"\xff\xfe\x00\x80 binary junk \xc3\x28")
    msg = failing_build(capsys, tmp_path / "art", *w8a8_args(tiny_model_dir, tmp_path / "art", calib))
    assert str(calib) in msg


# ------------------------------------------------------------------------------------------------
# 4. evaluation data


def test_eval_data_missing(capsys, tmp_path, tiny_model_dir):
    data = tmp_path / "missing-eval.txt"
    args = build_args(tiny_model_dir, tmp_path / "art", "--eval-data", data, *EVAL)
    msg = failing_build(capsys, tmp_path / "art", *args)
    assert str(data) in msg and "not found" in msg


def test_eval_windows_more_than_the_file_has(capsys, tmp_path, tiny_model_dir, text_file):
    args = build_args(tiny_model_dir, tmp_path / "art", "--eval-data", text_file,
                      "--eval-windows", "100000", "--eval-seqlen", "32")
    msg = failing_build(capsys, tmp_path / "art", *args)
    assert str(text_file) in msg
    m = re.search(r"has (\d+) tokens: (\d+) windows of 32, fewer than the 100000 requested", msg)
    assert m, msg
    assert int(m.group(2)) == int(m.group(1)) // 32


@pytest.mark.parametrize(
    "extra, option",
    [
        (("--eval-windows", "0"), "--eval-windows"),
        (("--eval-seqlen", "1"), "--eval-seqlen"),
        (("--eval-dtype", "float8"), "--eval-dtype"),
        (("--eval-windows", "100000"), "--eval-windows"),
    ],
    ids=["eval-windows", "eval-seqlen", "eval-dtype", "eval-windows-too-many"],
)
def test_build_eval_options_are_named_as_typed(capsys, tmp_path, tiny_model_dir, text_file, extra, option):
    args = build_args(tiny_model_dir, tmp_path / "art", "--eval-data", text_file, *EVAL, *extra)
    msg = failing_build(capsys, tmp_path / "art", *args)
    assert option in msg, msg


@pytest.mark.parametrize(
    "extra, names",
    [
        (("--max-dppl", "2"), ["--max-dppl", "--eval-data"]),
        (("--max-kl", "0.1"), ["--max-kl", "--eval-data"]),
        (("--max-kl", "-1", "--eval-data", "EVAL"), ["--max-kl", "-1"]),
        (("--max-dppl", "nan", "--eval-data", "EVAL"), ["--max-dppl", "nan"]),
    ],
    ids=["dppl-without-data", "kl-without-data", "kl-negative", "dppl-nan"],
)
def test_quality_gate_options(capsys, tmp_path, tiny_model_dir, text_file, extra, names):
    extra = [text_file if a == "EVAL" else a for a in extra]
    msg = failing_build(capsys, tmp_path / "art", *build_args(tiny_model_dir, tmp_path / "art", *extra))
    for name in names:
        assert name in msg, msg


def test_quality_gate_missed_publishes_nothing(capsys, tmp_path, tiny_model_dir, text_file):
    """A build past its gate says by how much, exits 1, and leaves the previous artifact (--force) untouched."""
    out = tmp_path / "art"
    assert run_cli(*build_args(tiny_model_dir, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    msg = failing_build_keeping(capsys, out, *build_args(
        tiny_model_dir, out, "--force", "--eval-data", text_file, *EVAL, "--max-kl", "0", "--max-dppl", "1000",
        scheme="rtn-w4"))
    assert "quality gate" in msg and re.search(r"mean KL [0-9.]+ > --max-kl 0 \(by [0-9.e-]+\)", msg), msg
    assert "--max-dppl" not in msg, msg  # the bound that held is not reported as missed
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_quality_gate_passed_is_recorded(tmp_path, tiny_model_dir, text_file):
    from quant.format.artifact import read_manifest

    out = tmp_path / "art"
    assert run_cli(*build_args(tiny_model_dir, out, "--eval-data", text_file, *EVAL, "--max-kl", "100",
                               "--max-dppl", "1000")) == 0
    quality = read_manifest(out)["quality"]
    assert quality["gate"] == {"max_dppl": 1000.0, "max_kl": 100.0, "passed": True}
    assert quality["mean_kl"] <= 100


def failing_build_keeping(capsys, out: Path, *args) -> str:
    """Like failing_build, for a target that existed before: only staging leftovers are checked."""
    code = run_cli(*args)
    msg = error_line(capsys, "build")
    assert code == 1
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
    assert leftovers == [], f"staging dirs left behind: {leftovers}"
    return msg


# ------------------------------------------------------------------------------------------------
# 5. the output dir


def test_out_exists_without_force(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    out.mkdir()
    (out / "marker").write_text("keep me")
    code = run_cli(*build_args(tiny_model_dir, out))
    msg = error_line(capsys, "build")
    assert code == 1
    assert str(out) in msg and "--force" in msg
    assert [p.name for p in out.iterdir()] == ["marker"]
    assert (out / "marker").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".art.")) == []


def test_out_exists_with_force_is_replaced(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    out.mkdir()
    (out / "marker").write_text("old")
    assert run_cli(*build_args(tiny_model_dir, out, "--force")) == 0
    assert not (out / "marker").exists()
    assert (out / "quant_manifest.json").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".art.")) == []
    assert run_cli("verify", out) == 0


def test_out_parent_unwritable(capsys, tmp_path, tiny_model_dir, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):
            # Running as root, chmod does not make a dir unwritable: report it unwritable the way an
            # ordinary user's os.access would, so the check itself is still exercised.
            real_access = os.access
            monkeypatch.setattr("quant.format.artifact.os.access",
                                lambda p, mode: False if Path(p) == parent else real_access(p, mode))
        out = parent / "art"
        msg = failing_build(capsys, out, *build_args(tiny_model_dir, out))
        assert str(parent) in msg and "writable" in msg
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o700)


def test_out_parent_is_a_file(capsys, tmp_path, tiny_model_dir):
    parent = tmp_path / "afile"
    parent.write_text("I am a file")
    out = parent / "art"
    msg = failing_build(capsys, out, *build_args(tiny_model_dir, out))
    assert str(parent) in msg
    assert parent.read_text() == "I am a file"


def test_out_grandparent_is_a_file(capsys, tmp_path, tiny_model_dir):
    """The parent does not exist and cannot be created because an ancestor is a file."""
    f = tmp_path / "afile"
    f.write_text("I am a file")
    out = f / "sub" / "art"
    msg = failing_build(capsys, out, *build_args(tiny_model_dir, out))
    assert str(out.parent) in msg
    assert f.read_text() == "I am a file"


def test_out_is_an_existing_file_with_force(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    out.write_text("a file")
    code = run_cli(*build_args(tiny_model_dir, out, "--force"))
    msg = error_line(capsys, "build")
    assert code == 1
    assert str(out) in msg and "not a directory" in msg
    assert out.read_text() == "a file"


# ------------------------------------------------------------------------------------------------
# 6. a crash mid-build leaves nothing half-written


def _crash_cfg(tiny_model_dir, out, text_file=None, force=False):
    from quant.build.config import BuildConfig, EvalConfig

    ev = EvalConfig(data=str(text_file), windows=2, seqlen=32) if text_file else EvalConfig()
    return BuildConfig(scheme="int8-sym", model=str(tiny_model_dir), out=str(out), force=force, eval=ev)


def test_crash_in_write_manifest(tmp_path, tiny_model_dir, monkeypatch):
    import quant.build.pipeline

    def boom(*a, **k):
        raise RuntimeError("simulated crash while writing the manifest")

    monkeypatch.setattr(quant.build.pipeline.artifact, "write_manifest", boom)
    out = tmp_path / "art"
    with pytest.raises(RuntimeError, match="simulated crash"):
        quant.build.pipeline.build(_crash_cfg(tiny_model_dir, out), tmp_path / "cache", progress=False, log=lambda m: None)
    assert_nothing_written(out)


def test_crash_in_evaluation_keeps_the_old_artifact(tmp_path, tiny_model_dir, text_file, monkeypatch):
    """With --force, a build that dies (here: during the quality report, after files were written to
    staging) leaves the previous artifact exactly as it was."""
    import quant.build.pipeline

    def boom(*a, **k):
        raise RuntimeError("simulated crash during evaluation")

    monkeypatch.setattr(quant.build.evaluate, "compare", boom)
    out = tmp_path / "art"
    out.mkdir()
    (out / "marker").write_text("old artifact")
    with pytest.raises(RuntimeError, match="simulated crash"):
        quant.build.pipeline.build(_crash_cfg(tiny_model_dir, out, text_file, force=True), tmp_path / "cache",
                          progress=False, log=lambda m: None)
    assert [p.name for p in out.iterdir()] == ["marker"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".art.")) == []


# ------------------------------------------------------------------------------------------------
# 7. damaged artifacts


@pytest.fixture(scope="module")
def good_artifact(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("good") / "art"
    assert run_cli(*build_args(tiny_model_dir, out)) == 0
    return out


@pytest.fixture()
def artifact_copy(good_artifact, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(good_artifact, dst)
    return dst


def _rehash(art: Path, rel: str) -> None:
    from quant.format.artifact import sha256_file

    mpath = art / "quant_manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"][rel] = sha256_file(art / rel)
    mpath.write_text(json.dumps(manifest, indent=2))


def test_good_artifact_verifies(good_artifact, capsys):
    assert run_cli("verify", good_artifact) == 0
    assert "error" not in capsys.readouterr().err


def test_flipped_byte_in_weights(capsys, artifact_copy):
    import quant

    w = artifact_copy / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    assert run_cli("verify", artifact_copy) == 1
    msg = error_line(capsys, "verify")
    assert "model.safetensors" in msg and "sha256" in msg
    with pytest.raises(ArtifactError, match="model.safetensors"):
        quant.load(artifact_copy)


def test_tokenizer_file_deleted(capsys, artifact_copy):
    tok = next(artifact_copy / n for n in ("tokenizer.json", "tokenizer.model", "vocab.json")
               if (artifact_copy / n).is_file())
    tok.unlink()
    assert run_cli("verify", artifact_copy) == 1
    msg = error_line(capsys, "verify")
    assert tok.name in msg and "missing" in msg


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_manifest_not_json(capsys, artifact_copy, cmd):
    (artifact_copy / "quant_manifest.json").write_text('{"format_version": 1, "files": {')
    assert run_cli(cmd, artifact_copy) == 1
    msg = error_line(capsys, cmd)
    assert "quant_manifest.json" in msg and "JSON" in msg


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_manifest_missing_foreign_dir(capsys, tiny_model_dir, cmd):
    assert run_cli(cmd, tiny_model_dir) == 1
    msg = error_line(capsys, cmd)
    assert "not a quantserve artifact" in msg and "quant_manifest.json" in msg


def test_manifest_missing_load(tiny_model_dir):
    import quant

    with pytest.raises(ArtifactError, match="not a quantserve artifact"):
        quant.load(tiny_model_dir)


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_format_version_from_the_future(capsys, artifact_copy, cmd):
    import quant

    mpath = artifact_copy / "quant_manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["format_version"] = 999
    mpath.write_text(json.dumps(manifest))
    assert run_cli(cmd, artifact_copy) == 1
    msg = error_line(capsys, cmd)
    assert "999" in msg and ("upgrade" in msg or "newer" in msg)
    with pytest.raises(ArtifactError, match="999"):
        quant.load(artifact_copy)


@pytest.mark.parametrize("change", ["unknown-type", "missing-field", "bad-rotation"])
def test_module_spec_damaged(artifact_copy, change):
    """A config.json naming a runtime module type no scheme registers, a spec without a field its module
    needs, or a w8a8 rotation block that cannot tile the input: one ArtifactError naming the module, not a KeyError
    from inside the registry."""
    import quant

    cpath = artifact_copy / "config.json"
    config = json.loads(cpath.read_text())
    name, spec = next(iter(config["quantization_config"]["modules"].items()))
    if change == "unknown-type":
        spec["type"] = "int3"
    elif change == "bad-rotation":
        spec.clear()
        spec.update(type="w8a8", dynamic=True, smooth=False, bias=False, rotate=3)
    else:
        del spec["affine"]
    cpath.write_text(json.dumps(config))
    _rehash(artifact_copy, "config.json")
    with pytest.raises(ArtifactError, match=re.escape(name)) as err:
        quant.load(artifact_copy)
    if change == "bad-rotation":
        assert "rotate must be a power of two" in str(err.value)


@pytest.mark.parametrize("keep", ["empty", "4-bytes", "mid-header", "header-only", "half"])
def test_truncated_weights_with_matching_hash(artifact_copy, keep):
    """The hash check passes (the manifest was updated), but the file is short: a clean ArtifactError
    from the loader, not a crash inside torch or json."""
    import quant

    w = artifact_copy / "model.safetensors"
    data = w.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    n = {"empty": 0, "4-bytes": 4, "mid-header": header // 2, "header-only": header,
         "half": header + (len(data) - header) // 2}[keep]
    w.write_bytes(data[:n])
    _rehash(artifact_copy, "model.safetensors")
    assert run_cli("verify", artifact_copy) == 0  # the hashes match: only the loader can tell
    with pytest.raises(ArtifactError, match="model.safetensors"):
        quant.load(artifact_copy)


@pytest.mark.parametrize("cmd", ["inspect", "verify", "eval"])
def test_artifact_path_missing(capsys, tmp_path, cmd):
    missing = tmp_path / "no-such-artifact"
    args = [cmd, missing] + (["--no-progress"] if cmd == "eval" else [])
    assert run_cli(*args) == 1
    msg = error_line(capsys, cmd)
    assert str(missing) in msg and "not found" in msg


# ------------------------------------------------------------------------------------------------
# 8. eval without data


def test_eval_without_data(capsys, good_artifact):
    assert run_cli("eval", good_artifact, "--windows", "2", "--seqlen", "32", "--no-progress") == 1
    msg = error_line(capsys, "eval")
    assert "--data" in msg


def test_eval_of_a_kv_cache_format_refuses_an_unknown_one_by_name(capsys, good_artifact, text_file):
    assert run_cli("eval", good_artifact, "--data", text_file, "--windows", "2", "--seqlen", "32", "--kv-dtype",
                   "int3", "--no-progress") == 1
    msg = error_line(capsys, "eval")
    assert "--kv-dtype" in msg and "'int3'" in msg and "int8" in msg


def test_eval_of_a_kv_cache_format_reports_its_cost_on_the_same_weights(capsys, good_artifact, text_file):
    import json

    assert run_cli("eval", good_artifact, "--data", text_file, "--windows", "2", "--seqlen", "32", "--kv-dtype",
                   "int8", "--json", "--no-progress") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_dtype"] == "int8" and got["tokens"] == 2 * 31
    assert 0 < got["mean_kl"] < 0.01 and abs(got["delta_ppl_pct"]) < 2


# ------------------------------------------------------------------------------------------------
# 9. usage errors are argparse's, exit 2


@pytest.mark.parametrize(
    "args",
    [
        ["build", "--model", "x"],  # no --scheme
        [],  # no command
        ["verify"],  # no artifact
        ["build", "--scheme", "int8-sym", "--calib-samples", "many"],  # not an int
    ],
    ids=["build-no-scheme", "no-command", "verify-no-artifact", "calib-samples-not-int"],
)
def test_usage_error_exits_2(capsys, args):
    with pytest.raises(SystemExit) as e:
        run_cli(*args)
    assert e.value.code == 2
    assert "usage: quant" in capsys.readouterr().err
