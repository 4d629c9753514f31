"""Why an artifact's perplexity change and its mean KL disagree (#43): which tokens and which windows.

Per predicted token t of the evaluation windows (float64, `quant eval`'s reference arithmetic):
    Δnll_t = log p_base(x_t) - log p_quant(x_t)      (the perplexity change is exp(mean Δnll_t) - 1)
    KL_t   = KL(p_base || p_quant) at t                (the mean KL is their mean)
Δnll_t - KL_t has expectation 0 where the text follows the base model's distribution, so the two measures differ
by (1) sampling: which tokens this text happens to hold, and (2) miscalibration: the base model is surer (or less
sure) than the text warrants, and the quantized model moves probability towards (or away from) the base's own
choices. The report splits the totals by the base's probability of the true token, gives the entropies (a
quantized model that is sharper than the base loses more on tokens the base thought unlikely), the windows that
contribute most, and the standard errors over windows.

    python bench/quality_gap.py ARTIFACT [--windows 40] [--seqlen 512] [--json OUT]
    python bench/quality_gap.py --compare A.json B.json     (two reports on the same windows: B - A, paired)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_cache import cpu_name  # noqa: E402
from quant import calibration, loader, models  # noqa: E402
from quant.build import reference_model, resolve_eval_adapter, resolve_eval_source  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
BUCKETS = (0.0, 0.01, 0.1, 0.5, 1.0 + 1e-9)  # the base's probability of the true token
TEMPERATURES = (0.98, 1.0, 1.01, 1.02, 1.05)  # the base's own perplexity with its logits divided by T: is it
# overconfident on this text (a flatter distribution scoring better), so that a perturbation that flattens it
# lowers the perplexity without being closer to it?


@torch.inference_mode()
def per_token(base, quant, windows) -> dict[str, torch.Tensor]:
    """(W, T-1) float64 tensors: dnll, kl, p_base (of the true token), entropies of base and quant."""
    cols: dict[str, list] = {k: [] for k in ("dnll", "kl", "p_base", "h_base", "h_quant", "top1", "nll_t")}
    for w in range(windows.ids.shape[0]):
        ids = windows.ids[w: w + 1]  # (1, T)
        tgt = ids[0, 1:, None]  # (T-1, 1)
        zb = base(ids, use_cache=False).logits[0, :-1].double()  # (T-1, V)
        lb = F.log_softmax(zb, -1)  # (T-1, V)
        cols["nll_t"].append(torch.stack([-F.log_softmax(zb / temp, -1).gather(1, tgt)[:, 0]
                                          for temp in TEMPERATURES]))  # (len(TEMPERATURES), T-1)
        lq = F.log_softmax(quant(ids, use_cache=False).logits[0, :-1].double(), -1)  # (T-1, V)
        pb, pq = lb.exp(), lq.exp()
        cols["dnll"].append((lb.gather(1, tgt) - lq.gather(1, tgt))[:, 0])
        cols["kl"].append((pb * (lb - lq)).sum(-1))
        cols["p_base"].append(pb.gather(1, tgt)[:, 0])
        cols["h_base"].append(-(pb * lb).sum(-1))
        cols["h_quant"].append(-(pq * lq).sum(-1))
        cols["top1"].append((lb.argmax(-1) == lq.argmax(-1)).double())
        print(f"[gap] window {w + 1}/{windows.ids.shape[0]}", flush=True)
    return {k: torch.stack(v) for k, v in cols.items()}


def se_over_windows(x: torch.Tensor) -> float:
    """Standard error of the mean of x (W, T) taken over its windows' means."""
    m = x.mean(1)  # (W,)
    return float(m.std(unbiased=True) / math.sqrt(m.numel())) if m.numel() > 1 else float("nan")


def report(t: dict[str, torch.Tensor]) -> dict:
    n = t["dnll"].numel()  # t["nll_t"]: (W, len(TEMPERATURES), T-1)
    out = {
        "tokens": n,
        "delta_ppl_pct": 100 * math.expm1(float(t["dnll"].mean())),
        "mean_dnll": float(t["dnll"].mean()), "mean_dnll_se": se_over_windows(t["dnll"]),
        "mean_kl": float(t["kl"].mean()), "mean_kl_se": se_over_windows(t["kl"]),
        "gap": float((t["dnll"] - t["kl"]).mean()), "gap_se": se_over_windows(t["dnll"] - t["kl"]),
        "entropy_base": float(t["h_base"].mean()), "entropy_quant": float(t["h_quant"].mean()),
        "top1": float(t["top1"].mean()),
        "base_ppl_at_temperature": {str(temp): math.exp(float(t["nll_t"][:, i].mean()))
                                    for i, temp in enumerate(TEMPERATURES)},
    }
    rows = []
    pb, dn, kl = t["p_base"].flatten(), t["dnll"].flatten(), t["kl"].flatten()
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = (pb >= lo) & (pb < hi)
        span = f"[{lo:g}, {min(hi, 1.0):g}{']' if hi > 1 else ')'}"
        rows.append({"p_base": span, "share": float(sel.double().mean()),
                     "dnll_share_of_total": float(dn[sel].sum() / n), "kl_share_of_total": float(kl[sel].sum() / n),
                     "mean_dnll": float(dn[sel].mean()) if sel.any() else 0.0,
                     "mean_kl": float(kl[sel].mean()) if sel.any() else 0.0})
    out["by_p_base"] = rows
    per_window = t["dnll"].mean(1)  # (W,)
    order = per_window.argsort(descending=True)
    out["windows_by_dnll"] = [{"window": int(i), "mean_dnll": float(per_window[i]),
                               "mean_kl": float(t["kl"][i].mean())} for i in order[:5]]
    out["windows_dnll_range"] = [float(per_window.min()), float(per_window.max())]
    out["per_window"] = {"mean_dnll": per_window.tolist(), "mean_kl": t["kl"].mean(1).tolist()}  # for --compare
    return out


def compare(a: dict, b: dict) -> dict:
    """B's mean Δnll and KL minus A's over the same windows, with the standard errors of the paired differences:
    whether two artifacts differ by more than the windows' spread."""
    if a["evaluation"] != b["evaluation"]:
        raise SystemExit("the two reports are over different windows")
    out = {"a": a["artifact"], "b": b["artifact"]}
    for k in ("mean_dnll", "mean_kl"):
        d = torch.tensor(b["per_window"][k], dtype=torch.float64) - torch.tensor(a["per_window"][k],
                                                                                 dtype=torch.float64)  # (W,)
        out[f"{k}_diff"] = float(d.mean())
        out[f"{k}_diff_se"] = float(d.std(unbiased=True) / math.sqrt(d.numel()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        print(json.dumps(compare(a, b), indent=2))
        return
    if not args.artifact:
        ap.error("an artifact, or --compare A.json B.json")
    art = loader.load(args.artifact, dtype=torch.float64)
    windows = calibration.eval_windows(art.tokenizer, args.data, args.windows, args.seqlen)
    base = reference_model(resolve_eval_source(art.manifest, models.default_cache_dir()),
                           resolve_eval_adapter(art.manifest), torch.float64)
    r = {"artifact": args.artifact, "cpu": cpu_name(), "evaluation": windows.describe(),
         **report(per_token(base, art.model, windows))}
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
