"""Mixture-of-experts layers as the pipeline and the loader see them: one Linear per projection per expert.

transformers 5 holds a MoE block's experts as two 3-D parameters, ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), which no per-Linear scheme would touch (left in float, a Mixtral "w4a16" artifact
compressed 1.08x). Checkpoints name them per expert, and so do the GPTQ checkpoints other tools write and
vLLM reads: Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen2/3-MoE ``mlp.experts.{e}.gate_proj/
up_proj/down_proj``. ``unfuse_experts`` replaces each experts module by ``ExpertLinears``, computing the same
function with those per-expert Linears, so every scheme quantizes each expert's projections (GPTQ and W8A8
calibrate each on the tokens routed to it), and ``Names`` maps the model's tensor names to the checkpoint's
so that the artifact stores them as the checkpoint does. Routers stay float: transformers' routers are not
Linears, and a Linear gate (Qwen2-MoE's ``shared_expert_gate``, one output) is marked ``KeptFloat``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from quant.errors import UnsupportedModelError


class KeptFloat(nn.Linear):
    """A Linear that no scheme quantizes (a router's gate: a few KB, and its outputs decide the routing)."""


def quantizable(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) and not isinstance(mod, KeptFloat)


def quantizable_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """The Linears under `module` that a scheme quantizes, by name relative to it."""
    return {n: m for n, m in module.named_modules() if quantizable(m)}


@dataclass(frozen=True)
class Layout:
    """How a family's checkpoints name a MoE block: the block's own name and each expert's projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


LAYOUTS = {"mixtral": Layout(block="block_sparse_moe", gate="w1", up="w3", down="w2")}
DEFAULT_LAYOUT = Layout()  # Qwen2-MoE, Qwen3-MoE and the other transformers MoE models converted like them
FLOAT_GATES = ("shared_expert_gate",)  # Linear gates of a MoE block (Qwen2-MoE)


def layout_of(config) -> Layout:
    """How `config`'s family names its MoE blocks."""
    return LAYOUTS.get(getattr(config, "model_type", ""), DEFAULT_LAYOUT)


class Expert(nn.Module):
    """One expert's MLP: down(act(gate(x)) * up(x)), its Linears under the checkpoint's names."""

    def __init__(self, layout: Layout, hidden: int, inter: int, act_fn, device=None, dtype=None):
        super().__init__()
        self.names = (layout.gate, layout.up, layout.down)
        self.act_fn = act_fn
        for name, (o, i) in zip(self.names, ((inter, hidden), (inter, hidden), (hidden, inter))):
            setattr(self, name, nn.Linear(i, o, bias=False, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class ExpertLinears(nn.ModuleList):
    """A MoE block's experts, one ``Expert`` each, called as transformers calls its experts module:
    (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H), each token's expert outputs
    weighted and summed. Only experts that received tokens run, as in transformers' eager loop."""

    def __init__(self, experts: list[Expert]):
        super().__init__(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # (T, H)
        # The same selection order as transformers' loop (so equal inputs give equal sums).
        mask = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)  # (E+1, k, T)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero().squeeze(-1).tolist()  # one host sync per block
        for e in hit:
            if e == len(self):
                continue
            pos, tok = torch.where(mask[e])  # (n_e,) each
            y = self[e](hidden_states[tok]) * top_k_weights[tok, pos, None]  # (n_e, H)
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def _is_fused_experts(mod: nn.Module) -> bool:
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def _check(name: str, mod: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a fused experts module in the layout ExpertLinears computes."""
    unsupported = [f for f, bad in (("transposed weights", getattr(mod, "is_transposed", False)),
                                    ("expert biases", getattr(mod, "has_bias", False)),
                                    ("interleaved gate/up", not getattr(mod, "is_concatenated", True)),
                                    ("no gate projection", not getattr(mod, "has_gate", True)),
                                    ("a post-expert norm", getattr(mod, "has_post_expert_norm", False))) if bad]
    e, two_i, h = mod.gate_up_proj.shape
    if unsupported or mod.down_proj.shape != (e, h, two_i // 2) or two_i % 2 or not hasattr(mod, "act_fn"):
        what = ", ".join(unsupported) or f"shapes {tuple(mod.gate_up_proj.shape)} / {tuple(mod.down_proj.shape)}"
        raise UnsupportedModelError(f"{name} ({type(mod).__name__}): MoE experts with {what} are not supported")
    return e, h, two_i // 2


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of `model` by ExpertLinears (weights sliced from the 3-D tensors;
    meta in, meta out) and mark Linear gates KeptFloat. Returns the number of experts modules replaced."""
    layout = layout_of(model.config)
    found = [(n, m) for n, m in model.named_modules() if _is_fused_experts(m)]
    for name, mod in found:
        n_exp, hidden, inter = _check(name, mod)
        gu, down = mod.gate_up_proj, mod.down_proj
        meta = gu.is_meta
        experts = []
        for e in range(n_exp):
            ex = Expert(layout, hidden, inter, mod.act_fn, device="meta", dtype=gu.dtype)
            if not meta:  # views of the fused tensors: nothing is copied
                for lin, w in zip((getattr(ex, n) for n in ex.names), (gu[e, :inter], gu[e, inter:], down[e])):
                    lin.weight = nn.Parameter(w, requires_grad=False)
            experts.append(ex)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ExpertLinears(experts))
    if found:
        for name, mod in list(model.named_modules()):
            if name.rpartition(".")[2] in FLOAT_GATES and type(mod) is nn.Linear:
                mod.__class__ = KeptFloat
    return len(found)


class Names:
    """Model tensor names <-> checkpoint names: transformers renames Mixtral's ``block_sparse_moe`` block to
    ``mlp``; everything else keeps its name."""

    def __init__(self, config):
        layout = layout_of(config)
        self._to_ckpt = self._from_ckpt = None
        if layout.block != "mlp":
            self._to_ckpt = (re.compile(r"(^|\.)(layers\.\d+\.)mlp\."), rf"\1\2{layout.block}.")
            self._from_ckpt = (re.compile(rf"(^|\.)(layers\.\d+\.){re.escape(layout.block)}\."), r"\1\2mlp.")

    def to_checkpoint(self, name: str) -> str:
        return name if self._to_ckpt is None else self._to_ckpt[0].sub(self._to_ckpt[1], name, count=1)

    def to_model(self, name: str) -> str:
        return name if self._from_ckpt is None else self._from_ckpt[0].sub(self._from_ckpt[1], name, count=1)


def describe(model: nn.Module) -> dict | None:
    """The manifest's account of a MoE model's experts (None for a dense model)."""
    blocks = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    if not blocks:
        return None
    layout = layout_of(model.config)
    return {
        "moe_layers": len(blocks),
        "experts_per_layer": len(blocks[0]),
        "layout": f"one Linear per projection per expert, stored under the checkpoint's names "
                  f"(layers.N.{layout.block}.experts.E.{layout.gate}/{layout.up}/{layout.down}); routers stay float",
        "loads_in": "quant.load and vLLM read this layout; transformers reads it once the experts are defused "
                    "(gptqmodel's Defuser, replace_fused_blocks), as its own MoE classes hold experts as 3-D tensors",
    }
