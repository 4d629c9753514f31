"""Qwen3: Llama's layout with an RMSNorm over each head of q and k (before rotary)."""

from server.models import register
from server.models.base import CausalLM


@register("qwen3")
class Qwen3(CausalLM):
    qk_norm = "head"
