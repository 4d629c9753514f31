"""Llama 1-3.x (rope scaling: linear, llama3, yarn), Mistral and Qwen2: pre-norm decoders with SiLU-gated MLPs.
Qwen2 brings q/k/v biases (carried by its projections); Mistral applies its sliding window to every layer,
Qwen2 to the layers ``config.layer_types`` marks (``use_sliding_window`` and ``max_window_layers``)."""

from server.models import register
from server.models.base import CausalLM


@register("llama", "mistral", "qwen2")
class Llama(CausalLM):
    pass
