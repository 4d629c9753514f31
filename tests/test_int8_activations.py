"""``--int4-activations int8``: int4 projections computing on their input quantized in blocks of 32 columns
(quant/runtime/int4.py, quant/runtime/kernels/csrc/int4_a8_ops.cpp). The op against its reference is in
tests/test_rows.py; here the served model against transformers' forward of the same modules, every row count and
speculation agreeing, and what is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from helpers import assert_same_completion, gptq_linear, greedy_exact

from quant.runtime import int4
from quant.runtime.kernels import int4_layout
from quant.runtime.loader import load
from server.config import EngineConfig
from server.engine import Engine
from server.speculate import DraftCosts

pytestmark = pytest.mark.reference

needs_avx2_layout = pytest.mark.skipif(int4_layout.cpu_layout() != (32, True),
                                       reason="int8 activations are built for AVX2's int4 layout only")


def _engine(path, cache_dir, **kw) -> Engine:
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=64, int4_activations="int8")
    cfg.update(kw)
    eng = Engine.from_path(str(path), EngineConfig(**cfg), cache_dir)
    if cfg.get("speculate") == "ngram":  # every request drafts all it can, whatever this machine measured
        eng.scheduler.speculate(DraftCosts(), eng.config.speculate_tokens)
    return eng


PROMPT = [5, 9, 13, 17, 21, 25] * 6 + list(range(40, 60))


@pytest.mark.parametrize("act_order", [False, True])  # act-order: blocks of the kernel's (permuted) column order
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_of_the_module_computes_its_reference(act_order, dtype):
    """The module's paths (``rows``: the int8 product where it is built; the others on the dequantized blocks) and
    its forward at every row count against ``reference_forward``, which quantizes the input as they do."""
    m = gptq_linear(96, 256, True, act_order, sym=False)
    m.prepare(dtype)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    plain = m.reference_forward(x)
    m.use_int8_activations()
    ref = m.reference_forward(x)
    assert float((ref - plain).abs().max() / plain.abs().max()) > 1e-4  # the activations' rounding shows
    paths = m.paths(dtype)
    assert ("rows" in paths) == (int4_layout.cpu_layout() == (32, True))
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for name, call in paths.items():
        y = call(x)
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < tol, name
    assert "int8-activations" in m.plan_key(dtype)


def _forward_logprobs(model, ids: list[int], prompt: int) -> list[float]:
    """transformers' forward over prompt + generated tokens: each generated token's logprob (float32)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[prompt - 1 + i, t].item() for i, t in enumerate(ids[prompt:])]


@needs_avx2_layout
def test_served_logprobs_are_those_of_the_modules_own_forward(tiny_w4a16_dir, cache_dir):
    """Greedy in float32: each generated token's logprob as the engine computed it (fused projections, per row count
    the measured path, the int8 product at one row) against transformers' forward over the same modules, each
    quantizing its input; ~1e-5 apart, where the forward without int8 activations is ~2e-3 away."""
    model = load(tiny_w4a16_dir, dtype=torch.float32).model
    assert f"({7 * model.config.num_hidden_layers} modules)" in int4.use_int8_activations(model)
    plain = load(tiny_w4a16_dir, dtype=torch.float32).model
    eng = _engine(tiny_w4a16_dir, cache_dir, speculate="off")
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
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(tiny_w4a16_dir, cache_dir):
    """Verification computes several rows per request where plain decoding computes one: both on int8 activations,
    the same tokens and logprobs (float32)."""
    off = _engine(tiny_w4a16_dir, cache_dir, speculate="off")
    on = _engine(tiny_w4a16_dir, cache_dir, speculate="ngram")
    try:
        params = greedy_exact(40, logprobs=2)
        want, got = off.complete(PROMPT, params), on.complete(PROMPT, params)
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


def test_quant_eval_reports_their_cost_on_the_same_weights(capsys, tiny_w4a16_dir, text_file):
    """In float64 (eval's default: the reference arithmetic), so on any CPU: int8 activations against float ones."""
    import json

    assert run_cli("eval", tiny_w4a16_dir, "--data", text_file, "--windows", "2", "--seqlen", "32",
                   "--int4-activations", "int8", "--json", "--no-progress") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["int4_activations"] == "int8" and got["tokens"] == 2 * 31
    assert 0 < got["mean_kl"] < 0.01 and abs(got["delta_ppl_pct"]) < 2


def test_quant_eval_takes_one_choice_at_a_time(capsys, tiny_w4a16_dir, text_file):
    assert run_cli("eval", tiny_w4a16_dir, "--data", text_file, "--windows", "2", "--seqlen", "32",
                   "--int4-activations", "int8", "--kv-dtype", "int8", "--no-progress") == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == ["quant eval: error: --kv-dtype and --int4-activations each measure one choice against the "
                   "artifact: give one"]
