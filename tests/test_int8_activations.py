"""``--int4-activations int8``: int4 projections computing on their input quantized in blocks of 32 columns
(quant/runtime/int4.py, quant/runtime/kernels/csrc/int4_a8_ops.cpp). The op against its reference is in
tests/test_rows.py; here the served model against transformers' forward of the same modules, every row count and
speculation agreeing, and what is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from helpers import assert_same_completion, greedy_exact

from quant.runtime import int4
from quant.runtime.kernels import int4_layout
from quant.runtime.loader import load
from server.config import EngineConfig
from server.engine import Engine
from server.speculate import DraftCosts

pytestmark = pytest.mark.reference

needs_avx2_layout = pytest.mark.skipif(int4_layout.cpu_layout() != (32, True),
                                       reason="int8 activations are built for AVX2's int4 layout only")


@pytest.fixture(scope="module")
def w4a16_dir(tmp_path_factory, tiny_model_dir, text_file):
    out = tmp_path_factory.mktemp("int8act") / "w4a16"
    assert run_cli("build", "--model", tiny_model_dir, "--scheme", "w4a16", "--calib", text_file, "--calib-samples",
                   "4", "--calib-seqlen", "64", "--no-progress", "--out", out) == 0
    return out


def _engine(path, cache_dir, **kw) -> Engine:
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=64, int4_activations="int8")
    cfg.update(kw)
    eng = Engine.from_path(str(path), EngineConfig(**cfg), cache_dir)
    if cfg.get("speculate") == "ngram":  # every request drafts all it can, whatever this machine measured
        eng.scheduler.speculate(DraftCosts(), eng.config.speculate_tokens)
    return eng


PROMPT = [5, 9, 13, 17, 21, 25] * 6 + list(range(40, 60))


def _forward_logprobs(model, ids: list[int], prompt: int) -> list[float]:
    """transformers' forward over prompt + generated tokens: each generated token's logprob (float32)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[prompt - 1 + i, t].item() for i, t in enumerate(ids[prompt:])]


@needs_avx2_layout
def test_served_logprobs_are_those_of_the_modules_own_forward(w4a16_dir, cache_dir):
    """Greedy in float32: each generated token's logprob as the engine computed it (fused projections, per row count
    the measured path, the int8 product at one row) against transformers' forward over the same modules, each
    quantizing its input; ~1e-5 apart, where the forward without int8 activations is ~2e-3 away."""
    model = load(w4a16_dir, dtype=torch.float32).model
    assert f"({7 * model.config.num_hidden_layers} modules)" in int4.use_int8_activations(model)
    plain = load(w4a16_dir, dtype=torch.float32).model
    eng = _engine(w4a16_dir, cache_dir, speculate="off")
    try:
        got = eng.complete(PROMPT, greedy_exact(24, logprobs=1))
        assert any("int8 activations" in k for k in eng.info.kernels)
    finally:
        eng.close()
    ids = PROMPT + list(got.token_ids)
    served = [a.logprob for a in got.logprobs]
    own, other = _forward_logprobs(model, ids, len(PROMPT)), _forward_logprobs(plain, ids, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(served, own, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(served, other, strict=True)) > 5e-4


@needs_avx2_layout
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(w4a16_dir, cache_dir):
    """Verification computes several rows per request where plain decoding computes one: both on int8 activations,
    the same tokens and logprobs (float32)."""
    off = _engine(w4a16_dir, cache_dir, speculate="off")
    on = _engine(w4a16_dir, cache_dir, speculate="ngram")
    try:
        want, got = off.complete(PROMPT, greedy_exact(40, logprobs=2)), on.complete(PROMPT, greedy_exact(40, logprobs=2))
        assert_same_completion(got, want)
        assert got.accounting.speculated_tokens > 0
    finally:
        off.close()
        on.close()


def test_what_int8_activations_refuse(tmp_path, tiny_model_dir, cache_dir):
    with pytest.raises(ValueError, match="--int4-activations must be one of float, int8"):
        EngineConfig(int4_activations="int4").validate()
    with pytest.raises(ValueError, match="applies to int4 weights"):  # a float model has none
        Engine.from_path(str(tiny_model_dir), EngineConfig(memory_budget="2MiB", dtype="float32",
                                                           int4_activations="int8"), cache_dir)
