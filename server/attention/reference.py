"""The eager reference of attention over cached keys: one request, explicit scores, masks and softmax.

Every backend is held to this in the tests (sliding windows and soft-capping included), and the sdpa backend
runs it itself for soft-capped layers, which SDPA cannot express.
"""

from __future__ import annotations

import torch
from torch import Tensor

from server.attention.base import AttentionSpec


def visible(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """(Tq, Tk) bool: causal, and within the sliding window when there is one (kv > q - window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, spec: AttentionSpec) -> Tensor:
    """q (Tq, H, D) at positions q_pos (Tq,); k, v (Tk, Hkv, D) at k_pos (Tk,) -> (Tq, H, D).

    As transformers' eager attention: scores in the input dtype, soft-capped, masked, softmax in fp32 and cast
    back, then the weighted sum of v."""
    qh = q.transpose(0, 1)  # (H, Tq, D)
    kh = k.transpose(0, 1).repeat_interleave(spec.group, dim=0)  # (H, Tk, D)
    vh = v.transpose(0, 1).repeat_interleave(spec.group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * spec.scale  # (H, Tq, Tk)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~visible(q_pos, k_pos, spec.window)[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)  # (Tq, H, D)
