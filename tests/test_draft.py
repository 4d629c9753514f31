"""Speculative decoding with a draft model (server/draft.py, ``--speculate draft --draft MODEL``): the settings and
the tokenizer check (one line each), the step's draft lengths with the draft's forwards counted, and exactness: a
request gives the tokens and logprobs it gives without speculation (float32), every sampling control, ``n``
samples, the prefix cache, JSON mode and a draft KV pool too small for every request included; a draft identical
to the target has every draft accepted (its positions, catch-up and rollback are right); a 4-bit draft of the same
model reports what it drafted and had accepted and what its KV held; both pools' books exact."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_same_completion as assert_same
from helpers import greedy, greedy_exact

from quant.errors import UnsupportedModelError
from server.config import EngineConfig
from server.draft import check_tokenizer, split_budget
from server.engine import Engine
from server.kv_pool import KVLayout
from server.sampling_params import SamplingParams
from server.speculate import DraftCosts, allocate, geometric

LOOP = [11, 12, 13, 14, 15, 16, 17, 18]
LINEAR = DraftCosts((1, 64), (1.0, 7.3))  # a forward over n rows: 1 + 0.1 (n - 1) one-row ones
EVERY_CONTROL = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                     presence_penalty=0.3, frequency_penalty=0.2, logit_bias=((LOOP[3], 3.0), (7, -2.0)),
                     min_tokens=4, logprobs=2)


# ------------------------------------------------------------------------------------------------ the parts alone


@pytest.mark.unit
def test_draft_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match="--speculate draft needs a draft model: --draft MODEL"):
        EngineConfig(speculate="draft").validate()
    with pytest.raises(ValueError, match="--draft is the draft model of --speculate draft"):
        EngineConfig(speculate="ngram", draft="d").validate()
    with pytest.raises(ValueError, match="not with --kv-dtype int4"):
        EngineConfig(draft="d", kv_dtype="int4").validate()
    # auto with a draft model is the draft model, on any device; without one, n-grams on the CPU
    assert EngineConfig(draft="d").validate().speculation == "draft"
    assert EngineConfig(draft="d", device="cuda").speculation == "draft"
    assert EngineConfig().speculation == "ngram" and EngineConfig(speculate="off").speculation == "off"
    # the draft's dtype: the target's, but bfloat16 for a float32 target (its precision moves only its acceptance)
    assert EngineConfig(dtype="float32").draft_torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="float16").draft_torch_dtype == torch.float16
    assert EngineConfig(dtype="float32", draft_dtype="float32").draft_torch_dtype == torch.float32
    with pytest.raises(ValueError, match="--draft-dtype must be one of auto, bfloat16, float16, float32, got 'int8'"):
        EngineConfig(draft="d", draft_dtype="int8").validate()


@pytest.mark.unit
def test_a_draft_of_another_vocabulary_is_refused_naming_a_token_that_differs():
    same = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    check_tokenizer(same, SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}), "t", "d")
    with pytest.raises(UnsupportedModelError, match=r"--draft d: its tokenizer is not t's \(2 tokens against 2, "
                                                    r"'b' differs\)"):
        check_tokenizer(same, SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 2}), "t", "d")


@pytest.mark.unit
def test_the_kv_budget_is_split_so_both_pools_hold_as_many_tokens():
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                          head_dim=16, max_position_embeddings=64, intermediate_size=128, vocab_size=100)
    target = KVLayout.from_config(cfg, torch.float32, 16)
    draft = KVLayout.from_config(SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 1}), torch.float32, 16)
    t, d = split_budget(30 * target.bytes_per_block, target, draft)
    assert t + d == 30 * target.bytes_per_block and t // target.bytes_per_block == d // draft.bytes_per_block == 20
    assert split_budget(1000, target, None) == (1000, 0)


@pytest.mark.unit
def test_the_draft_models_forwards_are_counted_in_the_draft_length():
    # a draft model as dear as the target never pays at a middling rate; nearly free, it drafts as n-grams would
    assert allocate([(geometric(0.6, 8), 0.0)], 1, 1, 64, LINEAR, LINEAR) == [0]
    free = allocate([(geometric(0.6, 8), 0.0)], 1, 1, 64, LINEAR, DraftCosts((1,), (0.0,)))
    assert free == allocate([(geometric(0.6, 8), 0.0)], 1, 1, 64, LINEAR) and free[0] > 0
    # a tenth of the target's forward: a likely draft pays, and fewer are drafted than for free
    cheap = allocate([(geometric(0.9, 8), 0.0)], 1, 1, 64, LINEAR, DraftCosts((1, 64), (0.1, 0.73)))[0]
    assert 0 < cheap <= allocate([(geometric(0.9, 8), 0.0)], 1, 1, 64, LINEAR)[0]
    # batched, the draft's j-th forward is shared: two requests draft more each than either alone would pay for
    dear = DraftCosts((1, 64), (0.5, 0.5 * 7.3))
    alone = allocate([(geometric(0.8, 8), 0.0)], 2, 2, 64, LINEAR, dear)[0]
    both = allocate([(geometric(0.8, 8), 0.0), (geometric(0.8, 8), 0.0)], 2, 2, 64, LINEAR, dear)
    assert both[0] == both[1] >= alone
    # it proposes by decode steps: weighed at their measured cost (here up to 2 rows), and beyond as a forward less
    # what the last measured step saved; six requests' drafts take its forwards past the rows measured so
    steps = DraftCosts((1, 2, 4, 8), (0.5, 0.55, 0.6, 0.8), decode=(0.1, 0.15))
    six = allocate([(geometric(0.9, 8), 0.0)] * 6, 6, 6, 64, LINEAR, steps)
    assert sum(six) > sum(allocate([(geometric(0.9, 8), 0.0)] * 6, 6, 6, 64, LINEAR, DraftCosts((1, 2, 4, 8), (0.5, 0.55, 0.6,
                                                                                                        0.8))))


# ------------------------------------------------------------------------------------- the engine, exactness

NO_COST = DraftCosts((1,), (0.0,))


def _engine(model_dir, cache_dir, draft=None, **kw) -> Engine:
    """float32; with a draft model, its costs and the target's rows set to nothing (whatever this machine measured),
    so that every request drafts all it can: exactness is tested on as many drafts as the text allows."""
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=64,
               speculate="draft" if draft else "off", draft=None if draft is None else str(draft))
    cfg.update(kw)
    eng = Engine.from_path(str(model_dir), EngineConfig(**cfg), cache_dir)
    if draft is not None:
        eng.scheduler.speculate(DraftCosts(), eng.config.speculate_tokens, eng.draft, NO_COST)
    return eng


@pytest.fixture(scope="module")
def engines(tiny_model_dir, cache_dir, tiny_w4a16_dir):
    """The tiny float32 model without speculation, drafted for by itself (in float32 too), and by its w4a16
    artifact (in bfloat16, the auto draft dtype of a float32 target)."""
    made = (_engine(tiny_model_dir, cache_dir), _engine(tiny_model_dir, cache_dir, tiny_model_dir,
                                                        draft_dtype="float32"),
            _engine(tiny_model_dir, cache_dir, tiny_w4a16_dir))
    yield made
    for e in made:
        e.close()


def assert_books(engine: Engine) -> None:
    engine.pool.audit()
    engine.draft.pool.audit()
    assert engine.pool.used_blocks == 0 and engine.draft.pool.used_blocks == 0 and not engine.draft.covered
    assert not engine.scheduler.has_work


def _prompts(engine: Engine) -> list[list[int]]:
    return [LOOP * 6, engine.tokenize("one two three four five six seven eight " * 3), list(range(100, 160))]


PARAMS = [greedy_exact(40, logprobs=2), greedy(40, stop=["three f"]),
          SamplingParams(max_new_tokens=40, seed=7, **EVERY_CONTROL),
          SamplingParams(max_new_tokens=40, seed=8, temperature=0.6, top_p=0.8)]


@pytest.mark.reference
def test_a_draft_identical_to_the_target_has_every_draft_accepted(engines):
    off, itself, _ = engines
    s = itself.scheduler
    for params in PARAMS[::2]:
        for prompt in _prompts(itself):
            before = s.model_speculated_tokens, s.model_accepted_tokens
            got = itself.complete(prompt, params)
            assert_same(got, off.complete(prompt, params))
            assert got.accounting.speculated_tokens > 0
            drafted, kept = s.model_speculated_tokens - before[0], s.model_accepted_tokens - before[1]
            assert kept == drafted  # the draft model's drafts; n-gram ones may be rejected
    assert s.model_speculated_tokens > 0
    assert_books(itself)


@pytest.mark.reference
def test_n_grams_draft_where_the_text_repeats_and_the_draft_model_elsewhere(engines):
    """Text that repeats is drafted for by n-grams (free to propose), a prompt of tokens seen once by the draft
    model, whose KV then holds the request's tokens; either way the plain tokens."""
    off, _, w4 = engines
    s = w4.scheduler

    def drafts(prompt, params):
        before = s.speculated_tokens, s.model_speculated_tokens
        got = w4.complete(prompt, params)
        assert_same(got, off.complete(prompt, params))
        model = s.model_speculated_tokens - before[1]
        return s.speculated_tokens - before[0] - model, model, got.accounting.kv_bytes_draft

    looped = greedy_exact(32, logit_bias=tuple((t, 30.0) for t in LOOP))  # its output repeats the loop's tokens
    ngram, _, _ = drafts(LOOP * 6, looped)
    assert ngram > 0
    _, model, kv = drafts(list(range(100, 160)), greedy_exact(9))
    assert model > 0 and kv > 0
    assert_books(w4)


@pytest.mark.reference
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "greedy-stop", "every-control", "top-p"])
def test_a_4bit_draft_gives_the_tokens_and_logprobs_of_plain_decoding(engines, params):
    off, _, w4 = engines
    drafted = accepted = draft_kv = 0
    for prompt in _prompts(w4):
        want, got = off.complete(prompt, params), w4.complete(prompt, params)
        assert_same(got, want)
        a = got.accounting
        assert a.accepted_tokens <= a.speculated_tokens
        assert a.kv_bytes_draft % w4.draft.layout.bytes_per_block == 0
        drafted, accepted = drafted + a.speculated_tokens, accepted + a.accepted_tokens
        draft_kv += a.kv_bytes_draft
    assert 0 < accepted <= drafted and draft_kv > 0
    t = w4.totals()
    assert t.draft_weight_bytes == w4.draft.weight_bytes > 0
    assert t.draft_kv_capacity_bytes == w4.draft.pool.capacity_bytes
    assert w4.info.speculation == f"draft {w4.draft.name} (w4a16)"
    assert_books(w4)


@pytest.mark.reference
def test_every_seed_gives_the_plain_tokens_so_each_position_has_the_plain_distribution(engines):
    """Stronger than a chi-square test: over 24 seeds, with every control on, each sample is the one plain decoding
    draws for that seed, so the distribution of each position is the plain one exactly."""
    off, _, w4 = engines
    prompt = w4.tokenize("one two three four five six seven eight " * 2)
    base = SamplingParams(max_new_tokens=12, seed=0, **EVERY_CONTROL)
    for seed in range(24):
        p = base.with_seed(seed)
        assert w4.complete(prompt, p).token_ids == off.complete(prompt, p).token_ids, seed
    assert w4.totals().speculated_tokens > 0
    assert_books(w4)


@pytest.mark.reference
def test_n_samples_the_prefix_cache_and_json_mode_with_a_draft_model(engines):
    off, _, w4 = engines
    params = SamplingParams(max_new_tokens=24, seed=3, temperature=0.8, top_k=20)
    prompt = LOOP * 6
    want = [off.complete(prompt, params.with_seed(3 + i)) for i in range(3)]
    for _ in range(2):  # the second time the target's prompt blocks come from its prefix cache
        got = w4.samples(prompt, params, 3)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[0].accounting.prompt_tokens_cached > 0
    pytest.importorskip("xgrammar")
    fmt = json.dumps({"type": "json_object"})
    prompt = w4.tokenize('{"a": 1, "b": 2, "a": 1, "b": 2, "a": 1, "b": 2')
    every = {k: v for k, v in EVERY_CONTROL.items() if k != "min_tokens"}  # (refused with a response_format)
    for params in (greedy(40, response_format=fmt), SamplingParams(max_new_tokens=40, seed=5, response_format=fmt,
                                                                   **every)):
        want, got = off.complete(prompt, params), w4.complete(prompt, params)
        assert_same(got, want)
        assert got.accounting.speculated_tokens > 0
        if got.finish_reason == "stop":
            json.loads(got.text)
    assert_books(w4)


@pytest.mark.reference
def test_pools_too_small_for_every_request_preempt_and_give_draft_kv_to_those_drafting(tiny_model_dir, cache_dir,
                                                                                      tiny_w4a16_dir):
    """A KV budget of 20 blocks of 16 (10 for the target, 10 for the draft) for eight requests of 90-token contexts:
    the target preempts and recomputes, requests not drafting give their draft KV up and catch up when they next
    draft; every output is still the plain one."""
    off = _engine(tiny_model_dir, cache_dir)
    w4 = _engine(tiny_model_dir, cache_dir, tiny_w4a16_dir, memory_budget=str(20 * off.layout.bytes_per_block),
                 draft_dtype="float32")
    try:
        assert w4.pool.num_blocks == w4.draft.pool.num_blocks == 10
        prompts = [list(range(100 + 40 * i, 133 + 40 * i)) for i in range(4)]  # no repeats: the draft model drafts
        params = [greedy_exact(56), SamplingParams(max_new_tokens=56, seed=4, **EVERY_CONTROL)]
        want = {(i, j): off.complete(p, q) for i, p in enumerate(prompts) for j, q in enumerate(params)}
        streams = {key: w4.stream(prompts[key[0]], params[key[1]])[1] for key in want}
        for key, events in streams.items():
            evs = list(events)
            assert [t for e in evs for t in e.token_ids] == list(want[key].token_ids), key
        assert w4.totals().speculated_tokens > 0
        assert w4.scheduler.preemptions > 0 and w4.draft.evictions > 0
        assert_books(w4)
    finally:
        off.close()
        w4.close()


@pytest.mark.reference
def test_a_draft_with_another_tokenizer_is_refused_at_start_in_one_line(tiny_model_dir, cache_dir, tmp_path,
                                                                        tokenizer):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = type(tokenizer).from_pretrained(other)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(other)
    with pytest.raises(UnsupportedModelError, match=r"^--draft .*its tokenizer is not .*'s \(\d+ tokens against "
                                                    r"\d+, '<not-in-the-target>' differs\)"):
        _engine(tiny_model_dir, cache_dir, other)


@pytest.mark.reference
def test_a_failing_draft_model_turns_speculation_off_and_fails_no_request(tiny_model_dir, cache_dir, tiny_w4a16_dir,
                                                                          caplog):
    off = _engine(tiny_model_dir, cache_dir)
    w4 = _engine(tiny_model_dir, cache_dir, tiny_w4a16_dir)
    try:
        params = SamplingParams(max_new_tokens=24, seed=2, **EVERY_CONTROL)

        def fail(step):
            raise RuntimeError("injected draft failure")

        w4.draft.runner.forward = fail
        prompt = list(range(100, 160))  # no repeats: the draft model is asked first
        with caplog.at_level("ERROR", logger="quantserve.engine"):
            got = w4.complete(prompt, params)
        assert got.finish_reason == off.complete(prompt, params).finish_reason
        assert got.token_ids == off.complete(prompt, params).token_ids
        assert w4.draft.broken == "RuntimeError: injected draft failure"
        assert [r.message for r in caplog.records if "draft model" in r.message] == [
            f"the draft model {w4.draft.name} failed; speculation is off from now on: RuntimeError: injected "
            "draft failure"]
        before = w4.scheduler.model_speculated_tokens
        assert w4.complete(prompt, greedy(16)).accounting.kv_bytes_draft == 0
        assert w4.complete(LOOP * 6, greedy(16)).accounting.speculated_tokens > 0  # n-grams still draft
        assert w4.scheduler.model_speculated_tokens == before
        assert_books(w4)
    finally:
        off.close()
        w4.close()
