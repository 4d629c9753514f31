"""W8A8: smoothing, activation-threshold calibration and int8 x int8 modules, layer by layer.

Per decoder layer, on the calibration activations that reach it through the already-quantized
layers before it:
1. capture the input of each smoothing group (q/k/v, o, gate/up, down) from the float layer;
2. smoothing: per group, alpha is `--smooth-alpha` or the grid value whose fake-quantized outputs are
   closest to the float outputs on a seeded token subsample; the scales are folded (see smooth.py);
3. static thresholds per Linear by `--calib-method` on the smoothed activations (full data
   histogram); `auto` scores every candidate (minmax, percentiles, KL) by that Linear's output error
   on the subsample and keeps the best, minmax winning ties, so it never scores worse than minmax;
4. swap in `W8A8Linear` (real int8 kernels) and run the quantized layer to produce the next layer's
   inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from quant import calibration
from quant import primitives as P
from quant import smooth, thresholds
from quant.config import ALPHA_GRID, PERCENTILES, BuildConfig
from quant.layers import W8A8Linear
from quant.sequential import capture_inputs, capture_layer_inputs, decoder_layers, layer_plan, run_layer


def threshold_candidates(x: torch.Tensor, method: str, search: bool = False) -> dict[str, float]:
    """Candidate static thresholds for activations `x` (rows, K) under `method`.

    With `search=True` (scoring smoothing strengths, called 7x per group) the candidates are cheaper:
    `auto` leaves out KL and `kl` scans every 4th candidate bin.
    """
    if method == "minmax":
        return {"minmax": float(x.abs().amax())}
    hist = thresholds.abs_histogram([x])
    if method == "percentile":
        return {f"percentile-{PERCENTILES[0]}": thresholds.percentile_threshold(hist, PERCENTILES[0])}
    if method == "kl":
        return {"kl": thresholds.kl_threshold(hist, stride=4 if search else 1)}
    cands = {"minmax": thresholds.minmax_threshold(hist)}
    for pct in PERCENTILES:
        cands[f"percentile-{pct}"] = thresholds.percentile_threshold(hist, pct)
    if not search:
        cands["kl"] = thresholds.kl_threshold(hist)
    return cands


def _act_q(x: torch.Tensor, threshold: float | None) -> tuple[torch.Tensor, torch.Tensor | float]:
    """int8 activations and their scale: static (threshold given) or dynamic per row."""
    if threshold is None:
        return P.quantize_act_dynamic(x)
    scale = thresholds.scale_from_threshold(threshold)
    return P.quantize_act_static(x, scale), scale


def _output_error(xq, x_scale, wq: torch.Tensor, w_scale: torch.Tensor, ref: torch.Tensor) -> float:
    """Squared error of the quantized output against the float output, computed the way the runtime
    computes it: an int8 x int8 product rescaled (and 4x cheaper than a float matmul here)."""
    y = torch._int_mm(xq, wq.t()).float() * (x_scale * w_scale)  # (R, N)
    return float(torch.linalg.vector_norm(y - ref) ** 2)


def _score_alpha(
    layer: nn.Module, group: smooth.SmoothGroup, x_sub: torch.Tensor, absmax: torch.Tensor,
    alpha: float, cfg: BuildConfig, config,
) -> float:
    """Relative output error of the group at smoothing strength `alpha`, each Linear with its best
    search threshold."""
    s, _ = smooth.compute_scales(layer, group, absmax, alpha, config)
    xs = x_sub / s  # (R, K)
    if cfg.act_dynamic:
        x_qs = [_act_q(xs, None)]
    else:
        cands = threshold_candidates(xs, cfg.calib_method, search=True)
        x_qs = [_act_q(xs, t) for t in cands.values()]
    err, norm = 0.0, 0.0
    for name in group.linears:
        w = layer.get_submodule(name).weight.detach().float()  # (N, K)
        ref = x_sub @ w.t()  # (R, N)
        wq, ws = P.quantize_weight_sym(w * s[None, :])
        err += min(_output_error(xq, xsc, wq, ws, ref) for xq, xsc in x_qs)
        norm += float(torch.linalg.vector_norm(ref) ** 2)
    return err / max(norm, 1e-30)


def _choose_threshold(
    cands: dict[str, float], x_sub: torch.Tensor, ref: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor
) -> dict:
    scored = {name: _output_error(*_act_q(x_sub, t), wq, ws, ref) for name, t in cands.items()}
    best = min(scored, key=lambda n: (scored[n], n != "minmax"))
    norm = max(float(torch.linalg.vector_norm(ref) ** 2), 1e-30)
    return {
        "method": best,
        "threshold": cands[best],
        "rel_error": scored[best] / norm,
        "candidates": {n: {"threshold": cands[n], "rel_error": scored[n] / norm} for n in cands},
    }


class LayerQuantizer:
    """W8A8 one decoder layer at a time, in order: `quantize_layer(li, layer)` smooths, calibrates and swaps
    the layer's Linears for W8A8Linear modules, then runs it to make the next layer's inputs. The
    calibration inputs of layer 0 are captured on construction (the embedding must be materialised)."""

    def __init__(self, model: nn.Module, calib_ids: torch.Tensor, cfg: BuildConfig):
        self.model, self.cfg = model, cfg
        layers = decoder_layers(model)
        self.prefix = next(n for n, m in model.named_modules() if m is layers)
        self.gen = torch.Generator().manual_seed(cfg.calib.seed)
        self.hidden, self.kws = capture_layer_inputs(model, calib_ids)  # (S, T, D)
        self.report: dict = {"groups": {}, "linears": {}}

    @torch.inference_mode()
    def quantize_layer(self, li: int, layer: nn.Module) -> None:
        model, cfg, gen, prefix, report, hidden = self.model, self.cfg, self.gen, self.prefix, self.report, self.hidden
        kw = self.kws[li]
        groups = smooth.layer_groups(layer, layer_plan(model, layer, hidden, kw))
        heads = {g.linears[0]: layer.get_submodule(g.linears[0]) for g in groups}
        with capture_inputs(heads) as store:
            run_layer(layer, hidden, kw)
        inputs = {g: torch.cat(store.pop(g.linears[0]) or [torch.zeros(0, layer.get_submodule(g.linears[0]).in_features)])
                  for g in groups}  # (R, K) fp32 each; R differs per expert of a MoE layer
        rows = next(iter(inputs.values())).shape[0]
        subs = {rows: torch.randperm(rows, generator=gen)[: cfg.search_tokens]}
        for x in inputs.values():  # the experts of a MoE layer each see the rows routed to them
            if x.shape[0] not in subs:
                subs[x.shape[0]] = torch.randperm(x.shape[0], generator=gen)[: cfg.search_tokens]
        # Smoothing strengths are scored on half the subsample: 7 candidates per group add up.
        half = max(1, cfg.search_tokens // 2)
        # Too few rows (an expert the calibration set seldom routes to): no smoothing, dynamic input scales.
        few = {g for g, x in inputs.items() if x.shape[0] < calibration.min_rows(x.shape[1])}
        # Phase 1: smoothing for every group, before any weight is quantized (a fold rescales the
        # rows of v_proj / up_proj, which per-row weight quantization absorbs exactly).
        scales: dict = {}
        for g in groups:
            x = inputs[g]
            entry: dict = {"linears": list(g.linears)}
            if g in few:
                entry["skipped"] = f"{x.shape[0]} calibration tokens reached it"
            elif cfg.smooth:
                absmax = x.abs().amax(dim=0)  # (K,)
                if cfg.smooth_alpha is not None:
                    alpha = cfg.smooth_alpha
                else:
                    x_alpha = x[subs[x.shape[0]][:half]]
                    errs = {a: _score_alpha(layer, g, x_alpha, absmax, a, cfg, model.config) for a in ALPHA_GRID}
                    alpha = min(errs, key=errs.get)
                    entry["alpha_rel_error"] = {str(a): e for a, e in errs.items()}
                s, fold = smooth.compute_scales(layer, g, absmax, alpha, model.config)
                smooth.apply(layer, g, s, fold, model.config)
                scales[g] = (s, fold)
                entry.update(alpha=alpha, folded=fold, folded_into=g.producer if fold else None)
            report["groups"][f"{prefix}.{li}.{g.linears[0]}"] = entry
        # Phase 2: thresholds and int8 modules.
        for g in groups:
            s, fold = scales.get(g, (None, False))
            x = inputs.pop(g)
            x_s = x if s is None else x / s  # what the quantized module will see, (R, K)
            x_sub = x_s[subs[x.shape[0]]]
            dynamic = cfg.act_dynamic or g in few
            cands = None if dynamic else threshold_candidates(x_s, cfg.calib_method)
            for name in g.linears:
                lin = layer.get_submodule(name)
                w = lin.weight.detach().float()
                full = f"{prefix}.{li}.{name}"
                if cfg.act_dynamic:
                    input_scale, info = None, {"method": "dynamic-per-token"}
                elif g in few:
                    input_scale, info = None, {"method": "dynamic-per-token", "fallback": (
                        f"{x.shape[0]} calibration tokens reached it, fewer than the "
                        f"{calibration.min_rows(x.shape[1])} a static scale needs")}
                else:
                    ref = x_sub @ w.t()  # (R, N)
                    info = _choose_threshold(cands, x_sub, ref, *P.quantize_weight_sym(w))
                    input_scale = thresholds.scale_from_threshold(info["threshold"])
                    info["input_scale"] = input_scale
                explicit = None if (s is None or fold) else s
                new = W8A8Linear.from_float(lin, input_scale, explicit)
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child, new)
                report["linears"][full] = info
            del x, x_s, x_sub
        self.hidden = run_layer(layer, hidden, kw)


def summarize(report: dict) -> dict:
    """Counts of the chosen threshold methods and the alphas, for the manifest and the summary."""
    methods: dict[str, int] = {}
    for info in report["linears"].values():
        methods[info["method"]] = methods.get(info["method"], 0) + 1
    alphas = [g["alpha"] for g in report["groups"].values() if "alpha" in g]
    out = {"threshold_methods": methods}
    if alphas:
        out["alpha_mean"] = sum(alphas) / len(alphas)
        out["alpha_counts"] = {str(a): alphas.count(a) for a in sorted(set(alphas))}
    return out
