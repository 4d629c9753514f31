"""The plain reference of the sampler: steps 1-7 of server/sampling.py and step 8's renormalisation, written out
for one row, with no batching, no host flags and no shared sort.

Nothing that serves requests imports this module; the tests hold the batched fast path equal to it
(``reference_filter`` against ``sampling.filtered_probs``, and each ``ref_*`` against the fast op it names). Each
function does one step, in the documented order, on a (V,) fp32 row.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from server.sampling_params import SamplingParams


def ref_logit_bias(row: Tensor, bias) -> Tensor:
    """Step 1 for one (V,) row: each (id, bias) pair added to its logit. Fast op: ``sampling.apply_logit_bias``."""
    out = row.clone()
    for t, b in bias:
        if 0 <= t < out.shape[0]:
            out[t] = out[t] + b
    return out


def ref_penalty(row: Tensor, history, penalty: float) -> Tensor:
    """Step 2 for one (V,) row: each distinct id seen once, divided if positive else multiplied. Fast op:
    ``sampling.apply_penalty``."""
    out = row.clone()
    for t in {int(i) for i in history}:
        if 0 <= t < out.shape[0]:
            # fp32 tensor arithmetic (not Python doubles), so results round exactly as transformers' do
            out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def ref_presence_frequency(row: Tensor, generated, presence: float, frequency: float) -> Tensor:
    """Step 3 for one (V,) row, as OpenAI documents it: ``mu[j] - c[j] * frequency - (c[j] > 0) * presence``.
    Fast op: ``sampling.apply_presence_frequency``."""
    out = row.clone()
    counts: dict[int, int] = {}
    for t in generated:
        counts[int(t)] = counts.get(int(t), 0) + 1
    for t, c in counts.items():
        if 0 <= t < out.shape[0]:
            out[t] = out[t] - c * frequency - presence
    return out


def ref_unpack(mask_row, vocab: int) -> list[bool]:
    """The structured-output mask of one row (step 3's end), plainly: bit t % 32 of word t // 32 allows token t.
    Fast op:
    ``sampling.unpack_bitmask``."""
    return [bool((int(mask_row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)]


def ref_temperature(row: Tensor, temperature: float) -> Tensor:
    """Step 4 for one (V,) row (T > 0)."""
    return row / temperature  # (V,)


def ref_min_p(row: Tensor, min_p: float) -> Tensor:
    """Step 5 for one (V,) row of tempered logits: drop what is less probable than min_p x the most probable."""
    if min_p == 0.0:
        return row
    probs = torch.softmax(row, -1)  # (V,)
    return row.masked_fill(probs < min_p * probs.max(), -math.inf)  # (V,)


def ref_top_k(row: Tensor, k: int) -> Tensor:
    """Step 6 for one (V,) row: below the k-th highest logit to -inf (ties with it kept)."""
    if k == 0 or k >= row.shape[0]:
        return row
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return row.masked_fill(row < kth, -math.inf)  # (V,)


def ref_top_p(row: Tensor, p: float) -> Tensor:
    """Step 7 for one (V,) row: the smallest most-probable-first prefix whose mass reaches p kept."""
    if p >= 1.0:
        return row
    probs = torch.softmax(row, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    keep, total = [], 0.0
    for i in order:  # grow the prefix until it reaches p; the crossing token is kept
        keep.append(i)
        total += probs[i]
        if total >= p:
            break
    mask = torch.ones_like(row, dtype=torch.bool)
    mask[keep] = False
    return row.masked_fill(mask, -math.inf)  # (V,)


def reference_filter(logits_row: Tensor, params: SamplingParams, history=None, prompt_len: int = 0,
                     allowed_row=None) -> Tensor:
    """The (V,) distribution that steps 1-8 sample from, computed plainly for one request. ``history``: its prompt
    and generated ids; ``prompt_len``: how many of them are the prompt's; ``allowed_row``: its grammar's bitmask
    row ((ceil(V / 32),) int32), if it has one. Fast op: ``sampling.filtered_probs``."""
    x = ref_logit_bias(logits_row.float(), params.logit_bias)
    history = list(history or [])
    if params.repetition_penalty != 1.0:
        x = ref_penalty(x, history, params.repetition_penalty)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        x = ref_presence_frequency(x, history[prompt_len:], params.presence_penalty, params.frequency_penalty)
    if allowed_row is not None:
        x = x.masked_fill(~torch.tensor(ref_unpack(allowed_row, x.shape[0])), -math.inf)
    if params.temperature == 0.0:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1.0
        return out
    x = ref_temperature(x, params.temperature)
    x = ref_top_p(ref_top_k(ref_min_p(x, params.min_p), params.top_k), params.top_p)
    return torch.softmax(x, -1)
