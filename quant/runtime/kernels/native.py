"""The project's C++ CPU kernels: compiled on first use with torch's extension builder, per machine.

An :class:`Extension` is one library of C++ sources registering ``torch.ops`` (``quant/runtime/kernels/csrc``: the weight dequantizers;
``server/csrc``: the engine's glue ops). It is built once per set of sources, CPU, Python and torch (~15 s, needs a C++
compiler) under torch's extensions root and loaded into the process; where it cannot be built, ``load`` says
why (kept in ``unavailable_reason``) and the callers use their plain PyTorch references, which the tests hold
the kernels to.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("quantserve.native")

# Headers shared by the sources (elements.h: the dtype conversions of the vectorised loops); on every build's
# include path and in every build dir's hash.
INCLUDE = Path(__file__).with_name("csrc")

# -march=native: the loops are vectorised for the CPU that builds them (AVX-512 where it has it); -fopenmp: ATen's
# ``at::parallel_for`` is header code that runs its range serially unless the including source is compiled with
# OpenMP (without it every kernel here ran on one thread whatever ``torch.set_num_threads`` said), and the ``omp
# simd`` loops (reductions) vectorise; the runtime linked is libgomp.so.1, the soname torch has already loaded, so
# one OpenMP runtime and one thread pool serve both; -ffp-contract=off: no a*b+c fused into one rounding, so each
# product rounds where the eager op it replaces rounds (the tests compare ulps); -fno-trapping-math: the compiler may
# evaluate both sides of a float select (exp_approx's clamps, bf16's NaN rounding), which is what lets it vectorise
# a loop with them (without it the activation and decode-softmax loops ran scalar, ~10 ns an element); the values
# are the same, only floating-point exception flags, which nothing here reads, may differ.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)


def isa_cap() -> tuple[str, ...]:
    """Flags that hold -march=native to the vector ISA ATen dispatches to in this process: a CPU with AVX-512
    running with ``ATEN_CPU_CAPABILITY=avx2`` (how a user caps it, and how the benches imitate an AVX2-only CPU)
    gets kernels without AVX-512 too, so ours and ATen's are measured on the same instructions."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX2" and "avx512f" in cpu_flags().split():
        return ("-mno-avx512f",)  # every AVX-512 subset depends on it
    if cap in ("DEFAULT", "NO AVX") and "avx" in cpu_flags().split():
        return ("-mno-avx",)
    return ()


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), what -march=native compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Extension:
    """One library of C++ sources, built and loaded at most once per process."""

    def __init__(self, sources: Path | list[Path], name: str):
        self.sources = [sources] if isinstance(sources, Path) else list(sources)
        self.name = name
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._why: str | None = None

    def load(self) -> bool:
        """Compile (once per machine) and register the source's ops; False, with the reason logged and kept in
        :meth:`unavailable_reason`, when that is not possible here."""
        with self._lock:
            if self._ok is None:
                try:
                    self._build()
                    self._ok = True
                except Exception as e:  # no compiler, no ninja, a read-only home: the callers use the references
                    self._ok = False
                    msg = str(e).strip()
                    self._why = f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
                    log.warning("%s unavailable (%s); using the PyTorch references", self.name, self._why)
            return self._ok

    def unavailable_reason(self) -> str | None:
        return None if self._ok in (None, True) else self._why

    def build_directory(self) -> Path:
        """Torch's extensions root (``TORCH_EXTENSIONS_DIR`` when set), one dir per source (and header) hash, Python and torch.
        Named by the source's hash so checkouts of different versions (a bench baseline's worktree) each keep their
        own build instead of rebuilding one shared name in turn; the hash covers the CPU's flags too, because the
        code is compiled for the CPU that builds it, and a build dir shared with another machine (a home on NFS,
        an image built elsewhere) must not hand this CPU instructions it lacks. Checkouts of the same sources share
        one build: it compiles copies of them kept in the dir (:meth:`_stage`)."""
        from torch.utils.cpp_extension import get_default_build_root

        headers = b"".join(h.read_bytes() for d in self._dirs() for h in sorted(d.glob("*.h")))
        flags = " ".join(CFLAGS + isa_cap() + LDFLAGS + (cpu_flags(),))
        digest = hashlib.sha256(b"".join(s.read_bytes() for s in self.sources) + headers + flags.encode())
        digest = digest.hexdigest()
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        return Path(root) / (f"{self.name}_{digest[:12]}-py{sys.version_info[0]}{sys.version_info[1]}"
                             f"-torch{torch.__version__}")

    def _build(self) -> None:
        """torch's builder serialises processes with a ``lock`` file that only the process holding it removes: one
        killed while building (Ctrl-C on a first start, an OOM kill) leaves it behind, and every later start
        waited on it forever. Here builds are serialised by an flock, which the kernel releases when its holder
        dies, and a ``lock`` file found while holding the flock is such a leftover (any live builder of this dir
        holds the flock), so it is removed before building."""
        import fcntl

        from torch.utils.cpp_extension import load as build

        where = self.build_directory()
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "quantserve.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
            stale = where / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink()
            sources, include = self._stage(where / "src")
            build(name=where.name.split("-")[0], sources=sources, extra_cflags=list(CFLAGS + isa_cap()),
                  extra_ldflags=list(LDFLAGS), extra_include_paths=[include], build_directory=str(where),
                  is_python_module=False, verbose=False)

    def _dirs(self) -> list[Path]:
        """The shared headers' dir and the sources' own (their headers beside them), in a fixed order."""
        return sorted({INCLUDE, *(s.parent for s in self.sources)})

    def _stage(self, root: Path) -> tuple[list[str], str]:
        """Copies of the sources and headers under ``root`` (dir i of :meth:`_dirs` as ``root/i``), written where
        missing or different; the staged sources and include dir. torch's builder writes the paths it is given
        into the build's ninja file, and ninja rebuilds whatever that file's commands changed: compiling the
        checkout's own files, a second checkout of the same sources (a fresh clone, a bench's baseline worktree)
        rebuilt this dir from scratch (~70 s for the four libraries) each time the two alternated."""
        dirs = self._dirs()
        for i, d in enumerate(dirs):
            files = sorted(d.glob("*.h")) + [s for s in self.sources if s.parent == d]
            (root / str(i)).mkdir(parents=True, exist_ok=True)
            for f in files:
                dest, data = root / str(i) / f.name, f.read_bytes()
                if not dest.is_file() or dest.read_bytes() != data:  # the same bytes keep their mtime: ninja's test
                    tmp = dest.with_name(f".{f.name}.tmp")
                    tmp.write_bytes(data)
                    tmp.replace(dest)
        staged = [str(root / str(dirs.index(s.parent)) / s.name) for s in self.sources]
        return staged, str(root / str(dirs.index(INCLUDE)))
