"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layout with q/k/v and gate/up stored fused in the checkpoint
(``qkv_proj``, ``gate_up_proj`` = [gate | up]), partial rotary where the config says, LongRoPE scaling, and a
sliding window on every layer when the config has one."""

from server.models import register
from server.models.base import CausalLM


@register("phi3")
class Phi3(CausalLM):
    qkv = ("self_attn.qkv_proj",)
    gate_up = ("mlp.gate_up_proj",)
