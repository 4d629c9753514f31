"""w4a16 (GPTQ) and rtn-w4: 4-bit weights in groups along the input, 16-bit activations, written in the GPTQ
checkpoint format (transformers + gptqmodel, optimum and vLLM load it; so does ``quant.load`` a GPTQ
checkpoint from elsewhere).

Runtime: ``quant.int4.GPTQLinear`` (PyTorch's int4 kernels on a layout repacked once at load); fusable (the
fused module holds the one kernel copy). Act-order uses static groups, so ``g_idx`` stays ``k // group``.
"""

from __future__ import annotations

import json
from pathlib import Path

from quant.errors import ArtifactError
from quant.int4 import GPTQLinear
from quant.schemes.base import Scheme


class GPTQScheme(Scheme):
    runtime = (GPTQLinear,)
    no_head_because = "the GPTQ format keeps lm_head in float"
    options = ("group_size", "asym")

    def __init__(self, method: str):
        self.method = method
        self.name = "w4a16" if method == "gptq" else "rtn-w4"
        self.needs_calibration = method == "gptq"
        if method == "gptq":
            self.options = (*self.options, "calib", "damp", "act_order", "clip_search")
        self.summary = f"4-bit weights in groups ({'GPTQ' if method == 'gptq' else 'round-to-nearest'}), 16-bit activations"

    def resolve(self, cfg, model):
        from quant.w4a16 import choose_group_size

        return {"group_size": choose_group_size(model, cfg.group_size)}

    def layer_quantizer(self, cfg, model, calib_ids, resolved):
        from quant import w4a16

        return w4a16.LayerQuantizer(model, calib_ids, self.method, resolved["group_size"], not cfg.asym, cfg.damp,
                                    cfg.act_order, cfg.matmul_torch_dtype(cfg.torch_device()), cfg.clip_search)

    def parameters(self, cfg, resolved, report):
        gs = resolved["group_size"]
        return {
            "bits": 4, "group_size": gs, "sym": not cfg.asym,
            "damp": cfg.damp if self.method == "gptq" else None,
            "act_order": cfg.act_order if self.method == "gptq" else None,
            "clip_search": cfg.clip_search if self.method == "gptq" else None,
            "checkpoint_format": _format(cfg.asym),
            "rtn_fallbacks": report["fallbacks"],
            "weight_granularity": f"per-output-channel, groups of {gs} inputs",
        }

    def quantization_config(self, cfg, resolved, modules):
        """The standard GPTQ `quantization_config` (transformers/gptqmodel, optimum, vLLM).

        Act-order uses static groups here, so g_idx is the trivial k // group and loaders are told
        desc_act = false: no runtime reordering is needed. Asymmetric zero-points do not survive the v1
        format's zero - 1 storage at zero = 0, hence gptq_v2 for --asym.
        """
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": resolved["group_size"],
            "desc_act": False,
            "sym": not cfg.asym,
            "static_groups": cfg.act_order,
            "true_sequential": True,
            "damp_percent": cfg.damp,
            "lm_head": False,
            "checkpoint_format": _format(cfg.asym),
            "pack_dtype": "int32",
            "model_file_base_name": "model",
        }

    def extra_files(self, cfg, resolved):
        return {"quantize_config.json": json.dumps(self.quantization_config(cfg, resolved, {}), indent=2) + "\n"}

    def linear_bytes(self, n, k, group_size):
        g = k // group_size
        return n * k // 2, g * n // 2 + 2 * g * n + 4 * k  # qweight; qzeros, fp16 scales, g_idx

    def served_linear_bytes(self, n, k, group_size, float_bytes):
        from quant.int4 import KERNEL_GROUP_SIZES

        if float_bytes != 2 or group_size not in KERNEL_GROUP_SIZES or n % 16:  # the CPU kernel's layout (prepare)
            return self.linear_bytes(n, k, group_size)
        return n * k // 2, (k // group_size) * n * 2 * float_bytes  # packed codes; (G, N, 2) scale/zero table

    def calib_activation_bytes(self, shape, tokens):
        # The layer's input, output and the stage in between, the attention output and down_proj's input.
        return 3 * tokens * shape.hidden * 4 + tokens * (shape.heads * shape.head_dim + shape.intermediate) * 4

    def solver_bytes(self, n, k):
        if self.method == "rtn":
            return super().solver_bytes(n, k)
        # The group's Hessian, GPTQ's copy and two factorisation steps (K x K), the weight's fp32 copies.
        return 4 * k * k * 4 + 4 * n * k * 4


def _format(asym: bool) -> str:
    return "gptq_v2" if asym else "gptq"


def read_specs(qc: dict, state: dict, config_path: Path) -> dict[str, dict]:
    """Module specs of a GPTQ checkpoint (ours or another tool's): every module with a `qweight`."""
    if qc.get("bits") != 4 or qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ArtifactError(f"{config_path}: only 4-bit GPTQ (gptq / gptq_v2) is supported")
    v2 = qc.get("checkpoint_format") == "gptq_v2"
    names = [k[: -len(".qweight")] for k in state if k.endswith(".qweight")]
    return {n: {"type": GPTQLinear.SPEC_TYPE, "group_size": int(qc["group_size"]), "v2": v2,
                "bias": f"{n}.bias" in state} for n in names}


SCHEMES = (GPTQScheme("gptq"), GPTQScheme("rtn"))
