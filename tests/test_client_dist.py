"""The client as its own distribution: ``pip install ./clients`` into a fresh venv (no system site-packages)
installs no torch, transformers or server, and its commands run there against a real server on loopback.

Needs the package index (the venv installs grpcio, protobuf, httpx, rich and, for ``plot``, matplotlib); pip's
cache makes repeated runs quick."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import start

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    # A copy, not editable: what a user gets from the directory alone.
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"{ROOT / 'clients'}[plot]"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return where


@pytest.fixture(scope="module")
def server(tiny_model_dir, cache_dir):
    s = start(tiny_model_dir, cache_dir)
    yield s
    s.shutdown()


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # No PYTHONPATH: only what the venv has.
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(venv / "bin" / "quant-client"), *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def test_the_client_installs_alone_without_torch(venv):
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], capture_output=True,
                       text=True, check=True, timeout=120)
    names = {d["name"].lower() for d in json.loads(r.stdout)}
    assert "quantserve-client" in names
    assert not names & {"torch", "transformers", "quantserve", "safetensors", "accelerate", "fastapi"}, names
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True, text=True,
                           timeout=60, cwd=venv)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr


def test_every_command_runs_from_the_client_venv(venv, server, tmp_path):
    grpc_t, http_t = ["--target", server.grpc_target], ["--http", "--target", server.http.removeprefix("http://")]
    assert run(venv, "--help", cwd=tmp_path).returncode == 0

    gen = run(venv, "generate", "The river", "--seed", "3", "--max-new-tokens", "6", *grpc_t, cwd=tmp_path)
    assert gen.returncode == 0 and "6 tokens" in gen.stderr, gen.stderr
    stream = run(venv, "stream", "The river", "--seed", "3", "--max-new-tokens", "6", *http_t, cwd=tmp_path)
    assert stream.returncode == 0, stream.stderr
    assert stream.stdout == gen.stdout  # same seed, same text over either transport

    sweep = run(venv, "sweep", "Once", "--temperature", "0,1.0", "--top-p", "1.0,0.5", "--seeds", "2",
                "--max-new-tokens", "4", "--json", "sweep.json", *grpc_t, cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    trace = run(venv, "trace", "The capital", "--temperature", "0.8", "--top-k", "5", "--max-new-tokens", "2",
                "--seed", "1", "--json", "trace.json", *grpc_t, cwd=tmp_path)
    assert trace.returncode == 0, trace.stderr
    for args, out in ((["--sweep", "sweep.json", "--metric", "distinct_2"], "d2.png"),
                      (["--trace", "trace.json", "--step", "0"], "step0.png")):
        p = run(venv, "plot", *args, "--out", out, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = run(venv, "generate", "x", "--top-p", "2", *grpc_t, cwd=tmp_path)
    assert bad.returncode == 3 and bad.stderr.startswith("error: invalid_argument: top_p"), bad.stderr
