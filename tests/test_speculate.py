"""Speculative decoding with n-gram drafts (server/speculate.py): the proposer, the draft length, the drafts' blocks
(taken only when free, given back once verified), and exactness: with speculation on a request gives the tokens
and logprobs it gives with it off (float32; logprobs within 1e-4), every sampling control, ``n`` samples, the prefix cache, preemption,
JSON mode, stop strings and streams included; the distribution of each position equal by a chi-square test over
disjoint seeds; the pool's books exact."""

from __future__ import annotations

import json
from collections import Counter

from dataclasses import replace

import pytest
import torch
from archs import ARCHITECTURES
from helpers import assert_same_completion as assert_same
from helpers import greedy, greedy_exact

from server.config import EngineConfig
from server.engine import Engine
from server.kv_pool import BlockPool, KVLayout
from server.sampling_params import SamplingParams
from server.scheduler import ON_DEMAND, RESERVE, Scheduler, Sequence
from server.speculate import (
    CALIBRATION_DECAY,
    CALIBRATION_PRIOR,
    MARGIN,
    MATCH_CAP,
    MAX_PROBE_AFTER,
    MAX_RATE,
    PRIOR_BETA,
    PROBE_AFTER,
    PROBE_RATE,
    Calibration,
    DraftCosts,
    NgramIndex,
    Speculation,
    accepted,
    allocate,
    expected,
    geometric,
)

BS = 16
LOOP = [11, 12, 13, 14, 15, 16, 17, 18]  # a prompt that repeats itself: its n-grams predict its continuation
# a forward over n rows costs 1 + 0.1 (n - 1) one-row ones, up to 64 rows
LINEAR = DraftCosts((1, 64), (1.0, 7.3))


# ------------------------------------------------------------------------------------------------ the parts alone


@pytest.mark.unit
def test_the_draws_accept_the_drafts_up_to_the_first_they_differ_from():
    assert accepted([5, 6, 7], [5, 6, 7, 9]) == 3  # all kept, 9 the bonus token
    assert accepted([5, 6, 7], [5, 8, 7, 9]) == 1  # 8 drawn where 6 was drafted: 5 kept, then 8
    assert accepted([5, 6, 7], [4, 6, 7, 9]) == 0
    assert accepted([], [4]) == 0


@pytest.mark.unit
def test_the_ngram_index_proposes_what_followed_the_last_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert idx.propose(3) == [4, 9, 2]  # (1, 2, 3) last occurred at the start: 4 followed it
    idx.extend([7])
    assert idx.propose(3) == []  # (3, 7), (2, 3, 7), ... never occurred before
    grown = NgramIndex()
    for t in [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3, 7, 2, 3]:
        grown.extend([t])
    assert grown.propose(2) == [7, 2] == NgramIndex(grown.tokens).propose(2)  # (2, 3) last ended before 7
    assert grown.propose(0) == [] and NgramIndex([1]).propose(4) == []
    assert NgramIndex([1, 2, 1, 2]).propose(5) == [1, 2]  # what follows runs up to the end of the text


@pytest.mark.unit
def test_the_draft_length_follows_the_acceptance_rate():
    alone = [allocate([(geometric(a, 8), 0.0)], 1, 1, 64, LINEAR)[0] for a in (0.0, 0.05, 0.2, 0.5, 0.8, 0.95)]
    assert alone[:2] == [0, 0] and alone[2] > 0 and alone == sorted(alone) and alone[-1] == 8  # 0.05: never pays
    assert allocate([(geometric(0.99, 3), 0.0)], 1, 1, 64, LINEAR) == [3]  # no more than it has
    assert allocate([(geometric(0.99, 8), 0.0)], 1, 1, 2, LINEAR) == [2]  # nor than the step leaves
    assert allocate([(geometric(0.5, 8), 0.0)], 1, 1, 64, DraftCosts((1, 2), (1.0, 11.0))) == [0]  # rows too dear
    assert allocate([(geometric(0.8, 8), 0.0)], 1, 1, 64, DraftCosts()) == [8]  # rows that cost nothing: every draft
    assert allocate([(geometric(0.8, 8), 10.0)], 1, 1, 64, DraftCosts()) == [0]  # ... but their draws do
    # In a batch of 16 whose rows cost their share of the compute, only drafts likely to be kept pay, best first:
    # rate 0.9 drafts more than 0.6, and the 0.3 request none.
    share = DraftCosts((1, 16, 64), (1.0, 2.5, 5.5))
    ks = allocate([(geometric(0.9, 8), 0.0), (geometric(0.6, 8), 0.0), (geometric(0.3, 8), 0.0)], 16, 16, 64, share)
    assert ks[0] > ks[1] > 0 and ks[2] == 0
    assert allocate([(geometric(0.3, 8), 0.0)], 1, 1, 64, LINEAR)[0] > 0  # alone, 0.3 pays
    assert allocate([(geometric(0.9, 8), 0.0)], 16, 16, 64, DraftCosts((1, 16, 64), (1.0, 2.5, 10.0))) == [0]  # nothing does

    spec = Speculation()
    assert spec.offer(LOOP * 3, [], 8) == LOOP
    for _ in range(20):
        spec.record(4, 0)
    dear = DraftCosts((1, 2, 64), (1.0, 1.2, 13.6))  # a row costs a fifth of a step
    assert spec.rate_at(spec.match) < 0.2  # none pays
    assert allocate([(spec.weighed(spec.rates(8)), 0.0)], 1, 1, 64, dear) == [0]
    for _ in range(PROBE_AFTER):
        spec.skip()
    assert spec.rate_at(spec.match) > 0.25  # its evidence halved: the next repetitive text is drafted again
    assert allocate([(spec.weighed(spec.rates(8)), 0.0)], 1, 1, 64, dear)[0] > 0
    spec.record(3, 3)
    assert spec.proposed == 83 and spec.accepted == 3 and spec.steps == 21


@pytest.mark.unit
def test_a_drafts_rate_grows_with_the_match_it_extends():
    """An n-gram draft extending a match of l tokens is weighed at l / (l + beta): the longer the text has copied its
    source, the longer the drafts; beta is the request's own, by maximum likelihood from what it verified."""
    idx = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6])
    assert idx.propose(3) == [7, 8, 9] and idx.match == 6  # (1..6) agrees: 6 tokens before the end
    assert NgramIndex([9, 2, 3, 4, 5, 8, 2, 3, 4, 5]).propose(1) == [8] and NgramIndex([9, 2, 3, 4, 5, 8, 2, 3, 4, 5]).match == 0
    short = NgramIndex([9, 2, 3, 5, 8, 2, 3])
    assert short.propose(2) == [5, 8] and short.match == 2
    assert NgramIndex(list(range(200)) * 2).propose(1) == [0] and NgramIndex(list(range(200)) * 2).match == 0
    long = NgramIndex(list(range(100)) * 2 + [0, 1])
    assert long.propose(1) == [2] and long.match == MATCH_CAP  # counted to the cap
    spec = Speculation(idle=0)  # not probing
    assert spec.beta == PRIOR_BETA
    spec.index.match = 2
    short_rates = spec.rates(8)
    spec.index.match = 30
    long_rates = spec.rates(8)
    assert short_rates == sorted(short_rates) and short_rates[0] == pytest.approx(2 / (2 + PRIOR_BETA))
    assert long_rates[0] > short_rates[-1] and max(long_rates) <= MAX_RATE
    costs = DraftCosts((1, 2, 4, 8), (1.0, 1.25, 1.5, 2.4), decode=(0.9,))
    spec.index.match = 2
    short_k = allocate([(spec.rates(8), 0.0)], 1, 1, 64, costs, decode_only=True)[0]
    spec.index.match = 30
    assert allocate([(spec.rates(8), 0.0)], 1, 1, 64, costs, decode_only=True)[0] > short_k
    # beta follows the request: runs that end early raise it, runs that go on lower it
    fails, runs = Speculation(idle=0), Speculation(idle=0)
    fails.index.match = runs.index.match = 4
    for _ in range(10):
        fails.record(4, 0)
        runs.record(4, 4)
    assert fails.beta > PRIOR_BETA > runs.beta > 0
    assert fails.rate_at(8) < 8 / (8 + PRIOR_BETA) < runs.rate_at(8)


@pytest.mark.unit
def test_drafts_that_promise_less_than_the_margin_are_not_verified():
    """The step costs measured at start move between runs on a shared CPU by more than a few percent: a draft is
    verified only where it promises MARGIN more tokens a second than the step without it."""
    costs = DraftCosts((1, 2), (1.0, 1.1))  # one drafted row: a tenth more time
    thin = 1.1 * (1 + MARGIN / 2) - 1  # promises half the margin
    assert allocate([([thin], 0.0)], 1, 1, 64, costs) == [0]
    assert allocate([([1.1 * (1 + 2 * MARGIN) - 1], 0.0)], 1, 1, 64, costs) == [1]


def _scheduler(blocks: int, admission: str = ON_DEMAND, prefill: int = 1024) -> Scheduler:
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=BS)
    pool = BlockPool(layout, blocks * layout.bytes_per_block, allocate=False, prefix_cache=True)
    s = Scheduler(pool, 8, prefill, admission, 0)
    s.speculate(DraftCosts(), 8)
    return s


def _seq(rid: str, prompt: list[int], new: int) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(temperature=0.0, max_new_tokens=new, seed=0), sink=None)
    seq.spec = Speculation()
    return seq


def _prefill(s: Scheduler) -> None:
    plan = s.plan()
    for seq, start, n in plan.prefill:
        seq.prefilled = start + n
        s.pool.publish(seq.id, seq.prefilled)
        seq.generated.append(LOOP[len(seq.prompt) % len(LOOP)])


@pytest.mark.unit
def test_drafts_take_free_blocks_only_and_give_back_the_rejected_ones():
    s = _scheduler(6)
    a = _seq("a", LOOP * 4, 100)  # 32 tokens: 2 blocks; its first token continues the loop
    s.add(a)
    s.admit()
    _prefill(s)
    plan = s.plan()
    assert plan.decode == [] and [(q, d) for q, d in plan.verify] == [(a, LOOP[1:] + LOOP[:1])]
    assert len(a.blocks) == 3 and a.spec_peak_blocks == 0  # positions 32..40 fit the third block
    a.generated += LOOP[1:3]  # two drafts kept, then a third token drawn: what the engine appends
    s.rollback(a)
    assert len(a.blocks) == 3 and s.pool.used_blocks == 3  # position 34 is still in the third block
    s.pool.audit()
    b = _seq("b", list(range(100, 147)), 100)  # 47 tokens of its own: 3 blocks, the pool is full
    s.add(b)
    s.admit()
    plan = s.plan()
    assert [q for q, _ in plan.verify] == [a] and plan.prefill  # a's drafts fit the block it holds
    assert [len(d) for _, d in plan.verify] == [8] and s.pool.used_blocks == 6
    a.generated.append(LOOP[3])
    _prefill(s)
    # a's next token ends its third block: drafts would need a fourth and none is free, so it decodes plainly
    a.generated += [1] * 12
    plan = s.plan()
    assert a in plan.decode and not plan.verify and s.preemptions == 0 and len(a.blocks) == 3
    s.pool.audit()


@pytest.mark.unit
def test_drafts_stop_short_of_max_new_tokens_and_never_preempt():
    s = _scheduler(4)
    a = _seq("a", LOOP * 4, 3)
    s.add(a)
    s.admit()
    _prefill(s)
    plan = s.plan()
    assert [len(d) for _, d in plan.verify] == [1]  # 1 generated + 1 draft + its bonus = 3
    a.generated += [1, 2]
    s.rollback(a)
    s.pool.audit()
    full = _scheduler(3)  # 2 blocks of prompt + 1: drafts past the third block find nothing free
    c = _seq("c", LOOP * 4, 100)
    full.add(c)
    full.admit()
    _prefill(full)
    c.generated += [1] * 14  # position 46 next: room for one more token in the third block
    plan = full.plan()
    assert [len(d) for _, d in plan.verify] == [1] and full.preemptions == 0 and len(c.blocks) == 3


@pytest.mark.unit
def test_reserve_admission_keeps_its_reservation_through_rejections():
    s = _scheduler(10, admission=RESERVE)
    a = _seq("a", LOOP * 4, 60)
    s.add(a)
    s.admit()
    _prefill(s)
    assert len(a.blocks) == 6
    assert s.plan().verify
    s.rollback(a)
    assert len(a.blocks) == 6


@pytest.mark.unit
def test_shrink_gives_back_only_the_blocks_past_the_positions_and_refuses_shared_ones():
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=BS)
    pool = BlockPool(layout, 8 * layout.bytes_per_block, allocate=False, prefix_cache=True)
    prompt = list(range(40))
    pool.try_reserve("a", 40, prompt)
    pool.publish("a", 40)
    assert pool.grow("a", 70) and len(pool.blocks_of("a")) == 5
    assert pool.shrink("a", 49) == 1 and len(pool.blocks_of("a")) == 4 and pool.used_blocks == 4
    pool.audit()
    before = list(pool.blocks_of("a"))
    with pytest.raises(ValueError, match="shared or cached"):
        pool.shrink("a", 10)  # its first two blocks are keyed by the prefix cache
    assert pool.blocks_of("a") == before
    pool.audit()
    pool.release("a")
    pool.audit()
    assert pool.used_blocks == 0


@pytest.mark.unit
def test_a_request_probes_at_its_first_drafts_and_again_later_less_often_after_a_failed_probe():
    spec = Speculation()
    spec.index.match = 2
    assert spec.probing and spec.beta == PRIOR_BETA
    assert spec.weighed(spec.rates(3)) == [PROBE_RATE] * 3  # weighed as likely
    spec.record(3, 0)  # the probe failed
    assert not spec.probing and spec.rates(1) == [spec.rate_at(2)] and spec.beta > PRIOR_BETA
    for _ in range(PROBE_AFTER):
        assert not spec.probing
        spec.skip()
    assert not spec.probing and spec.probe_after == 2 * PROBE_AFTER  # a failed probe: the next twice as late
    for _ in range(PROBE_AFTER):
        spec.skip()
    assert spec.probing and spec.weighed(spec.rates(1)) == [PROBE_RATE]
    beta = spec.beta
    spec.record(3, 3)  # the text repeats now: probes come at the first wait again, and the rate says so
    assert spec.probe_after == PROBE_AFTER and not spec.probing and spec.beta < beta
    for _ in range(20):
        spec.idle = spec.probe_after
        spec.record(3, 0)
    assert spec.probe_after == MAX_PROBE_AFTER  # bounded


@pytest.mark.unit
def test_a_plain_decode_step_is_weighed_at_its_own_cost():
    """A step of decode rows alone costs :meth:`DraftCosts.plain` (a CPU replays it as a recorded program); any draft
    makes the step a forward, so the drafts must pay for that as well as for their rows."""
    costs = DraftCosts((1, 2, 4), (1.0, 1.05, 1.1), decode=(0.7, 0.75, 0.8))
    assert costs.plain(1) == 0.7 and costs.plain(3) == pytest.approx(0.775) and costs.forward(1) == 1.0
    assert DraftCosts((1, 2), (1.0, 1.05)).plain(2) == 1.05  # not measured: as a forward
    short = DraftCosts((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.5), decode=(0.7, 0.75))  # measured up to 2 rows
    assert short.plain(2) == 0.75 and short.plain(4) == pytest.approx(0.8) and short.plain(8) == pytest.approx(1.2)
    assert allocate([(geometric(0.3, 8), 0.0)], 1, 1, 64, costs) == [2]  # weighed against a forward's one row: pays
    assert allocate([(geometric(0.3, 8), 0.0)], 1, 1, 64, costs, decode_only=True) == [0]  # against a replayed step: does not
    assert allocate([(geometric(0.9, 8), 0.0)], 1, 1, 64, costs, decode_only=True) == [8]  # a likely run still pays


@pytest.mark.unit
def test_each_rows_attention_over_its_context_is_weighed_in_the_step_and_in_each_drafted_row():
    """A row's attention reads its context's K/V: 16 rows over 550-token contexts took the default model's step 1.6x
    the probe's rows at the first positions (float32, 2 AVX2 cores), and 16 grounded requests at once drafted at a
    loss. The step's rows' attention is in its time with drafts or without, and each drafted row adds its own."""
    costs = DraftCosts((1, 16, 32), (1.0, 2.0, 3.0), attend=1e-4)
    assert costs.attention(500) == pytest.approx(0.05) and DraftCosts().attention(500) == 0.0
    # 16 requests, one draft each at 0.7: 27.2 tokens for 32 rows against 16 for 16
    assert allocate([([0.7], 0.0)] * 16, 16, 16, 64, costs) == [1] * 16  # at the first positions: 1.13x, pays
    long = [([0.7], costs.attention(500))] * 16  # over 500 tokens each: 27.2 / 4.6 against 16 / 2.8, 1.03x
    assert allocate(long, 16, 16, 64, costs, base_extra=costs.attention(16 * 500)) == [0] * 16
    # through the scheduler: a request's context is its prompt and output; a drafted row of a lone request reads
    # the context its own row reads (in the cache), beside other requests' it is read again
    for attend, requests, verifies in ((0.0, 2, True), (1.0, 2, False), (1.0, 1, True)):
        s = _scheduler(64)
        s.speculate(DraftCosts((1, 64), (1.0, 1.0), attend=attend), 8)
        for i in range(requests):
            s.add(_seq(f"r{i}", LOOP * 4, 16))
        s.admit()
        _prefill(s)
        assert bool(s.plan().verify) == verifies, (attend, requests)


@pytest.mark.unit
def test_the_calibration_weighs_every_draft_by_the_share_of_the_expected_drafts_accepted():
    """Where allocate keeps the likeliest of many drafts, the estimates it picked by are the high ones: 16 grounded
    requests at once accepted 0.91 of the drafts expected (float32), one at a time 1.00."""
    assert expected([0.5, 0.5]) == pytest.approx(0.75) and expected([]) == 0.0
    half, over = Calibration(), Calibration()
    assert half.scale == 1.0
    for _ in range(400):
        half.record(2.0, 1)
        over.record(1.0, 2)
    assert half.scale == pytest.approx(0.5, abs=0.01) and over.scale == 1.0  # never above 1
    costs = DraftCosts((1, 2), (1.0, 1.5))
    assert allocate([([0.9], 0.0)], 1, 1, 64, costs) == [1]  # 1.9 tokens for 1.5: pays
    assert allocate([([0.9], 0.0)], 1, 1, 64, costs, scale=0.5) == [0]  # 1.45 for 1.5: does not
    # through the scheduler: a verification records what the request's estimates expected of it (a probe's too,
    # by its estimates, not the rate it was weighed at) and what was accepted
    s = _scheduler(64)
    a = _seq("a", LOOP * 4, 16)
    s.add(a)
    s.admit()
    _prefill(s)
    assert a.spec.probing  # its first drafts
    a.spec.beta = 50.0  # estimates below the probe's rate
    ((seq, drafts),) = s.plan().verify
    want = expected(seq.spec.rates(len(drafts)))
    assert seq.spec.expected == pytest.approx(want) and want < expected(seq.spec.weighed(seq.spec.rates(len(drafts))))
    s.verified(seq, drafts, [-5] * (len(drafts) + 1))  # every draft rejected
    assert s.calibration.expected == pytest.approx(CALIBRATION_DECAY * CALIBRATION_PRIOR + want)
    assert s.calibration.accepted == pytest.approx(CALIBRATION_DECAY * CALIBRATION_PRIOR)
    assert seq.spec.expected is None


@pytest.mark.unit
def test_a_steps_time_by_its_rows_between_and_beyond_the_measured_ones():
    costs = DraftCosts((1, 2, 4, 8), (0.030, 0.031, 0.036, 0.066))
    assert costs.forward(1) == 0.030 and costs.forward(0) == 0.030 and costs.forward(4) == 0.036
    assert costs.forward(3) == pytest.approx(0.0335) and costs.forward(6) == pytest.approx(0.051)
    assert costs.forward(16) == pytest.approx(0.066 + 8 * 0.030 / 4)  # beyond: the last two's slope
    noisy = DraftCosts((1, 2, 4), (0.03, 0.028, 0.05))
    assert noisy.forward(2) == 0.03 and noisy.forward(3) == pytest.approx(0.039)  # never below fewer rows
    assert DraftCosts().forward(50) == 1.0  # one row measured: every step costs it
    assert DraftCosts((1, 2, 4), (0.03, 0.04, 0.02)).forward(9) == 0.04


@pytest.mark.unit
def test_a_sampling_request_counts_its_drafted_rows_draws():
    costs = DraftCosts(draw=0.1, filtered=0.3)
    assert costs.draw_of(SamplingParams(temperature=0.0, top_p=0.5)) == 0.0
    assert costs.draw_of(SamplingParams(temperature=0.8)) == 0.1
    assert costs.draw_of(SamplingParams(temperature=0.8, min_p=0.1)) == 0.3
    assert costs.draw_of(SamplingParams(temperature=0.8, top_k=3)) == 0.3


@pytest.mark.unit
def test_speculation_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match="--speculate must be one of auto, off, ngram"):
        EngineConfig(speculate="eagle").validate()
    with pytest.raises(ValueError, match="--speculate-tokens must be an integer >= 1"):
        EngineConfig(speculate_tokens=0).validate()
    with pytest.raises(ValueError, match="--speculate: not with --kv-dtype int4"):
        EngineConfig(speculate="ngram", kv_dtype="int4").validate()
    # auto, the default: n-grams on the CPU; off with an int4 cache and off the CPU (not yet verified on a GPU)
    assert EngineConfig().speculate == "auto" and EngineConfig().speculates
    assert not EngineConfig(kv_dtype="int4").validate().speculates
    assert not EngineConfig(device="cuda").speculates and not EngineConfig(speculate="off").speculates


# ------------------------------------------------------------------------------------- the engine, exactness


def _engine(model_dir, cache_dir, speculate: str, **kw) -> Engine:
    """With speculation on, its draft costs set to nothing (whatever this machine measured), so that every request
    drafts all it can: exactness is tested on as many drafts as the text allows."""
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=64, speculate=speculate)
    cfg.update(kw)
    eng = Engine.from_path(str(model_dir), EngineConfig(**cfg), cache_dir)
    if speculate != "off":
        eng.scheduler.speculate(DraftCosts(), eng.config.speculate_tokens)
    return eng


@pytest.fixture(scope="module")
def pair(tiny_model_dir, cache_dir):
    """The tiny model with speculation off and on, serial steps (the CPU's)."""
    off, on = _engine(tiny_model_dir, cache_dir, "off"), _engine(tiny_model_dir, cache_dir, "ngram")
    yield off, on
    off.close()
    on.close()


def assert_books(engine: Engine) -> None:
    engine.pool.audit()
    assert engine.pool.used_blocks == 0 and not engine.scheduler.has_work


EVERY_CONTROL = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                     presence_penalty=0.3, frequency_penalty=0.2, logit_bias=((LOOP[3], 3.0), (7, -2.0)),
                     min_tokens=4, logprobs=2)


def _prompts(engine: Engine) -> list[list[int]]:
    text = "one two three four five six seven eight " * 3
    return [LOOP * 6, engine.tokenize(text), list(range(30, 50)) * 2]


@pytest.mark.reference
@pytest.mark.parametrize("params", [greedy_exact(40, logprobs=2), greedy(40, stop=["three f"]),
                                    SamplingParams(max_new_tokens=40, seed=7, **EVERY_CONTROL),
                                    SamplingParams(max_new_tokens=40, seed=8, temperature=0.6, top_p=0.8,
                                                   logit_bias=tuple((t, 12.0) for t in LOOP))],
                         ids=["greedy", "greedy-stop", "every-control", "top-p"])
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(pair, params):
    off, on = pair
    drafted = 0
    for prompt in _prompts(on):
        want, got = off.complete(prompt, params), on.complete(prompt, params)
        assert_same(got, want)
        a = got.accounting
        assert a.accepted_tokens <= a.speculated_tokens and want.accounting.speculated_tokens == 0
        assert a.kv_blocks_reserved >= want.accounting.kv_blocks_reserved
        drafted += a.speculated_tokens
    assert drafted > 0  # the repetitive prompts were drafted for
    assert on.totals().speculated_tokens >= drafted
    assert_books(on)


@pytest.mark.reference
def test_drafts_are_accepted_and_their_blocks_counted(pair):
    off, on = pair
    got = on.complete(LOOP * 6, greedy_exact(60))
    a = got.accounting
    assert a.accepted_tokens > 0 and got.token_ids == off.complete(LOOP * 6, greedy_exact(60)).token_ids
    t = on.totals()
    assert 0 < t.acceptance_rate <= 1
    assert a.kv_bytes_speculative % on.layout.bytes_per_block == 0
    assert a.kv_blocks_reserved * on.layout.bytes_per_block >= a.kv_bytes_speculative
    assert_books(on)


@pytest.mark.reference
def test_the_trace_marks_each_drafted_position(pair):
    """Each emitted token a verification drafted for carries its draft: kept drafts are the accepted tokens, and a
    step shows at most one rejected draft (the draw that replaced it); plain decoding marks none."""
    off, on = pair
    params = replace(greedy_exact(40), trace=2)
    got, want = on.complete(LOOP * 6, params), off.complete(LOOP * 6, params)
    assert got.token_ids == want.token_ids and all(t.draft is None for t in want.trace)
    drafts = [(t.draft, tok) for t, tok in zip(got.trace, got.token_ids, strict=True) if t.draft is not None]
    assert sum(d == tok for d, tok in drafts) == got.accounting.accepted_tokens > 0
    rejected = sum(d != tok for d, tok in drafts)
    assert rejected <= got.accounting.speculated_tokens - got.accounting.accepted_tokens
    assert [[i for i, _ in t.top_p] for t in got.trace] == [[i for i, _ in t.top_p] for t in want.trace]
    assert_books(on)


@pytest.mark.reference
def test_a_request_that_opts_out_never_drafts(pair):
    off, on = pair
    params = replace(greedy_exact(40), speculate=False)
    before = on.totals().speculated_tokens
    got = on.complete(LOOP * 6, params)
    assert got.accounting.speculated_tokens == 0 and got.accounting.kv_bytes_speculative == 0
    assert on.totals().speculated_tokens == before
    assert got.token_ids == off.complete(LOOP * 6, params).token_ids
    assert on.complete(LOOP * 6, greedy_exact(40)).accounting.speculated_tokens > 0  # the same request drafts
    assert_books(on)


@pytest.mark.reference
def test_each_positions_distribution_is_the_plain_one_by_a_chi_square_test(pair):
    """Disjoint seeds (off: 0..N-1, on: N..2N-1), every control on, the loop's tokens favoured so that its drafts
    (the loop's continuation) are right about one time in eight: the two samples of each of the first positions
    come from one distribution (a two-sample chi-square test over the tokens seen at least 10 times together, at
    the 0.001 level), and so do consecutive pairs, as whether the second token continues the loop from the first
    (which a verifier that kept drafts it did not draw would make far more often)."""
    from scipy.stats import chi2_contingency

    off, on = pair
    n, positions = 150, 6
    base = dict(EVERY_CONTROL, logprobs=None, min_tokens=0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                logit_bias=tuple((t, 12.0) for t in LOOP))
    successor = {t: LOOP[(i + 1) % len(LOOP)] for i, t in enumerate(LOOP)}
    seen = {m: [Counter() for _ in range(positions)] for m in ("off", "on")}
    follows = {m: Counter() for m in ("off", "on")}
    for mode, eng, first in (("off", off, 0), ("on", on, n)):
        for seed in range(first, first + n):
            toks = eng.complete(LOOP * 6, SamplingParams(max_new_tokens=positions, seed=seed, ignore_eos=True,
                                                         **base)).token_ids
            for j, t in enumerate(toks):
                seen[mode][j][t] += 1
            follows[mode].update(successor.get(a) == b for a, b in zip(toks, toks[1:]))
    assert on.totals().accepted_tokens > 0
    for j in range(positions):
        a, b = seen["off"][j], seen["on"][j]
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rest = [sum(c[t] for t in c if t not in common) for c in (a, b)]
        table = [[a[t] for t in common] + ([rest[0]] if sum(rest) else []),
                 [b[t] for t in common] + ([rest[1]] if sum(rest) else [])]
        if len(table[0]) > 1:
            assert chi2_contingency(table)[1] > 1e-3, (j, table)
    pairs = [[follows[m][True], follows[m][False]] for m in ("off", "on")]
    assert chi2_contingency(pairs)[1] > 1e-3, pairs


@pytest.mark.reference
def test_n_samples_the_prefix_cache_and_streams_with_speculation(pair):
    off, on = pair
    params = SamplingParams(max_new_tokens=24, seed=3, temperature=0.8, top_k=20)
    prompt = LOOP * 6
    want = [off.complete(prompt, params.with_seed(3 + i)) for i in range(3)]
    for _ in range(2):  # the second time its prompt's blocks come from the prefix cache
        got = on.samples(prompt, params, 3)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
    assert got[0].accounting.prompt_tokens_cached > 0
    _, events = on.stream(prompt, greedy_exact(30))
    evs = list(events)
    streamed = [t for e in evs for t in e.token_ids]
    whole = off.complete(prompt, greedy_exact(30))
    assert streamed == list(whole.token_ids) and "".join(e.text for e in evs) == whole.text
    assert_books(on)


@pytest.mark.reference
def test_preempted_speculating_requests_give_what_they_give_alone(tiny_model_dir, cache_dir):
    """A pool of 10 blocks of 16 for five requests of up to 96 tokens: requests are preempted and taken back while
    others draft; each output equals a roomy engine's without speculation."""
    roomy = _engine(tiny_model_dir, cache_dir, "off")
    tight = _engine(tiny_model_dir, cache_dir, "ngram", memory_budget=str(10 * roomy.layout.bytes_per_block))
    try:
        prompts = [LOOP * 4 + [i + 20] for i in range(5)]
        params = [greedy_exact(60), SamplingParams(max_new_tokens=60, seed=4, **EVERY_CONTROL)]
        want = [[roomy.complete(p, q) for q in params] for p in prompts]
        handles = []
        results: dict = {}
        for i, p in enumerate(prompts):
            for j, q in enumerate(params):
                handles.append(((i, j), tight.stream(p, q)))
        for key, (_, events) in handles:
            results[key] = list(events)
        for (i, j), evs in results.items():
            final = evs[-1]
            assert [t for e in evs for t in e.token_ids] == list(want[i][j].token_ids), (i, j)
            assert final.finish_reason == want[i][j].finish_reason
        assert tight.scheduler.preemptions > 0 and tight.totals().speculated_tokens > 0
        assert_books(tight)
    finally:
        roomy.close()
        tight.close()


@pytest.mark.reference
def test_a_seed_reproduces_a_speculative_run_in_bf16(tiny_model_dir, cache_dir):
    """What a seed reproduces with speculation on, where rounding may part it from plain decoding (bf16: a
    verification's rows round apart from one-row steps): the same request and settings give the same tokens and
    the same drafts each time."""
    eng = _engine(tiny_model_dir, cache_dir, "ngram", dtype="bfloat16")
    try:
        for params in (greedy(48), SamplingParams(max_new_tokens=48, seed=11, **EVERY_CONTROL)):
            for prompt in _prompts(eng)[:2]:
                runs = [eng.complete(prompt, replace(params, trace=1)) for _ in range(2)]
                assert runs[0].token_ids == runs[1].token_ids and runs[0].text == runs[1].text
                assert [t.draft for t in runs[0].trace] == [t.draft for t in runs[1].trace]
        assert eng.totals().speculated_tokens > 0
        assert_books(eng)
    finally:
        eng.close()


@pytest.mark.reference
def test_json_mode_keeps_its_grammar_through_drafts(pair):
    pytest.importorskip("xgrammar")
    off, on = pair
    fmt = json.dumps({"type": "json_object"})
    prompt = on.tokenize('{"a": 1, "b": 2, "a": 1, "b": 2, "a": 1, "b": 2')
    every = {k: v for k, v in EVERY_CONTROL.items() if k != "min_tokens"}  # (refused with a response_format)
    before = on.totals().speculated_tokens
    for params in (greedy(48, response_format=fmt), SamplingParams(max_new_tokens=48, seed=2, temperature=0.7,
                                                                  response_format=fmt),
                   SamplingParams(max_new_tokens=48, seed=5, response_format=fmt, **every)):
        want, got = off.complete(prompt, params), on.complete(prompt, params)
        assert_same(got, want)
        if got.finish_reason == "stop":
            json.loads(got.text)
    assert on.totals().speculated_tokens > before
    assert_books(on)


@pytest.mark.reference
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_family_gives_its_greedy_tokens_with_speculation(arch, arch_dirs, cache_dir):
    d = arch_dirs(arch)
    off, on = _engine(d, cache_dir, "off"), _engine(d, cache_dir, "ngram")
    try:
        # greedy among the loop's tokens (the model's own order of them): its output repeats, and is drafted for
        params = greedy_exact(32, logprobs=1, logit_bias=tuple((t, 30.0) for t in LOOP))
        assert_same(on.complete(LOOP * 6, params), off.complete(LOOP * 6, params))
        assert on.totals().speculated_tokens > 0
        assert_books(on)
    finally:
        off.close()
        on.close()
