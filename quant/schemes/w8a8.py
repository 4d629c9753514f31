"""w8a8: int8 weights x int8 activations (SmoothQuant smoothing; weights by GPTQ on the int8 grid or rounded;
static per-tensor input scales calibrated by minmax, percentile, KL entropy or output-error search, or dynamic
per-token scales).

Runtime: ``quant.layers.W8A8Linear`` (``torch._int_mm``). Not fusable: each Linear calibrated its own input
scale. The build (``quant.w8a8``) calibrates layer by layer and group by group, sequentially, as GPTQ does.
"""

from __future__ import annotations

from quant.layers import W8A8Linear
from quant.schemes.base import Scheme


class W8A8Scheme(Scheme):
    name = "w8a8"
    runtime = (W8A8Linear,)
    needs_calibration = True
    options = ("calib", "calib_method", "smooth", "smooth_alpha", "act_dynamic", "search_tokens", "weight_gptq",
               "damp", "act_order", "rotate")
    summary = "int8 weights and activations, smoothed, calibrated input scales"

    def layer_quantizer(self, cfg, model, calib_ids, resolved):
        from quant import w8a8

        return w8a8.LayerQuantizer(model, calib_ids, cfg)

    def quantize_head(self, cfg, head):
        return W8A8Linear.from_float(head, input_scale=None)  # dynamic: no calibration of the final norm

    def parameters(self, cfg, resolved, report):
        from quant import w8a8

        return {
            "calib_method": None if cfg.act_dynamic else cfg.calib_method,
            "act_dynamic": cfg.act_dynamic,
            "smooth": cfg.smooth,
            "smooth_alpha": (cfg.smooth_alpha if cfg.smooth_alpha is not None else "searched") if cfg.smooth else None,
            "weights": ({"method": "gptq", "damp": cfg.damp, "act_order": cfg.act_order} if cfg.weight_gptq
                        else {"method": "rtn"}),
            "rotate": w8a8.rotation(report),
            "calibration_summary": w8a8.summarize(report),
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
        # concatenated, and smoothed (quant.w8a8 calibrates one group at a time).
        H, h, d, I = shape.hidden, shape.heads, shape.head_dim, shape.intermediate
        return 2 * tokens * H * 4 + 3 * tokens * max(H, h * d, I) * 4


SCHEMES = (W8A8Scheme(),)
