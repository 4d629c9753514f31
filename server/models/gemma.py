"""Gemma, Gemma 2 and Gemma 3 (text): norms that scale by (1 + w), the embedding scaled by sqrt(hidden),
GELU-tanh MLPs, and the query scale from ``query_pre_attn_scalar``. Gemma 2 and 3 add a norm on each
sub-layer's output and alternate sliding-window and global layers (``config.layer_types``); Gemma 2
soft-caps attention scores and the final logits; Gemma 3 normalises q and k per head and gives its sliding
and global layers their own rope settings."""

import torch

from server.attention.base import AttentionSpec
from server.models import register
from server.models.base import CausalLM, Norms


@register("gemma")
class Gemma(CausalLM):
    norm_offset = 1.0

    def activation(self, config) -> str:
        return getattr(config, "hidden_activation", None) or config.hidden_act

    def embed_scale(self, config):
        # transformers multiplies by the scale cast to the weight dtype (sqrt(hidden) rounded in bf16).
        return torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype)

    def attention_spec(self, config, i: int) -> AttentionSpec:
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, scalar ** -0.5, self.window(config, i),
                             getattr(config, "attn_logit_softcapping", None))


@register("gemma2")
class Gemma2(Gemma):
    norms = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

    def finish_logits(self, logits):
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


@register("gemma3_text")
class Gemma3(Gemma2):
    qk_norm = "head"

    def rope_layer_type(self, config, i: int) -> str | None:
        return self.layer_type(config, i)
