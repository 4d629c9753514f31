"""quant.build.evaluate.compare on models whose logits are known: perplexity, KL, top-1 and the standard error of Δppl
over windows against the formulas computed by hand, in float64 (the evaluation's default arithmetic)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from quant.build.calibration import TokenWindows
from quant.build.evaluate import compare

pytestmark = pytest.mark.unit


class _Table(torch.nn.Module):
    """A "model" whose logits at each position are a fixed function of the token there."""

    def __init__(self, vocab: int, seed: int, noise: torch.Tensor | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)  # (V, V)
        if noise is not None:
            self.table = self.table + noise

    def forward(self, ids, use_cache=False):
        return SimpleNamespace(logits=self.table[ids])  # (1, T, V)


def test_compare_gives_the_hand_computed_figures_and_the_windows_standard_error():
    vocab, windows, seqlen = 16, 5, 33
    ids = torch.randint(0, vocab, (windows, seqlen), generator=torch.Generator().manual_seed(1))
    base = _Table(vocab, 0)
    cand = _Table(vocab, 0, 0.3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(2),
                                               dtype=torch.float64))
    q = compare(base, {"c": cand}, TokenWindows(ids, "t", "f", ids.numel()), progress=False)["c"]
    lb = F.log_softmax(base.table[ids[:, :-1]], -1)  # (W, T-1, V)
    lc = F.log_softmax(cand.table[ids[:, :-1]], -1)
    tgt = ids[:, 1:, None]
    nb, nc = -lb.gather(2, tgt)[..., 0], -lc.gather(2, tgt)[..., 0]  # (W, T-1)
    n = nb.numel()
    assert q.tokens == n == windows * (seqlen - 1)
    assert math.isclose(q.base_ppl, math.exp(float(nb.mean())), rel_tol=1e-12)
    assert math.isclose(q.ppl, math.exp(float(nc.mean())), rel_tol=1e-12)
    assert math.isclose(q.mean_kl, float((lb.exp() * (lb - lc)).sum(-1).mean()), rel_tol=1e-9)
    assert q.top1_agreement == float((lb.argmax(-1) == lc.argmax(-1)).double().mean())
    d = (nc - nb).mean(1)  # (W,) each window's mean NLL difference
    assert math.isclose(q.delta_ppl_se_pct, 100 * float(d.std(unbiased=True)) / math.sqrt(windows), rel_tol=1e-9)
    one = compare(base, {"c": cand}, TokenWindows(ids[:1], "t", "f", seqlen), progress=False)["c"]
    assert one.delta_ppl_se_pct is None  # one window has no spread to speak of
