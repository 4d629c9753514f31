"""Attention backends behind one interface (``base.AttentionBackend``): prepare per-step metadata once, then
``forward(q, k, v, layer, meta)`` per layer; each backend states its KV layout and the features it implements
(sliding windows, soft-capping). ``reference`` is the eager masked softmax every backend is held to.

Adding a backend is one file here and one entry in ``BACKENDS``; ``choose`` picks per device and reports what
it chose (ModelInfo.attention and the engine's log line).
"""

from __future__ import annotations

import torch

from server.attention import triton_paged
from server.attention.base import AttentionBackend, AttentionSpec
from server.attention.int4 import Int4Backend
from server.attention.sdpa import SdpaBackend
from server.attention.triton_paged import TritonBackend

BACKENDS: dict[str, type[AttentionBackend]] = {SdpaBackend.name: SdpaBackend, TritonBackend.name: TritonBackend,
                                               Int4Backend.name: Int4Backend}


def choose(device: torch.device) -> type[AttentionBackend]:
    """The backend for a device: the paged Triton kernel on CUDA where Triton imports, else ``sdpa`` (every
    device; on a CPU its decode rows go through the fused C++ kernel). ``int4`` reads only an int4 KV pool: the
    runner takes it for one."""
    if torch.device(device).type == "cuda" and triton_paged.available() is None:
        return TritonBackend
    return SdpaBackend


__all__ = ["AttentionBackend", "AttentionSpec", "BACKENDS", "Int4Backend", "choose"]
