"""A decoder model's shape: the dimensions every memory figure is computed from, read from an HF config or
taken from a table of known sizes."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    name: str = "custom"

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size, tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            name=getattr(config, "_name_or_path", "") or "config",
        )

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of the Linears in one decoder layer."""
        h, kv, d, H, I = self.heads, self.kv_heads, self.head_dim, self.hidden, self.intermediate
        return [("q_proj", h * d, H), ("k_proj", kv * d, H), ("v_proj", kv * d, H), ("o_proj", H, h * d),
                ("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)]

    def block_params(self) -> int:
        return self.layers * (sum(n * k for _, n, k in self.linears()) + 2 * self.hidden)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def params(self) -> int:
        return self.block_params() + self.embedding_params()

    def to_dict(self) -> dict:
        return asdict(self)


# Llama-family shapes for `--params 7B`-style sizes (public configs).
KNOWN_SHAPES = {
    "135M": ModelShape(30, 576, 1536, 9, 3, 64, 49152, True, "SmolLM2-135M"),
    "360M": ModelShape(32, 960, 2560, 15, 5, 64, 49152, True, "SmolLM2-360M"),
    "1B": ModelShape(16, 2048, 8192, 32, 8, 64, 128256, True, "Llama-3.2-1B"),
    "1.7B": ModelShape(24, 2048, 8192, 32, 32, 64, 49152, True, "SmolLM2-1.7B"),
    "3B": ModelShape(28, 3072, 8192, 24, 8, 128, 128256, True, "Llama-3.2-3B"),
    "7B": ModelShape(32, 4096, 11008, 32, 32, 128, 32000, False, "Llama-2-7B"),
    "8B": ModelShape(32, 4096, 14336, 32, 8, 128, 128256, False, "Llama-3.1-8B"),
    "13B": ModelShape(40, 5120, 13824, 40, 40, 128, 32000, False, "Llama-2-13B"),
    "70B": ModelShape(80, 8192, 28672, 64, 8, 128, 128256, False, "Llama-3.1-70B"),
}


def parse_size(text: str) -> float:
    """'7B' -> 7e9, '135M' -> 1.35e8, '1.5e9' -> 1.5e9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"cannot read a parameter count from {text!r} (try 7B, 135M)")
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * mult


def shape_for_params(params: float) -> ModelShape:
    """The known Llama-family shape nearest (in log space) to `params`."""
    return min(KNOWN_SHAPES.values(), key=lambda s: abs(math.log(s.params() / params)))
