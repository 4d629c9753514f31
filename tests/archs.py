"""Tiny random-weight models of every architecture the engine serves, made in the test session.

hidden 256, 2 layers, the default model's tokenizer (its vocab), float32, with an ``initializer_range`` large
enough that greedy output is not one repeated token. Windowed variants use a window of 32, so a 100-token
prompt and 48 generated tokens run well past it.
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 32

# name -> (config class name in transformers, overrides)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    # Gemma 2/3 norm each sub-layer's output, so a large embedding (scaled by sqrt(hidden)) would drown them out.
    "gemma2": ("Gemma2Config", {"initializer_range": 0.01, "sliding_window": WINDOW, "query_pre_attn_scalar": 48,
                                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", {"initializer_range": 0.01, "sliding_window": WINDOW, "query_pre_attn_scalar": 48,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {}),
    "phi3-partial-window": ("Phi3Config", {"sliding_window": WINDOW, "partial_rotary_factor": 0.75}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "residual_multiplier": 0.7,
                                  "attention_multiplier": 0.1, "logits_scaling": 1.5}),
    "olmo2": ("Olmo2Config", {}),
}


def make_tiny(name: str, path: Path, tokenizer, seed: int = 0) -> Path:
    import transformers

    cls_name, overrides = ARCHITECTURES[name]
    cfg = dict(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        initializer_range=0.08, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    cfg.update(overrides)
    config = getattr(transformers, cls_name)(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms that are not all ones (Gemma's 1 + w would otherwise be exactly 1)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.0, 1.5) if config.model_type.startswith("gemma") else p.uniform_(0.7, 1.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
