"""Granite (3.x): Llama's layout with four multipliers: the embedding's, the residual branch's, the attention
scale (instead of 1/sqrt(head_dim)), and the logits divided by ``logits_scaling``."""

from server.attention.base import AttentionSpec
from server.models import register
from server.models.base import CausalLM


@register("granite")
class Granite(CausalLM):
    def attention_spec(self, config, i: int) -> AttentionSpec:
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, float(config.attention_multiplier),
                             self.window(config, i))

    def embed_scale(self, config):
        return float(config.embedding_multiplier)

    def residual_scale(self, config) -> float:
        return float(config.residual_multiplier)

    def finish_logits(self, logits):
        return logits / self.config.logits_scaling
