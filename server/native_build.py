"""`quant kernels`: the C++ CPU kernels built for this CPU now, and which are built.

Each library (``quant.runtime.kernels.native.Extension``) is otherwise compiled at its first use, for the CPU, Python,
torch and sources at hand (~15-60 s each on 2 cores, ~2 min in all), inside whatever first needs it: an engine's start,
a build, a test. ``scripts/setup.sh`` runs this once, so none of those waits. A library that cannot be built here (no
C++ compiler, a read-only home) is named with the reason and the engine uses its PyTorch references, as at first use:
that is not an error (exit 0).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from quant.runtime.kernels import dequant, gemm, rows
from quant.runtime.kernels.native import Extension
from server import fastops

# (what it is, the library, what says why it holds no kernel here without building it, if anything)
LIBRARIES: list[tuple[str, Extension, Callable[[], str | None] | None]] = [
    ("weight rows", rows.EXTENSION, None),
    ("dequantizers", dequant.EXTENSION, None),
    ("tiled products", gemm.EXTENSION, gemm.no_kernel_reason),
    ("engine glue and attention", fastops.EXTENSION, None),
]
ROOT = Path(__file__).resolve().parents[1]


def label(what: str, ext: Extension) -> str:
    """A library as the command names it: what it is, then its sources (``what (dir: file, file)``)."""
    dirs = sorted({str(s.parent.relative_to(ROOT)) if s.parent.is_relative_to(ROOT) else str(s.parent)
                   for s in ext.sources})
    return f"{what} ({', '.join(dirs)}: {', '.join(s.stem for s in ext.sources)})"


def main(argv: list[str] | None = None, prog: str = "quant kernels") -> int:
    argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]).parse_args(argv)
    for what, ext, skip in LIBRARIES:
        named = label(what, ext)
        why = None if skip is None else skip()
        if why is not None:
            print(f"{named}: not built ({why})")
            continue
        t = time.perf_counter()
        if ext.load():
            print(f"{named}: built in {ext.build_directory()} ({time.perf_counter() - t:.1f} s)")
        else:
            print(f"{named}: not built ({ext.unavailable_reason()}); the engine uses the PyTorch references")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
