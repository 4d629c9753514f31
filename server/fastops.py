"""Fused CPU ops for the engine's per-layer glue, and the plain PyTorch reference of each.

A batch-1 decode step of the default model runs ~40 small tensor ops per layer around the four matmuls; on
CPU each costs a few microseconds of dispatch however small it is, which added up to a third of the step
(bench/RESULTS.md, session 3). ``server/csrc/decode_ops.cpp`` does the same arithmetic in a few calls per
layer: the residual add with the next RMSNorm, rotary embedding in place (partial rotary included), the K/V
cache write of the sdpa backend, and the gated activations (SiLU·up, GELU-tanh·up).

The C++ source is compiled on first use with torch's extension builder (needs a C++ compiler; ~15 s, cached
under torch's extensions dir). Where it cannot be built, :func:`load` says why and the runner uses the
references below, which are the eager ops it replaces; tests hold the two to each other.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("quantserve.fastops")

_SOURCE = Path(__file__).with_name("csrc") / "decode_ops.cpp"
# -march=native: the kernels' loops are vectorised for this CPU (AVX-512 where it has it); -fopenmp-simd: the
# ``omp simd`` loops (reductions) vectorise without linking an OpenMP runtime; -ffp-contract=off: no a*b+c fused
# into one rounding, so each product rounds where the eager op it replaces rounds (the tests compare to ulps).
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off"]
_lock = threading.Lock()
_state: dict[str, str | bool] = {}


def load() -> bool:
    """Compile (once per machine) and register ``torch.ops.quantserve``; False, with the reason logged and
    kept in :func:`unavailable_reason`, when that is not possible here."""
    with _lock:
        if "ok" not in _state:
            try:
                _build()
                _state["ok"] = True
            except Exception as e:  # no compiler, no ninja, a read-only home: fall back to the references
                _state["ok"] = False
                _state["why"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log.warning("fused CPU ops unavailable (%s); using the eager reference ops", _state["why"])
        return bool(_state["ok"])


def build_directory() -> Path:
    """Where the extension is built: torch's extensions root (``TORCH_EXTENSIONS_DIR`` when set), one dir per
    source hash, Python and torch version. Named by the source's hash so checkouts of different versions (a
    bench baseline's worktree) each keep their own build instead of rebuilding one shared name in turn; the hash
    covers the CPU's instruction-set flags too, because the code is compiled for the CPU that builds it
    (``-march=native``), and a build dir shared with another machine (a home on NFS, an image built elsewhere)
    must not hand this CPU instructions it lacks."""
    import os
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(_SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"quantserve_decode_ops_{digest}-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"


def _build() -> None:
    """torch's builder serialises processes with a ``lock`` file that only the process holding it removes: one
    killed while building (Ctrl-C on a first start, an OOM kill) leaves it behind, and every later start waited
    on it forever. Here builds are serialised by an flock, which the kernel releases when its holder dies, and a
    ``lock`` file found while holding the flock is such a leftover (any live builder of this dir holds the flock),
    so it is removed before building."""
    import fcntl

    from torch.utils.cpp_extension import load as build

    where = build_directory()
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "quantserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        stale = where / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        build(name=where.name.split("-")[0], sources=[str(_SOURCE)], extra_cflags=_CFLAGS, build_directory=str(where),
              is_python_module=False, verbose=False)


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), the compiler's target for -march=native."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def unavailable_reason() -> str | None:
    return None if _state.get("ok", True) else str(_state.get("why"))


# ---------------------------------------------------------------------------------------- references

def ref_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: normalise in fp32, cast back, then the weight."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def ref_add_rms_norm(x: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = x + delta
    return x, ref_rms_norm(x, w, eps)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """In place: q (T, H, D), k (T, Hkv, D), cos/sin (T, R), R <= D: rotate the first R dims of every head
    (HF's rotate-half convention; R < D is partial rotary) and leave the rest."""
    R = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]  # (T, 1, R)
    for x in (q, k):
        r = x[..., :R]
        r.copy_(r * c + rotate_half(r) * s)


def ref_store_kv(k: Tensor, v: Tensor, kv: Tensor, slots: Tensor) -> None:
    """k, v (T, Hkv, D) into their slots of one layer's cache kv (2, slots, Hkv, D)."""
    kv[0].index_copy_(0, slots, k)
    kv[1].index_copy_(0, slots, v)


def ref_silu_mul(gate_up: Tensor) -> Tensor:
    g, u = gate_up.chunk(2, dim=-1)  # (T, I) each
    return F.silu(g) * u


def ref_gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    g, u = gate_up.chunk(2, dim=-1)  # (T, I) each
    return F.gelu(g, approximate="tanh") * u


def ref_decode_attention(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, block_size: int, window: int,
                         scale: float, softcap: float) -> Tensor:
    """Decode rows' attention over one layer's paged cache, row by row in fp32: q (B, H, D), kv (2, slots, Hkv, D),
    block_table (B, blocks), lens (B,): row b attends to its keys at positions [max(0, len - window), len)
    (window <= 0: all), scores soft-capped when softcap > 0; the output rounded once to q's dtype."""
    B, H, D = q.shape
    Hkv = kv.shape[2]
    out = q.new_empty(B, H, D)
    for b in range(B):
        L = int(lens[b])
        pos = torch.arange(max(0, L - window) if window > 0 else 0, L)
        slots = block_table[b, pos // block_size] * block_size + pos % block_size
        k = kv[0, slots].float().repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        v = kv[1, slots].float().repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # (H, n)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


class Ops:
    """The glue ops, fused or reference; the layers and the sdpa backend call these and do not care which."""

    def __init__(self, fused: bool):
        self.fused = fused
        if fused:
            ops = torch.ops.quantserve
            self.rms_norm = ops.rms_norm.default
            self.add_rms_norm = ops.add_rms_norm.default
            self.rope_ = ops.rope_.default
            self.store_kv = ops.store_kv.default
            self.silu_mul = ops.silu_mul.default
            self.gelu_tanh_mul = ops.gelu_tanh_mul.default
            self.decode_attention = ops.decode_attention.default
        else:
            self.rms_norm = ref_rms_norm
            self.add_rms_norm = ref_add_rms_norm
            self.rope_ = ref_rope_
            self.store_kv = ref_store_kv
            self.silu_mul = ref_silu_mul
            self.gelu_tanh_mul = ref_gelu_tanh_mul
            self.decode_attention = ref_decode_attention
