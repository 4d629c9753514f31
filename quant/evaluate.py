"""Quality of a quantized model against its base on the same fixed windows.

Per window, the base logits are computed once and every candidate is compared with them:
perplexity (next-token NLL over all predicted positions), mean KL(base || candidate) of the
next-token distributions, and top-1 agreement (argmax equal).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from quant.calibration import TokenWindows
from quant.progress import track


@dataclass(frozen=True)
class Quality:
    ppl: float
    base_ppl: float
    delta_ppl_pct: float
    mean_kl: float
    top1_agreement: float
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits[0, :-1]  # (T-1, V)
    return F.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def compare(base, candidates: dict, windows: TokenWindows, progress: bool = True) -> dict[str, Quality]:
    """Evaluate every candidate model against `base` over `windows`; one base pass per window."""
    ids_all = windows.ids
    nll_base = 0.0
    acc = {name: {"nll": 0.0, "kl": 0.0, "top1": 0} for name in candidates}
    n = 0
    for w in track(range(ids_all.shape[0]), ids_all.shape[0], "evaluating", "windows", progress):
        ids = ids_all[w : w + 1]  # (1, T)
        target = ids[0, 1:]  # (T-1,)
        lp_base = _logprobs(base, ids)  # (T-1, V)
        nll_base += float(F.nll_loss(lp_base, target, reduction="sum"))
        p_base = lp_base.exp()
        top_base = lp_base.argmax(-1)  # (T-1,)
        for name, model in candidates.items():
            lp = _logprobs(model, ids)  # (T-1, V)
            a = acc[name]
            a["nll"] += float(F.nll_loss(lp, target, reduction="sum"))
            a["kl"] += float((p_base * (lp_base - lp)).sum())
            a["top1"] += int((lp.argmax(-1) == top_base).sum())
        n += target.numel()
    base_ppl = math.exp(nll_base / n)
    out = {}
    for name, a in acc.items():
        ppl = math.exp(a["nll"] / n)
        out[name] = Quality(
            ppl=ppl,
            base_ppl=base_ppl,
            delta_ppl_pct=100.0 * (ppl / base_ppl - 1.0),
            mean_kl=a["kl"] / n,
            top1_agreement=a["top1"] / n,
            tokens=n,
        )
    return out
