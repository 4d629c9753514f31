"""The attention-backend interface: what the models call and what a backend (sdpa, a paged Triton kernel, ...)
implements.

Per step the backend prepares its metadata once (``prepare``: gathers, masks, block tables on the device,
whatever it reads), then each layer calls ``forward(q, k, v, layer, meta)`` with rotated q and k (the models call
``forward_rotary``, which rotates them first, or fuses that with the cache write): the backend writes k and v into
its cache at the step's slots and returns the attention output. The cache is the KV
pool's storage; the backend states the layout it reads (``kv_shape``), so the models never see it. A backend is
built as ``cls(kv_storage, block_size, specs, ops, kv_scales=None, kv_rotation=(0, 0))``: with ``kv_scales`` (the
pool's float16 scale per token per KV head) the storage holds int8 or fp8 codes, which the backend quantizes as it
writes and dequantizes as it reads (keys and values rotated in blocks of ``kv_rotation``'s channels where > 0), or
it refuses them when it is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor

from server.batch import StepInputs


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention needs of the backend."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # multiplies q·k (1/sqrt(head_dim) unless the model says otherwise)
    window: int | None = None  # sliding window: the query at position i sees keys j with i - window < j <= i
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before masking (Gemma 2)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class AttentionBackend(ABC):
    """A backend over the paged KV pool. ``features`` says which AttentionSpec fields it implements; a model
    whose layers need more is refused when the backend is chosen, not run wrong."""

    name: str
    features: frozenset[str] = frozenset()  # of {"window", "softcap"}

    @staticmethod
    @abstractmethod
    def kv_shape(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of the pool storage this backend reads and writes."""

    @abstractmethod
    def prepare(self, step: StepInputs):
        """Per-step metadata, built once and handed to every layer's forward."""

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: int, meta) -> Tensor:
        """q (T, H, D), k and v (T, Hkv, D), rotated: store k/v at the step's slots in layer ``layer``'s cache
        and return the attention output (T, H, D)."""

    def forward_rotary(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, layer: int, meta,
                       norms: tuple | None = None) -> Tensor:
        """:meth:`forward` on q and k before their rotary embedding (cos, sin: (T, R)), which is applied first, in
        place, by the glue ops; a backend may fuse it with its K/V write. ``norms``: (q_norm, k_norm), RMSNorms over
        each head (server.layers.norm.RMSNorm) that q and k take before the rotary (Qwen3, Gemma 3), which a backend
        may fuse too."""
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        self.ops.rope_(q, k, cos, sin)
        return self.forward(q, k, v, layer, meta)

    def decode_qkv(self, qkv: Tensor, heads: int, cos: Tensor, sin: Tensor, layer: int, meta) -> Tensor | None:
        """:meth:`forward_rotary` of a step whose rows all decode, from the fused qkv projection's output
        (T, (H + 2 Hkv) D), in one call where the backend has one: the attention output (T, H * D); None where it
        has not (the caller splits qkv and calls :meth:`forward_rotary`)."""
        return None

    def programmable(self, meta) -> bool:
        """Whether a step with this metadata dispatches the same ops as every step of its shape (decode rows, chunk
        lengths, sampled rows), whatever changes from step to step reaching them as tensors: a CPU step graph may
        then replay it (server/cpu_graphs.py)."""
        return False

    @classmethod
    def unsupported(cls, specs: list[AttentionSpec]) -> str | None:
        """Why this backend cannot run layers with these specs, or None."""
        for i, s in enumerate(specs):
            for feature in ("window", "softcap"):
                if getattr(s, feature) is not None and feature not in cls.features:
                    return f"layer {i} needs attention feature {feature!r}, which the {cls.name} backend lacks"
            if s.heads % s.kv_heads:
                return f"layer {i}: {s.heads} query heads do not divide into {s.kv_heads} KV heads"
        return None
