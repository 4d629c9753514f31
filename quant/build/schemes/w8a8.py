"""w8a8: int8 weights x int8 activations (SmoothQuant smoothing; weights by GPTQ on the int8 grid or rounded;
static per-tensor input scales calibrated by minmax, percentile, KL entropy or output-error search, or dynamic
per-token scales).

Runtime: ``quant.runtime.w8a8.W8A8Linear`` (``torch._int_mm``). Not fusable: each Linear calibrated its own input
scale.

The build: smoothing, activation-threshold calibration and int8 x int8 modules, layer by layer.

Sequential, as GPTQ (quant.build.sequential): each decoder layer sees the calibration activations of the quantized
layers before it, and inside a layer each group of Linears (q/k/v, o, gate/up, down) the inputs computed with
the groups before it quantized, in one staged pass for Llama-shaped layers. Per group:
1. smoothing: alpha is `--smooth-alpha` or the grid value whose fake-quantized outputs are closest to the
   float outputs on a seeded token subsample; the scales are folded (see smooth.py) where the family allows,
   including into an already quantized v_proj / up_proj (a per-row weight scale absorbs a row factor exactly);
2. static thresholds per Linear by `--calib-method` on the smoothed activations (full data histogram);
   `auto` scores every candidate (minmax, percentiles, KL) by that Linear's output error on the subsample
   and keeps the best, minmax winning ties, so it never scores worse than minmax;
3. the weights are quantized to int8, one scale per row: by GPTQ (quant.build.gptq on the int8 grid) against the
   Hessian of the smoothed inputs (the default), or rounded to nearest with `--no-gptq` or where too few
   calibration tokens reached the group; the static thresholds of step 2 are scored with those weights;
4. the group's `W8A8Linear`s are built, and for the rest of the layer's pass each Linear computes their
   function in fp32 (dequantized weight, fake-quantized input: `W8A8Linear.reference_forward`), the fast dense
   path on every machine, where `_int_mm` is 25x slower than fp32 on AVX2-only CPUs. The int8 modules are
   swapped in when the layer is done.
Scores compare int8 x int8 products computed by `quant.runtime.kernels.gemm.int8_product` (the machine's faster exact
path).
"""

from __future__ import annotations

import torch
from torch import nn

from quant.build import calibration, smooth, thresholds
from quant.build import gptq as G
from quant.build.config import ALPHA_GRID, PERCENTILES, BuildConfig
from quant.build.schemes.base import Scheme
from quant.build.sequential import _cast_kwargs, capture_layer_inputs, decoder_layers, layer_pass, layer_plan
from quant.runtime import hadamard
from quant.runtime import primitives as P
from quant.runtime.kernels import gemm
from quant.runtime.linear import set_module
from quant.runtime.w8a8 import W8A8Linear


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
    """Squared error of the quantized output against the float output, computed as the runtime computes it:
    an int8 x int8 product rescaled (in place: the same arithmetic without two (R, N) temporaries)."""
    y = gemm.int8_product(xq, wq).mul_(x_scale * w_scale).sub_(ref)  # (R, N)
    return float(torch.linalg.vector_norm(y) ** 2)


def _score_alpha(
    layer: nn.Module, group: smooth.SmoothGroup, x_sub: torch.Tensor, absmax: torch.Tensor, refs: dict,
    alpha: float, cfg: BuildConfig, config, block: int = 0,
) -> float:
    """Relative output error of the group at smoothing strength `alpha`, each Linear with its best
    search threshold, the smoothed input and weights rotated in blocks of `block` when given. `refs`: each
    Linear's float weight (N, K) and float output on `x_sub` (R, N)."""
    s, _ = smooth.compute_scales(layer, group, absmax, alpha, config)
    xs = _rotated(x_sub / s, block)  # (R, K)
    if cfg.act_dynamic:
        x_qs = [_act_q(xs, None)]
    else:
        cands = threshold_candidates(xs, cfg.calib_method, search=True)
        x_qs = [_act_q(xs, t) for t in cands.values()]
    err, norm = 0.0, 0.0
    for name in group.linears:
        w, ref, ref_norm = refs[name]
        # Rounded to nearest even when GPTQ quantizes the weights: scoring each strength with GPTQ's weights (on
        # this subsample's Hessian) chose stronger smoothing and scored worse on the default model in Δppl and KL,
        # at 1.7x the build time (measured on 40 windows, paired).
        wq, ws = P.quantize_weight_sym(_rotated(w * s[None, :], block))
        err += min(_output_error(xq, xsc, wq, ws, ref) for xq, xsc in x_qs)
        norm += ref_norm
    return err / max(norm, 1e-30)


def _rotated(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rotated in blocks of `block` (0: as it is), in place: every caller passes a temporary of its own."""
    return hadamard.rotate_(x, block) if block else x


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


def _simulate(lin: nn.Linear, mod: W8A8Linear) -> None:
    """Make the float `lin` compute what the int8 module `mod` computes (its input divided by the explicit smoothing
    scale and quantized, the integer product, rescaled in fp32) until `_unsimulate`, by the module's own static
    rule: ``torch._int_mm`` where it is exact and this machine's faster product, else the same integer product in
    fp32. (Its fp32 `reference_forward`, which dequantizes the weight on every call, made the calibration's layer
    pass a fifth of a w8a8 build.) The scales are read at each call: a later fold into this module divides them.
    An instance attribute shadows the class's forward, so the Linear stays where the layer pass holds it and its
    hooks still run."""
    path = mod.paths(torch.float32)[mod.static_path(0, torch.float32)]  # (M, K) contiguous -> (M, N) fp32

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = path(x.reshape(-1, mod.in_features).float().contiguous())  # (M, N)
        return y.reshape(*x.shape[:-1], mod.out_features)

    lin.forward = forward


def _unsimulate(lin: nn.Linear) -> None:
    lin.__dict__.pop("forward", None)


class LayerQuantizer:
    """W8A8 one decoder layer at a time, in order: `quantize_layer(li, layer)` smooths, calibrates and swaps
    the layer's Linears for W8A8Linear modules, its output becoming the next layer's input. The calibration
    inputs of layer 0 are captured on construction (the embedding must be materialised)."""

    def __init__(self, model: nn.Module, calib_ids: torch.Tensor, cfg: BuildConfig):
        self.model, self.cfg = model, cfg
        layers = decoder_layers(model)
        self.prefix = next(n for n, m in model.named_modules() if m is layers)
        self.gen = torch.Generator().manual_seed(cfg.calib.seed)
        self.hidden, self.kws = capture_layer_inputs(model, calib_ids)  # (S, T, D)
        self.matmul_dtype = cfg.matmul_torch_dtype(self.hidden.device)
        self.report: dict = {"groups": {}, "linears": {}}

    def _subsample(self, rows: int, n: int) -> torch.Tensor:
        return torch.randperm(rows, generator=self.gen)[:n]

    @torch.inference_mode()
    def quantize_layer(self, li: int, layer: nn.Module) -> None:
        model = self.model
        kw = _cast_kwargs(self.kws[li], torch.float32)
        lp = layer_plan(model, layer, self.hidden, kw)
        groups = smooth.layer_groups(layer, lp)
        by_first = {g.linears[0]: g for g in groups}
        built: dict[str, W8A8Linear] = {}

        fam = lp.family
        rotated = {fam.down} if self.cfg.rotate and fam is not None and not fam.moe else set()

        def quantize_group(names: tuple[str, ...], inputs) -> torch.Tensor | None:
            g = by_first[names[0]]
            k = layer.get_submodule(names[0]).in_features
            x = torch.cat([t.reshape(-1, k).float() for t in inputs]) if len(inputs) else torch.zeros(0, k)  # (R, K)
            block = hadamard.block_size(k) if names[0] in rotated else 0  # 0: no block fits, left unrotated
            s, fold = self._smooth(li, layer, g, x, built, block)
            self._quantize(li, layer, g, x, s, fold, built, block)
            return s if fold else None

        try:
            self.hidden = layer_pass(layer, self.hidden, kw, quantize_group, lp, groups, self.matmul_dtype)
        finally:
            for name in built:
                _unsimulate(layer.get_submodule(name))
        for name, mod in built.items():
            set_module(layer, name, mod)

    def _smooth(self, li: int, layer: nn.Module, g: smooth.SmoothGroup, x: torch.Tensor,
                built: dict[str, W8A8Linear], block: int = 0) -> tuple[torch.Tensor | None, bool]:
        """Smoothing of group `g` on its input x (R, K): the scale applied (None: none) and whether it folded.
        A fold into an already quantized producer (v_proj, up_proj) divides that module's rows too. `block`: the
        group's rotation (applied after the smoothing), which the strengths are scored with."""
        cfg, config = self.cfg, self.model.config
        entry: dict = {"linears": list(g.linears)}
        if block:
            entry["rotate"] = block
        self.report["groups"][f"{self.prefix}.{li}.{g.linears[0]}"] = entry
        if x.shape[0] < calibration.min_rows(x.shape[1]):
            entry["skipped"] = f"{x.shape[0]} calibration tokens reached it"
            return None, False
        if not cfg.smooth:
            return None, False
        absmax = x.abs().amax(dim=0)  # (K,)
        if cfg.smooth_alpha is not None:
            alpha = cfg.smooth_alpha
        else:
            # Strengths are scored on half the subsample: 7 candidates per group add up.
            x_alpha = x[self._subsample(x.shape[0], max(1, cfg.search_tokens // 2))]  # (R', K)
            refs = {}
            for n in g.linears:
                w = layer.get_submodule(n).weight.detach().float()  # (N, K)
                ref = x_alpha @ w.t()  # (R', N)
                refs[n] = (w, ref, float(torch.linalg.vector_norm(ref) ** 2))
            errs = {a: _score_alpha(layer, g, x_alpha, absmax, refs, a, cfg, config, block) for a in ALPHA_GRID}
            alpha = min(errs, key=errs.get)
            entry["alpha_rel_error"] = {str(a): e for a, e in errs.items()}
        s, fold = smooth.compute_scales(layer, g, absmax, alpha, config)
        smooth.apply(layer, g, s, fold, config)
        if fold and g.producer in built:  # the float producer now computes the int8 one's function: divide both
            d = smooth.producer_divisor(layer, g, s, config)
            prod = built[g.producer]
            prod.weight_scale.div_(d)
            if prod.bias is not None:
                prod.bias.div_(d)
        entry.update(alpha=alpha, folded=fold, folded_into=g.producer if fold else None)
        return s, fold

    def _quantize(self, li: int, layer: nn.Module, g: smooth.SmoothGroup, x: torch.Tensor,
                  s: torch.Tensor | None, fold: bool, built: dict, block: int = 0) -> None:
        """Thresholds and W8A8Linear modules for group `g` (weights already smoothed; rotated here when
        `block`), which its Linears compute from now on."""
        cfg = self.cfg
        few = x.shape[0] < calibration.min_rows(x.shape[1])
        dynamic = cfg.act_dynamic or few
        x_s = x if s is None else x / s  # what the int8 grid will see, (R, K)
        if block:
            if not dynamic or (cfg.weight_gptq and not few):  # what reads x_s: the thresholds, GPTQ's Hessian
                # In place (into x itself when unsmoothed: the caller is done with it): a rotated copy beside x and
                # x / s would hold a third (R, K).
                x_s = hadamard.rotate_(x_s, block)
            for name in g.linears:
                lin = layer.get_submodule(name)
                lin.weight.data = hadamard.rotate(lin.weight.data.float(), block).to(lin.weight.dtype)  # W H^T
        x_sub = x_s[self._subsample(x.shape[0], cfg.search_tokens)] if not dynamic else None
        cands = None if dynamic else threshold_candidates(x_s, cfg.calib_method)
        h = None
        if cfg.weight_gptq and not few:
            hess = G.Hessian(x_s.shape[1])
            hess.add(x_s)
            h = hess.value()  # (K, K) GPTQ's Hessian of the group's smoothed input
        for name in g.linears:
            lin = layer.get_submodule(name)
            w = lin.weight.detach().float()  # (N, K), smoothed
            weight, winfo = self._weights(w, h)
            if cfg.act_dynamic:
                input_scale, info = None, {"method": "dynamic-per-token"}
            elif few:
                input_scale, info = None, {"method": "dynamic-per-token", "fallback": (
                    f"{x.shape[0]} calibration tokens reached it, fewer than the "
                    f"{calibration.min_rows(x.shape[1])} a static scale needs")}
            else:
                info = _choose_threshold(cands, x_sub, x_sub @ w.t(), *weight)
                input_scale = thresholds.scale_from_threshold(info["threshold"])
                info["input_scale"] = input_scale
            info["weights"] = winfo
            mod = W8A8Linear.from_float(lin, input_scale, None if (s is None or fold) else s, weight=weight,
                                        rotate=block)
            built[name] = mod
            _simulate(lin, mod)
            self.report["linears"][f"{self.prefix}.{li}.{name}"] = info

    def _weights(self, w: torch.Tensor, h: torch.Tensor | None) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """int8 codes (N, K) and row scales (N,) of the smoothed weight `w` (N, K): GPTQ against `h` (K, K), or
        rounded to nearest without one (`--no-gptq`, or too few calibration tokens reached the group)."""
        if h is None:
            return P.quantize_weight_sym(w), {"method": "rtn"}
        cfg = self.cfg
        q = G.gptq(w, h, group_size=w.shape[1], damp=cfg.damp, act_order=cfg.act_order, grid=G.Grid.int8())
        info = {"method": "gptq" if q.fallback is None else "rtn", "damp": q.damp}
        if q.fallback:
            info["fallback"] = q.fallback
        return (q.codes.to(torch.int8), q.scales[0].contiguous()), info


def rotation(report: dict) -> dict | None:
    """What was rotated (None: nothing; MoE layers and inputs without a block of MIN_BLOCK are not), for the
    manifest."""
    blocks = [g["rotate"] for g in report["groups"].values() if "rotate" in g]
    return {"linear": "down_proj", "blocks": sorted(set(blocks)), "layers": len(blocks)} if blocks else None


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


class W8A8Scheme(Scheme):
    name = "w8a8"
    runtime = (W8A8Linear,)
    needs_calibration = True
    options = ("calib", "calib_method", "smooth", "smooth_alpha", "act_dynamic", "search_tokens", "weight_gptq",
               "damp", "act_order", "rotate")
    summary = "int8 weights and activations, smoothed, calibrated input scales"

    def layer_quantizer(self, cfg, model, calib_ids, resolved):
        return LayerQuantizer(model, calib_ids, cfg)

    def quantize_head(self, cfg, head):
        return W8A8Linear.from_float(head, input_scale=None)  # dynamic: no calibration of the final norm

    def parameters(self, cfg, resolved, report):
        return {
            "calib_method": None if cfg.act_dynamic else cfg.calib_method,
            "act_dynamic": cfg.act_dynamic,
            "smooth": cfg.smooth,
            "smooth_alpha": (cfg.smooth_alpha if cfg.smooth_alpha is not None else "searched") if cfg.smooth else None,
            "weights": ({"method": "gptq", "damp": cfg.damp, "act_order": cfg.act_order} if cfg.weight_gptq
                        else {"method": "rtn"}),
            "rotate": rotation(report),
            "calibration_summary": summarize(report),
        }

    def linear_bytes(self, n, k, group_size):
        return n * k, 4 * n + 4  # int8 weight; fp32 scales and the static input scale

    def head_bytes(self, vocab, hidden):
        return vocab * hidden, 4 * vocab  # dynamic input: no input scale

    def solver_bytes(self, n, k):
        # GPTQ's (the default; rounding alone needs less, counted the same): the group's Hessian, GPTQ's copy and
        # two factorisation steps (K x K), the weight's fp32 copies.
        return 4 * k * k * 4 + 4 * n * k * 4

    def calib_activation_bytes(self, shape, tokens):
        # The layer's input and the stage output beside it; the widest group input as the pass holds it,
        # concatenated, and smoothed (quant.build.schemes.w8a8 calibrates one group at a time).
        H, h, d, I = shape.hidden, shape.heads, shape.head_dim, shape.intermediate
        return 2 * tokens * H * 4 + 3 * tokens * max(H, h * d, I) * 4


SCHEMES = (W8A8Scheme(),)
