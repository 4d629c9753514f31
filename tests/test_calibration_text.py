"""Model-generated calibration text (quant.build.calibration.self_generated): each sequence from a generator of its
own, so the text does not depend on how many are generated at once; drawn from the model's distribution at
temperature 1 with end-of-sequence tokens never drawn; the caller's random state untouched."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import hf_causal_lm
from transformers import PretrainedConfig

from quant.build import calibration

pytestmark = pytest.mark.reference


class FixedLM(torch.nn.Module):
    """A stand-in language model whose next-token logits are always ``logits``, whatever the context."""

    def __init__(self, logits: torch.Tensor, eos: int):
        super().__init__()
        self.logits = logits
        self.config = PretrainedConfig(vocab_size=logits.numel(), num_hidden_layers=1)
        self.generation_config = SimpleNamespace(eos_token_id=[eos])
        self.device = torch.device("cpu")

    def forward(self, input_ids, cache=None, use_cache=True):
        return SimpleNamespace(logits=self.logits.expand(input_ids.shape[0], input_ids.shape[1], -1).clone())


class FixedLMOlderSignature(FixedLM):
    """transformers before 5.25 names the forward's cache argument ``past_key_values``."""

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        return super().forward(input_ids, past_key_values, use_cache)


def fake_tok(eos: int):
    return SimpleNamespace(all_special_ids=[eos], eos_token_id=eos)


def test_the_text_does_not_depend_on_how_many_sequences_are_generated_at_once(tiny_model_dir, tokenizer):
    model = hf_causal_lm(tiny_model_dir)
    state = torch.get_rng_state()
    runs = [calibration.self_generated(model, tokenizer, 5, 12, seed=3, batch=b) for b in (1, 2, 5)]
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state untouched
    assert all(torch.equal(r.ids, runs[0].ids) for r in runs) and runs[0].ids.shape == (5, 12)
    assert len({r.fingerprint for r in runs}) == 1
    other = calibration.self_generated(model, tokenizer, 5, 12, seed=4, batch=5)
    assert not torch.equal(other.ids, runs[0].ids)


def test_tokens_are_drawn_from_the_models_distribution_without_end_of_sequence():
    """Over 4,000 draws from fixed logits, end of sequence (the likeliest token) never comes and every other
    token comes as often as softmax over the rest says (chi-square, 7 degrees of freedom, p > 0.001)."""
    logits = torch.tensor([4.0, 0.0, 0.5, 1.0, -1.0, 0.2, 1.5, -0.5, 0.8])
    eos = 0
    model = FixedLM(logits, eos)
    out = calibration.self_generated(model, fake_tok(eos), 40, 101, seed=0, batch=16)
    drawn = out.ids[:, 1:].flatten()  # the first token of each is the seeded start
    assert drawn.numel() == 4000 and not (drawn == eos).any()
    want = logits.clone()
    want[eos] = -math.inf
    expected = want.softmax(-1)[1:] * drawn.numel()
    counts = torch.bincount(drawn, minlength=logits.numel())[1:].double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts.tolist(), expected.tolist())  # the 0.999 quantile of chi-square(7)
    older = calibration.self_generated(FixedLMOlderSignature(logits, eos), fake_tok(eos), 40, 101, seed=0, batch=7)
    assert torch.equal(older.ids, out.ids)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2-window", "phi3-partial-window"])
def test_sliding_window_families_generate_past_their_window_alike_at_any_batch(arch, arch_dirs, tokenizer):
    """The families whose caches keep a window (of 32 tokens here) generate 40-token sequences through it."""
    model = hf_causal_lm(arch_dirs(arch))
    one, three = (calibration.self_generated(model, tokenizer, 3, 40, seed=1, batch=b) for b in (1, 3))
    assert torch.equal(one.ids, three.ids) and one.ids.shape == (3, 40)


def test_the_batch_is_what_memory_holds_up_to_the_cap():
    from transformers import LlamaConfig

    from quant.shape import memory as shape_memory

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128)
    per_row = 2 * 512 * shape_memory.kv_bytes_per_token(cfg, torch.float32) + 4 * 1000  # fp32 KV twice, logits
    assert per_row == 2 * 512 * (2 * 2 * 2 * 16 * 4) + 4000
    assert calibration.generation_batch(cfg, 128, 512, 10**12) == calibration.GENERATION_BATCH
    assert calibration.generation_batch(cfg, 5, 512, 10**12) == 5
    assert calibration.generation_batch(cfg, 128, 512, 7 * per_row + 1) == 7
    assert calibration.generation_batch(cfg, 128, 512, 0) == 1
