"""Quality of a quantized model against its base on the same fixed windows.

Per window, the base logits are computed once and every candidate is compared with them:
perplexity (next-token NLL over all predicted positions), mean KL(base || candidate) of the
next-token distributions, and top-1 agreement (argmax equal).

Models loaded in float64 (`quant eval`'s default) compute every quantized Linear by its reference path in float64
(quant.runtime.linear): the weights and the int8 activations are exact there and only sums round, at ~1e-16, so a rounding
to the int8 grid, and with it the report, comes out the same whatever the CPU's vector width, kernels or threads.
In fp32 the serving kernels run, and their sums' order (which the CPU decides) flips a few of the activations'
roundings: enough to move Δppl by 0.29 point between an AVX-512 and an AVX2 CPU (bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from quant.build.calibration import TokenWindows
from quant.build.progress import track
from quant.runtime.primitives import compute_dtype


@dataclass(frozen=True)
class Quality:
    ppl: float
    base_ppl: float
    delta_ppl_pct: float
    mean_kl: float
    top1_agreement: float
    tokens: int
    # The standard error of delta_ppl_pct over the windows (their per-token NLL differences' spread / sqrt(W)):
    # how far another sample of text of this size would put it. None with one window.
    delta_ppl_se_pct: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class KVCacheView:
    """``model`` with its attention reading K and V back as a KV cache of format or dtype ``kv`` holds them
    (quant.runtime.kv_quant.held; keys as attention sees them, after the rotary embedding), called as
    :func:`compare` calls a model: the quality cost of a KV cache choice on top of the weights, against a view of
    the same weights. Attention itself is transformers' SDPA, or for a format with a residual (each query reads
    its own group's positions from the residual) kv_quant.attend_held."""

    def __init__(self, model, kv: str):
        if getattr(model.config, "attn_logit_softcapping", None):
            raise ValueError("a KV cache view of a model with attention soft-capping is not supported (SDPA has none)")
        self.model, self.kv = model, kv
        self.impl = _register_kv_attention(kv)

    def __call__(self, ids: torch.Tensor, use_cache: bool = False):
        cfg = self.model.config
        inner, cfg._attn_implementation = cfg._attn_implementation, self.impl
        try:
            return self.model(ids, use_cache=use_cache)
        finally:
            cfg._attn_implementation = inner


def _register_kv_attention(kv: str) -> str:
    """Register (once per format) a transformers attention implementation that rounds K and V through the cache
    format, then attends by SDPA (or, for a format with a residual, by kv_quant.attend_held)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from quant.runtime.kv_quant import attend_held, held, round_trip
    from quant.shape.kv_formats import FORMATS

    name = f"quantserve_kv_{kv}"
    round_trip(kv, torch.zeros(1, 1, 64), key=True)  # an unknown format is refused here, by name
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    fmt = FORMATS.get(kv)
    if fmt is not None and fmt.residual:
        def attend(module, query, key, value, attention_mask, scaling=None, **kw):
            T, L = query.shape[-2], key.shape[-2]
            qpos = torch.arange(L - T, L)
            visible = (torch.arange(L)[None, :] <= qpos[:, None] if attention_mask is None else
                       attention_mask.bool() if attention_mask.dtype == torch.bool else attention_mask == 0)
            out = attend_held(query, held(kv, key, True), held(kv, value, False), fmt.key_group, qpos, visible,
                              query.shape[-1] ** -0.5 if scaling is None else scaling)
            return out.to(query.dtype).transpose(1, 2).contiguous(), None
    else:
        def attend(module, query, key, value, attention_mask, **kw):
            return sdpa_attention_forward(module, query, round_trip(kv, key, True), round_trip(kv, value, False),
                                          attention_mask, **kw)

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@torch.inference_mode()
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits[0, :-1]  # (T-1, V)
    return F.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)


@torch.inference_mode()
def compare(base, candidates: dict, windows: TokenWindows, progress: bool = True) -> dict[str, Quality]:
    """Evaluate every candidate model against `base` over `windows`; one base pass per window."""
    ids_all = windows.ids
    nll_base = 0.0
    acc = {name: {"nll": 0.0, "kl": 0.0, "top1": 0, "windows": []} for name in candidates}
    n = 0
    for w in track(range(ids_all.shape[0]), ids_all.shape[0], "evaluating", "windows", progress):
        ids = ids_all[w : w + 1]  # (1, T)
        target = ids[0, 1:]  # (T-1,)
        lp_base = _logprobs(base, ids)  # (T-1, V)
        w_base = float(F.nll_loss(lp_base, target, reduction="sum"))
        nll_base += w_base
        p_base = lp_base.exp()
        top_base = lp_base.argmax(-1)  # (T-1,)
        for name, model in candidates.items():
            lp = _logprobs(model, ids)  # (T-1, V)
            a = acc[name]
            w_nll = float(F.nll_loss(lp, target, reduction="sum"))
            a["nll"] += w_nll
            a["windows"].append((w_nll - w_base) / target.numel())  # this window's mean NLL difference
            a["kl"] += float((p_base * (lp_base - lp)).sum())
            a["top1"] += int((lp.argmax(-1) == top_base).sum())
        n += target.numel()
    base_ppl = math.exp(nll_base / n)
    out = {}
    for name, a in acc.items():
        ppl = math.exp(a["nll"] / n)
        d = a["windows"]  # Δppl% ~ 100 * mean NLL difference: its standard error, from the windows' spread
        se = 100.0 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
        out[name] = Quality(
            ppl=ppl,
            base_ppl=base_ppl,
            delta_ppl_pct=100.0 * (ppl / base_ppl - 1.0),
            mean_kl=a["kl"] / n,
            top1_agreement=a["top1"] / n,
            tokens=n,
            delta_ppl_se_pct=se,
        )
    return out
