"""The serve settings table (server/settings.py) is the one source of `quant serve`'s flags, the container's
QUANTSERVE_* variables and the settings dataclasses' defaults; `quant serve` is the server's command, which the
pipeline's `quant` only hands over to."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from server import settings
from server.cli import build_parser, config_from_args
from server.config import EngineConfig, Limits
from server.envconfig import VARS, EnvError, serve_argv
from server.serve import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"serve": ServeConfig, "engine": EngineConfig, "limits": Limits}


def _actions():
    return {a.dest: a for a in build_parser()._actions if a.dest != "help"}


@pytest.mark.unit
def test_every_row_is_a_flag_with_its_type_default_and_help():
    actions = _actions()
    assert list(actions) == [s.name for s in settings.SETTINGS]  # nothing else, in the table's order
    for s in settings.SETTINGS:
        a = actions[s.name]
        switch = isinstance(a, argparse.BooleanOptionalAction)  # --name / --no-name
        assert a.option_strings == ([s.flag, "--no-" + s.flag[2:]] if switch else [s.flag] if s.flag else [])
        assert a.default == s.default and s.help in a.help
        assert (bool if switch else a.type or str) is s.type
        assert a.choices == (list(s.choices) if s.choices else None)
    # --api-key and --api-key-file are mutually exclusive
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--api-key", "k", "--api-key-file", "f"])


@pytest.mark.unit
def test_every_row_but_the_key_itself_is_an_environment_variable():
    assert [v.name for v in VARS] == [s.var for s in settings.SETTINGS if s.name != "api_key"]
    assert all(v.name.startswith("QUANTSERVE_") for v in VARS)
    assert settings.BY_NAME["max_batch"].var == "QUANTSERVE_MAX_BATCH"
    assert settings.BY_NAME["grace"].var == "QUANTSERVE_GRACE_SECONDS"
    # each variable becomes its row's flag, and that flag parses back to the variable's value
    env = {"QUANTSERVE_ARTIFACT": "/a", "QUANTSERVE_MAX_BATCH": "3", "QUANTSERVE_GRACE_SECONDS": "2.5",
           "QUANTSERVE_DTYPE": "float32", "QUANTSERVE_GRPC_PORT": "-1", "QUANTSERVE_PREFIX_CACHE": "off"}
    args = build_parser().parse_args(serve_argv(env))
    assert (args.artifact, args.max_batch, args.grace, args.dtype, args.grpc_port) == ("/a", 3, 2.5, "float32", -1)
    assert args.prefix_cache is False and "--no-prefix-cache" in serve_argv(env)
    assert build_parser().parse_args(serve_argv({**env, "QUANTSERVE_PREFIX_CACHE": "1"})).prefix_cache is True
    with pytest.raises(EnvError, match="QUANTSERVE_PREFIX_CACHE must be 1, true"):
        serve_argv({**env, "QUANTSERVE_PREFIX_CACHE": "maybe"})
    assert args.host == "0.0.0.0"  # the container's default, not the command line's


@pytest.mark.unit
@pytest.mark.parametrize("config", settings.CONFIGS)
def test_the_dataclass_fields_are_the_table_rows_with_their_defaults(config):
    cls = CLASSES[config]
    rows = {s.attr: s for s in settings.SETTINGS if s.config == config}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert rows.keys() <= fields.keys()
    for name, s in rows.items():
        f = fields[name]
        if f.default is dataclasses.MISSING:  # ServeConfig.artifact: required in the dataclass
            assert name == "artifact"
            continue
        assert f.metadata.get("setting") == s.name and f.default == s.default, name
        assert s.type.__name__ in str(f.type), (name, f.type)
    # every field that names a setting is that setting's (no row of another config, no stray name)
    assert {f.metadata["setting"] for f in fields.values() if "setting" in f.metadata} == {
        s.name for s in rows.values() if s.name != "artifact"}


@pytest.mark.unit
def test_default_flags_give_the_default_configs():
    cfg = config_from_args(build_parser().parse_args([]), api_key=None)
    assert cfg == ServeConfig(artifact=None)
    assert cfg.engine == EngineConfig() and cfg.limits == Limits()


@pytest.mark.unit
def test_flags_land_in_their_configs():
    args = build_parser().parse_args(["m", "--grpc-port", "-1", "--http-port", "0", "--grace", "3", "--max-batch",
                                      "5", "--dtype", "float32", "--max-prompt-tokens", "100", "--threads", "2"])
    cfg = config_from_args(args, api_key="k")
    assert (cfg.artifact, cfg.grpc_port, cfg.http_port, cfg.grace_s, cfg.api_key) == ("m", None, 0, 3.0, "k")
    assert (cfg.engine.max_batch, cfg.engine.dtype, cfg.engine.threads) == (5, "float32", 2)
    assert cfg.engine.prefix_cache is True
    assert config_from_args(build_parser().parse_args(["--no-prefix-cache"]), None).engine.prefix_cache is False
    assert cfg.limits.max_prompt_tokens == 100


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.e2e
def test_the_pipeline_never_imports_the_server():
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "quant").rglob("*.py") for m in _imports(p)
           if m == "server" or m.startswith("server.")}
    assert not bad, bad
    # `quant`'s one reference to the server is the name of the command it hands over, imported when it runs
    code = ("import sys, quant.cli; quant.cli._build_parser().parse_args(['verify', 'x']); "
            "bad = [m for m in sys.modules if m == 'server' or m.startswith('server.')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.unit
def test_quant_lists_serve_and_hands_it_over(capsys):
    from quant.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: quant serve") and "--max-prefill-tokens" in out
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-such-flag"])
    assert e.value.code == 2 and "quant serve: error: unrecognized arguments" in capsys.readouterr().err
