"""The C++ extensions' builder (quant/runtime/kernels/native.py): one build per set of sources and CPU, whichever
checkout asks for it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quant.runtime.kernels import native

pytestmark = [pytest.mark.e2e]  # runs the compiler

SOURCE = """#include <torch/library.h>
static int64_t answer() { return %d; }
TORCH_LIBRARY(qs_native_test_%d, m) { m.def("answer() -> int", &answer); }
"""


def _checkout(root, value: int):
    (root / "csrc").mkdir(parents=True)
    src = root / "csrc" / "ops.cpp"
    src.write_text(SOURCE % (value, value))
    return src


def test_checkouts_of_the_same_sources_share_one_build_and_changed_sources_get_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    first = native.Extension(_checkout(tmp_path / "a", 1), "qs_native_test")
    if not first.load():
        pytest.skip(f"no C++ toolchain here: {first.unavailable_reason()}")
    assert torch.ops.qs_native_test_1.answer() == 1
    where = first.build_directory()
    (lib,) = where.glob("*.so")
    built = {p.name: p.stat().st_mtime_ns for p in (lib, where / "build.ninja")}

    # Another checkout of the same bytes, in a process of its own (torch's builder skips a build it has done in this
    # one): the same dir, nothing rebuilt.
    code = ("import sys; from pathlib import Path; from quant.runtime.kernels import native\n"
            "e = native.Extension(Path(sys.argv[1]), 'qs_native_test')\n"
            "assert e.load(), e.unavailable_reason()\n"
            "print(e.build_directory())")
    run = subprocess.run([sys.executable, "-c", code, str(_checkout(tmp_path / "b", 1))], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(where)
    assert {p.name: p.stat().st_mtime_ns for p in (lib, where / "build.ninja")} == built, "rebuilt"

    assert native.Extension(_checkout(tmp_path / "c", 2), "qs_native_test").build_directory() != where  # changed


def test_quant_kernels_builds_each_library_or_says_why_it_holds_none(capsys, monkeypatch):
    """`quant kernels` (scripts/setup.sh runs it) loads every C++ library the engine uses, building what is not built
    for this CPU yet, and names where each is; a library that cannot be built, or would hold no kernel here, is named
    with the reason, and that is no failure (the engine then uses the PyTorch references)."""
    from conftest import run_cli

    from quant.runtime.kernels import gemm
    from server import native_build

    assert run_cli("kernels") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(native_build.LIBRARIES) == 4
    for (what, ext, skip), line in zip(native_build.LIBRARIES, lines):
        name = native_build.label(what, ext)
        assert line.startswith(f"{name}: ")
        why = None if skip is None else skip()
        if why is not None:  # no kernel for this CPU: not built
            assert line == f"{name}: not built ({why})"
        elif ext.load():
            assert f": built in {ext.build_directory()} (" in line
        else:
            assert line.endswith(f"not built ({ext.unavailable_reason()}); the engine uses the PyTorch references")
    _, ext, _ = native_build.LIBRARIES[0]
    monkeypatch.setattr(ext, "load", lambda: False)
    monkeypatch.setattr(ext, "unavailable_reason", lambda: "RuntimeError: no compiler")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert gemm.no_kernel_reason() is not None
    assert run_cli("kernels") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("weight rows (quant/runtime/kernels/csrc: rows_ops, int4_a8_ops): not built "
                        "(RuntimeError: no compiler); the engine uses the PyTorch references")
    assert lines[2] == ("tiled products (quant/runtime/kernels/csrc: gemm_ops): not built (PyTorch dispatches to "
                        "DEFAULT here; the tiled products have AVX2 and AVX-512 kernels only)")
