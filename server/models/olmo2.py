"""OLMo 2: no norm before the sub-layers, one on each sub-layer's output, and q/k normalised over the whole
projection (H·D and Hkv·D wide) before rotary."""

from server.models import register
from server.models.base import CausalLM, Norms


@register("olmo2")
class Olmo2(CausalLM):
    norms = Norms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                  mlp_out="post_feedforward_layernorm")
    qk_norm = "proj"
