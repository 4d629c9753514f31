"""How the pipeline walks one decoder layer of each model family: the build-side twin of the engine's model
registry (``server/models``; ``quant`` sits below ``server`` and cannot import it).

A family states, for the transformers decoder layer of its ``model_type``:
- its Linears in execution order, as the groups that read one input (q/k/v, o, gate/up, down);
- which norm produces the input of q/k/v and of gate/up (None where they read the residual stream, as in
  OLMo 2's post-norm layers), and whether that norm's weight divides its output, so that a smoothing scale
  can be folded into it (Gemma's norms scale by ``1 + weight``: they cannot);
- whether o_proj's and down_proj's smoothing folds into v_proj's and up_proj's rows (separate modules only);
- whether the layer is exactly ``h + r * attn(norm(h))`` then ``h + r * mlp(norm(h))`` with nothing else
  (sandwich norms, post-norms and fused checkpoints are not), so that GPTQ may run it in stages, and the
  residual multiplier r (Granite's ``residual_multiplier``).

A MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE) has the family's attention and, in place of the MLP, a block of
experts (quant.runtime.moe): every expert's gate/up read the block's input, as does the router, so their smoothing
cannot fold into the norm and is explicit; they form one stage (calibrated from one layer pass), the downs
another.

A model type not listed here, or a layer whose Linears are not the family's, is calibrated through the
exact transformers layer forward, one Linear at a time, with explicit smoothing scales: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from quant.runtime.moe import layout_of, quantizable_linears

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class Family:
    qkv: tuple[str, ...] = QKV
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = GATE_UP
    down: str = "mlp.down_proj"
    attn_norm: str | None = "input_layernorm"  # what q/k/v read (None: the residual stream itself)
    mlp_norm: str | None = "post_attention_layernorm"  # what gate/up read
    norm_folds: bool = True  # the norms multiply by `weight`, so a smoothing scale divides into it
    fold_o_into_v: bool = True  # o_proj reads attention output, linear in v_proj's rows
    fold_down_into_up: bool = True  # down_proj reads act(gate) * up, linear in up_proj's rows
    staged: bool = True  # pre-norm, one attention and one MLP residual branch, nothing else
    residual_scale_attr: str | None = None  # config attribute scaling both residual branches
    moe: bool = False  # the MLP is a block of experts (quant.runtime.moe), gate_up/down unused

    @property
    def linears(self) -> tuple[str, ...]:
        return (*self.qkv, self.o, *self.gate_up, self.down)

    def residual_scale(self, config) -> float:
        return float(getattr(config, self.residual_scale_attr)) if self.residual_scale_attr else 1.0


LLAMA = Family()
_SANDWICH = Family(norm_folds=False, staged=False)  # pre- and post-norms around both branches (Gemma 2/3)

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,  # q/k norms act inside attention, after q/k/v: the staged pass runs the attention module
    "granite": Family(residual_scale_attr="residual_multiplier"),
    "gemma": Family(norm_folds=False),
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
    "olmo2": Family(attn_norm=None, mlp_norm=None, staged=False),  # norms on the branch outputs
    "mixtral": Family(moe=True, staged=False),
    "qwen2_moe": Family(moe=True, staged=False),  # a shared expert beside the routed ones: stages alike
    "qwen3_moe": Family(moe=True, staged=False),
    # Fused checkpoints: v and up are row ranges of one module, not folded into (yet); run exactly.
    "phi3": Family(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",), fold_o_into_v=False,
                   fold_down_into_up=False, staged=False),
}


@dataclass(frozen=True)
class LayerPlan:
    """What the pipeline does with one decoder layer: its family when the layer has that family's Linears,
    else None (exact forward, one Linear at a time, in the order `order` gives)."""

    family: Family | None
    order: tuple[str, ...] = field(default=())  # every Linear of the layer, in execution order
    residual_scale: float = 1.0
    # The Linears by stage: a stage's inputs do not depend on each other's outputs, so one layer pass captures
    # them all. A layer no family describes: one Linear per stage.
    stages: tuple[tuple[str, ...], ...] = field(default=())

    @property
    def staged(self) -> bool:
        return self.family is not None and self.family.staged


def plan(config, layer: nn.Module, order: Callable[[], tuple[str, ...]] | None = None) -> LayerPlan:
    """The plan for `layer` of a model with `config`. `order` traces the execution order of its Linears; it
    is called only for a layer no family describes (by default: the module registration order)."""
    names = tuple(quantizable_linears(layer))
    fam = FAMILIES.get(getattr(config, "model_type", None))
    if fam is not None and fam.moe:
        moe = _moe_stages(config, names, fam) if _has(layer, fam.attn_norm) else None
        if moe is not None:
            return LayerPlan(fam, tuple(n for st in moe for n in st), fam.residual_scale(config), moe)
    elif fam is not None and set(names) == set(fam.linears) and _has(layer, fam.attn_norm, fam.mlp_norm):
        return LayerPlan(fam, fam.linears, fam.residual_scale(config), (fam.qkv, (fam.o,), fam.gate_up, (fam.down,)))
    seq = tuple(order()) if order is not None else names
    return LayerPlan(None, seq, stages=tuple((n,) for n in seq))


def _moe_stages(config, names: tuple[str, ...], fam: Family) -> tuple[tuple[str, ...], ...] | None:
    """q/k/v, o, every expert's gate and up (and a shared expert's), every down; None unless the layer's
    Linears are exactly those."""
    attn = (*fam.qkv, fam.o)
    lay = layout_of(config)
    rest = [n for n in names if n not in attn]
    ups = tuple(n for n in rest if n.startswith("mlp.") and n.rpartition(".")[2] in (lay.gate, lay.up))
    downs = tuple(n for n in rest if n.startswith("mlp.") and n.rpartition(".")[2] == lay.down)
    if not set(attn) <= set(names) or len(ups) + len(downs) != len(rest) or not downs:
        return None
    return (fam.qkv, (fam.o,), ups, downs)


def _has(layer: nn.Module, *names: str | None) -> bool:
    for n in names:
        if n is None:
            continue
        try:
            layer.get_submodule(n)
        except AttributeError:
            return False
    return True
