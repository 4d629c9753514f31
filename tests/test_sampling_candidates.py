"""The CPU sampler's fast path: the fused uniforms against their reference bits, and the draw among each row's top
candidates (server/sampling.py ``_draw_candidates``) against the full sort's draw, token for token, including the
batches it must hand back to the full sort. CPU only, a few seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from server import fastops, sampling
from server.random_stream import random_uniform
from server.sampling import SamplingBatch, _draw_candidates, processed_logits, sample
from server.sampling_params import SamplingParams

V = 3000
K = 64  # TOP_CANDIDATES for these tests: nuclei on both sides of it
# the candidate path with the reference uniforms, so its logic is tested wherever the C++ library is not built
REF_OPS = SimpleNamespace(fused=True, random_uniform=random_uniform)


@pytest.fixture(autouse=True)
def _few_candidates(monkeypatch):
    monkeypatch.setattr(sampling, "TOP_CANDIDATES", K)


def _peaky(B: int, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's: a few dozen likely tokens over a long flat tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 2
    x[:, torch.randperm(V, generator=g)[:30]] += 9
    return x


def _candidates(logits, batch):
    """The candidate path on a batch's logits, as sample() calls it (steps 1-3 first)."""
    return _draw_candidates(processed_logits(logits, batch), batch, random_uniform)


def _build(params, seeds, history=True):
    n = len(params)
    hist = [[1, 2, 5, 5, 9, 40]] * n if history else None
    return SamplingBatch.build(params, seeds, [s * 3 for s in seeds], hist, prompt_lens=[2] * n)


QUALIFYING = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=0.8, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                   logit_bias={7: 4.0, 11: -100.0}),
    SamplingParams(temperature=1.0, top_k=K),  # the last candidate's own value: qualifies only without ties there
    SamplingParams(temperature=0.0),  # a greedy row rides along
]


@pytest.mark.unit
@pytest.mark.skipif(not fastops.load(), reason=f"fused ops not built: {fastops.unavailable_reason()}")
def test_fused_uniforms_are_the_reference_bits():
    seeds = torch.tensor([0, 1, 2**32 - 1, 2**32 + 5, 2**63 - 1, 123456789012345])
    steps = torch.tensor([0, 7, 2**31, 2**40 + 3, 99, 1])
    assert torch.equal(fastops.fused_random_uniform(seeds, steps, 5000), random_uniform(seeds, steps, 5000))
    ids = torch.randint(0, 2**20, (6, 77), generator=torch.Generator().manual_seed(3))
    assert torch.equal(fastops.fused_random_uniform(seeds, steps, ids), random_uniform(seeds, steps, ids))
    full = random_uniform(seeds, steps, 2**20)
    assert torch.equal(random_uniform(seeds, steps, ids), full.gather(1, ids))  # an id's uniform is its own


@pytest.mark.unit
def test_candidate_draw_is_the_full_sorts_draw():
    """Every qualifying row, alone and batched, over many seeds: the candidate path runs (not handed back) and
    draws what the full sort draws, logprobs included."""
    for rep in range(6):
        logits = _peaky(len(QUALIFYING), rep)
        seeds = [rep * 100 + i for i in range(len(QUALIFYING))]
        batch = _build(QUALIFYING, seeds)
        assert _candidates(logits, batch) is not None
        fast, full = sample(logits, batch, REF_OPS), sample(logits, batch)
        assert torch.equal(fast.tokens, full.tokens)
        assert torch.allclose(fast.logprob, full.logprob)
    draws = {}
    for p in QUALIFYING[:5]:
        logits = _peaky(1, 9).expand(200, V)
        batch = _build([p] * 200, list(range(200)))
        fast, full = sample(logits, batch, REF_OPS).tokens, sample(logits, batch).tokens
        assert torch.equal(fast, full), p
        draws[p] = len(set(fast.tolist()))
    assert all(n > 1 for n in draws.values()), draws  # the seeds draw different tokens: the test can see a wrong draw


@pytest.mark.unit
def test_json_mask_rows_qualify_on_their_allowed_tokens():
    """A grammar that allows few tokens leaves even a plain-temperature row's kept set among its candidates."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.8)]
    logits = _peaky(2, 4)
    batch = _build(params, [5, 6], history=False)
    allowed = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
    allowed[:, :2] = -1  # tokens 0..63 allowed
    batch.allowed = allowed
    assert _candidates(logits, batch) is not None
    for step in range(40):
        batch.steps = torch.full((2,), step)
        fast, full = sample(logits, batch, REF_OPS).tokens, sample(logits, batch).tokens
        assert torch.equal(fast, full) and bool((fast < 64).all())


HANDED_BACK = [
    SamplingParams(temperature=1.0, top_p=0.9999),  # flat tail: the nucleus is wider than the candidates
    SamplingParams(temperature=1.0, top_k=K + 1),  # top-k past the candidates
    SamplingParams(temperature=3.0, min_p=0.001),  # min-p keeps more than the candidates
]


@pytest.mark.unit
@pytest.mark.parametrize("p", HANDED_BACK, ids=["top_p", "top_k", "min_p"])
def test_rows_reaching_past_the_candidates_take_the_full_sort(p):
    logits = _peaky(2, 2)
    for batch in (_build([p], [1]), _build([p, QUALIFYING[0]], [1, 2])):
        rows = batch.seeds.shape[0]
        assert _candidates(logits[:rows], batch) is None
        assert torch.equal(sample(logits[:rows], batch, REF_OPS).tokens, sample(logits[:rows], batch).tokens)
    # a plain-temperature row among filtering ones keeps every token: the batch takes the full sort
    mixed = _build([SamplingParams(temperature=0.7), QUALIFYING[0]], [1, 2])
    assert _candidates(logits, mixed) is None


@pytest.mark.unit
def test_ties_at_the_last_candidate_hand_back():
    """Tokens tied with the last candidate may lie outside the candidates: a row that keeps them is handed back."""
    logits = torch.zeros(1, V)
    logits[0, :10] = 5.0
    batch = _build([SamplingParams(temperature=1.0, top_k=K)], [0], history=False)
    assert _candidates(logits, batch) is None
    batch = _build([SamplingParams(temperature=1.0, top_k=10)], [0], history=False)
    assert _candidates(logits, batch) is not None
