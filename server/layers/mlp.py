"""The gated MLP: down(act(gate(x)) * up(x)), gate and up as one projection whose output is [gate | up].

Activations: SiLU (Llama, Qwen, Mistral, Phi-3, Granite, OLMo 2) and GELU with the tanh approximation (Gemma),
each a fused glue op with its eager reference (``server.fastops``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from quant.errors import UnsupportedModelError

ACTIVATIONS = {"silu": "silu_mul", "swish": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul",
               "gelu_tanh": "gelu_tanh_mul"}


def act_op(act: str) -> str:
    """The glue op of a config's ``hidden_act`` ("silu_mul", "gelu_tanh_mul"), or a one-line refusal."""
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"MLP activation {act!r} is not served (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[act]


class GatedMLP:
    """``gated``: where the gate_up projection has one (a GPU's one-row kernel), a call of one-row inputs giving
    act(gate) * up from the projection's own launch (quant.runtime.linear.WeightOnlyLinear.gated_call): a decode step of one
    sequence then launches no activation kernel. Equal to act_mul(gate_up(h)) bit for bit."""

    def __init__(self, gate_up: Callable[[Tensor], Tensor], down: Callable[[Tensor], Tensor], act: str, ops,
                 gated: Callable[[Tensor], Tensor] | None = None):
        self.gate_up, self.down, self.gated = gate_up, down, gated
        self.act_mul = getattr(ops, act_op(act))

    def hidden(self, h: Tensor) -> Tensor:
        """act(gate) * up: (T, hidden) -> (T, I), in gate_up's own launch at one row where it can."""
        if self.gated is not None and h.shape[0] == 1:
            return self.gated(h)
        return self.act_mul(self.gate_up(h))  # (T, 2I) -> (T, I)

    def __call__(self, h: Tensor) -> Tensor:
        return self.down(self.hidden(h))  # (T, I) -> (T, hidden)
