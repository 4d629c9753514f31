"""Rotary position embedding: the frequency tables of the rope types transformers ships for our architectures,
and the rotation itself (fused in place, or the eager reference; ``server.fastops``).

Frequencies come from ``config.rope_parameters`` (per layer type where a model has several, as Gemma 3's
sliding and global layers). ``default`` is computed here; the scaled types (linear, llama3, yarn, longrope)
through transformers' own ``ROPE_INIT_FUNCTIONS``, so they are its numbers exactly. ``partial_rotary_factor``
rotates only the first part of each head. LongRoPE (Phi-3) switches to the long factors for tokens at or past
the original context, per token as vLLM does; transformers switches the whole forward's table once a sequence
passes it, which differs only for the prompt tokens before that point. Dynamic NTK scaling recomputes its
table as a sequence grows and is not served.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quant.errors import UnsupportedModelError

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    rp = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = dict(rp[layer_type])
    if "rope_theta" not in rp and hasattr(config, "rope_theta"):
        rp["rope_theta"] = config.rope_theta
    return rp


class Rotary:
    """cos/sin tables for a step's positions; one per distinct rope setting of a model."""

    def __init__(self, config, head_dim: int, layer_type: str | None = None):
        rp = rope_parameters(config, layer_type)
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in SUPPORTED_ROPE:
            raise UnsupportedModelError(
                f"rope type {kind!r} is not served (supported: {', '.join(SUPPORTED_ROPE)})")
        self.long_from: int | None = None
        self.long_inv: Tensor | None = None
        if kind == "default":
            dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
            self.inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # (R/2,)
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kw = {"layer_type": layer_type} if layer_type is not None else {}
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](config, None, **kw)
            if kind == "longrope":
                self.long_from = int(rp["original_max_position_embeddings"])
                self.long_inv, _ = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=self.long_from + 1, **kw)
        self.inv_freq = self.inv_freq.float()
        self.rot_dim = 2 * self.inv_freq.shape[0]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (T,) -> cos, sin (T, R) in ``dtype``: transformers' arithmetic (fp32 angles, then cast)."""
        if self.inv_freq.device != positions.device:  # moved once: a per-step host-to-device copy would synchronise
            self.inv_freq = self.inv_freq.to(positions.device)
            self.long_inv = None if self.long_inv is None else self.long_inv.to(positions.device)
        inv = self.inv_freq[None, :]  # (1, R/2)
        if self.long_inv is not None:
            inv = torch.where((positions >= self.long_from)[:, None], self.long_inv[None, :], inv)
        freqs = positions[:, None].float() * inv  # (T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, R)
        return (emb.cos() * self.scaling).to(dtype).contiguous(), (emb.sin() * self.scaling).to(dtype).contiguous()
