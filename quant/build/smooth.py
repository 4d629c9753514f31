"""SmoothQuant-style smoothing: move activation outliers into the weights, exactly.

For a group of Linears that read the same input X, per input channel s = max|X|^a / max|W|^(1-a);
X / s feeds the Linears and their weight columns are multiplied by s, so X @ W^T is unchanged. The
division is folded into whatever produced X when that is a linear map we own:
- q/k/v read `input_layernorm`, gate/up read `post_attention_layernorm`: divide the norm's weight;
- o_proj reads attention output, which is linear in V: divide v_proj's output rows. With grouped-query
  attention several query heads share one V head, so s is tied across those heads (max over the tied
  channels) to keep the fold exact;
- down_proj reads act(gate) * up, linear in up: divide up_proj's output rows.
Which of these folds a layer allows is its family's to say (quant.build.families: Gemma's 1 + w norms, OLMo 2's
post-norms and Phi-3's fused projections allow fewer). Anything else keeps s as an explicit divisor on the
quantized module (`smooth_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quant.build.families import LayerPlan
from quant.runtime.primitives import smooth_factors


@dataclass(frozen=True)
class SmoothGroup:
    linears: tuple[str, ...]  # names relative to the decoder layer, sharing one input
    producer: str | None  # module whose output is X (norm or Linear), None: explicit scale
    producer_kind: str  # "norm" | "v_proj" (attention output, heads tied) | "linear" | "none"


def layer_groups(layer: nn.Module, plan: LayerPlan) -> list[SmoothGroup]:
    """The smoothing groups of `layer` and what each folds into (its family's, see quant.build.families);
    one explicit group per Linear, in execution order, for a layer no family describes."""
    fam = plan.family
    if fam is None:
        return [SmoothGroup((n,), None, "none") for n in plan.order]

    def norm(name: str | None) -> tuple[str | None, str]:
        return (name, "norm") if name is not None and fam.norm_folds else (None, "none")

    v = fam.qkv[-1]
    attn = [
        SmoothGroup(fam.qkv, *norm(fam.attn_norm)),
        SmoothGroup((fam.o,), *((v, "v_proj") if fam.fold_o_into_v else (None, "none"))),
    ]
    if fam.moe:  # the router reads the experts' input too: nothing folds into the norm (see quant.build.families)
        return attn + [SmoothGroup((n,), None, "none") for st in plan.stages[2:] for n in st]
    up = fam.gate_up[-1]
    return attn + [
        SmoothGroup(fam.gate_up, *norm(fam.mlp_norm)),
        SmoothGroup((fam.down,), *((up, "linear") if fam.fold_down_into_up else (None, "none"))),
    ]


def gqa_tie_index(config, o_in: int, v_out: int, device: torch.device | None = None) -> torch.Tensor | None:
    """For each o_proj input channel, the v_proj output channel it is computed from (None if the
    shapes do not follow the usual head layout)."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads % kv:
        return None
    hd = getattr(config, "head_dim", None) or o_in // heads
    if heads * hd != o_in or kv * hd != v_out:
        return None
    h = torch.arange(heads, device=device).repeat_interleave(hd)  # (o_in,) query head of each channel
    d = torch.arange(hd, device=device).repeat(heads)  # (o_in,)
    return (h // (heads // kv)) * hd + d  # (o_in,)


def group_weight_absmax(layer: nn.Module, group: SmoothGroup) -> torch.Tensor:
    ws = [layer.get_submodule(n).weight.detach().float().abs().amax(dim=0) for n in group.linears]  # [(K,)]
    return torch.stack(ws).amax(dim=0)  # (K,)


def compute_scales(
    layer: nn.Module, group: SmoothGroup, act_absmax: torch.Tensor, alpha: float, config
) -> tuple[torch.Tensor, bool]:
    """Per-input-channel s for `group` (K,), and whether it can be folded into the producer."""
    w_absmax = group_weight_absmax(layer, group)
    if group.producer_kind == "v_proj":
        o = layer.get_submodule(group.linears[0])
        v = layer.get_submodule(group.producer)
        tie = gqa_tie_index(config, o.in_features, v.out_features, w_absmax.device)
        if tie is None:
            return smooth_factors(act_absmax, w_absmax, alpha), False
        zeros = torch.zeros(v.out_features, device=w_absmax.device)
        a = zeros.scatter_reduce(0, tie, act_absmax.float(), "amax")  # (v_out,)
        w = zeros.scatter_reduce(0, tie, w_absmax, "amax")  # (v_out,)
        return smooth_factors(a, w, alpha)[tie], True
    return smooth_factors(act_absmax, w_absmax, alpha), group.producer_kind != "none"


def producer_divisor(layer: nn.Module, group: SmoothGroup, s: torch.Tensor, config) -> torch.Tensor:
    """What the producer's output channels are divided by to fold `s`: s itself, or for v_proj one value per
    V channel (every o_proj channel tied to one V channel carries the same s)."""
    if group.producer_kind != "v_proj":
        return s
    prod = layer.get_submodule(group.producer)
    o = layer.get_submodule(group.linears[0])
    tie = gqa_tie_index(config, o.in_features, prod.out_features, s.device)
    return torch.zeros(prod.out_features, dtype=s.dtype, device=s.device).scatter(0, tie, s)  # (v_out,)


@torch.no_grad()
def apply(layer: nn.Module, group: SmoothGroup, s: torch.Tensor, fold: bool, config) -> None:
    """Multiply the group's weight columns by s and, when `fold`, divide the producer's output by s."""
    for n in group.linears:
        lin = layer.get_submodule(n)
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])
    if not fold:
        return
    prod = layer.get_submodule(group.producer)
    if group.producer_kind == "norm":
        prod.weight.div_(s.to(prod.weight.dtype))
        if getattr(prod, "bias", None) is not None:
            prod.bias.div_(s.to(prod.bias.dtype))
        return
    d = producer_divisor(layer, group, s, config)  # (out,)
    prod.weight.div_(d.to(prod.weight.dtype)[:, None])
    if prod.bias is not None:
        prod.bias.div_(d.to(prod.bias.dtype))
