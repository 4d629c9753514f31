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


class GatedMLP:
    def __init__(self, gate_up: Callable[[Tensor], Tensor], down: Callable[[Tensor], Tensor], act: str, ops):
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"MLP activation {act!r} is not served (supported: {', '.join(sorted(ACTIVATIONS))})")
        self.gate_up, self.down = gate_up, down
        self.act_mul = getattr(ops, ACTIVATIONS[act])

    def __call__(self, h: Tensor) -> Tensor:
        return self.down(self.act_mul(self.gate_up(h)))  # (T, 2I) -> (T, I) -> (T, hidden)
