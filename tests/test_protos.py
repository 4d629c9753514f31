"""The committed gRPC stubs are exactly what scripts/gen_protos.sh generates from protos/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh, "nothing generated"
    for rel in fresh:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is generated but not committed"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} differs from protos/: run scripts/gen_protos.sh and commit the result")


def test_stubs_import_without_torch():
    code = ("import sys; import quantserve.v1.inference_pb2_grpc; "
            "assert 'torch' not in sys.modules, 'the stubs pulled in torch'")
    subprocess.run(["python", "-c", code], check=True, cwd=ROOT)
