"""Static checks of the source that no CPU test executes: bench/gpu.py, tests/test_cuda.py and the CUDA branches
of the engine run only on a lent GPU, where a name error would cost the lease's one run (15 minutes, start
included). ruff's pyflakes rules read every file without running it."""

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra")
def test_no_undefined_or_unused_names_anywhere():
    # F821/F822/F823: undefined names (in code, in __all__, a local read before it is bound); F401/F841: unused
    # imports and locals, which hide a name meant to be used. The generated gRPC stubs are left as grpcio-tools
    # writes them.
    got = subprocess.run(["ruff", "check", "--no-cache", "--select", "F821,F822,F823,F401,F841",
                          "--exclude", "*_pb2*.py", "quant", "server", "clients", "bench", "scripts", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-1000:]
