"""Sampling: parameter validation, the documented order against transformers' warpers and the plain
reference, the counter-based random stream, distribution (chi-square), reproducibility and batch invariance,
logprobs and trace outputs. CPU only, a few seconds."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from server.random_stream import random_u32, random_uniform
from server.sampling import (
    LOGPROB_FLOOR,
    TRACE_STAGES,
    TRACE_STATS,
    SampleOutput,
    SamplingBatch,
    apply_penalty,
    filtered_probs,
    processed_logits,
    sample,
    unpack_bitmask,
)
from server.sampling_params import (
    FLOAT32_MAX,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_MIN,
    SamplingParams,
    SamplingParamsError,
)
from server.sampling_reference import (
    ref_logit_bias,
    ref_min_p,
    ref_penalty,
    ref_presence_frequency,
    ref_temperature,
    ref_top_k,
    ref_top_p,
    ref_unpack,
    reference_filter,
)

# ------------------------------------------------------------------------------------------------ validation

INVALID = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("temperature", "1.0"),
    ("temperature", None),
    ("temperature", 10**400),
    ("top_k", -1),
    ("top_k", 1.0),
    ("top_k", True),
    ("top_k", "5"),
    ("top_k", None),
    ("top_p", 1.5),
    ("top_p", -0.01),
    ("top_p", float("nan")),
    ("top_p", float("inf")),
    ("top_p", False),
    ("top_p", "0.9"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")),
    ("repetition_penalty", float("inf")),
    ("repetition_penalty", True),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "7"),
    ("max_new_tokens", 0),
    ("max_new_tokens", -5),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("max_new_tokens", None),
    ("min_tokens", -1),
    ("min_tokens", 0.0),
    ("min_tokens", False),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("speculate", 0),
    ("speculate", "false"),
    ("speculate", None),
    ("stop", ("",)),
    ("stop", ["a"] * 17),
    ("stop", ("x" * 257,)),
    ("stop", "\n"),
    ("stop", (1,)),
    ("stop", None),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("trace", 0),
    ("trace", 51),
    ("trace", 2.0),
    ("trace", False),
    ("temperature", 7.9e68),  # finite in Python, inf in the fp32 logits (the HTTP fuzz found it: NaN trace probs)
    ("temperature", 1e-40),  # a logit of 1 / T overflows fp32: inf, then NaN probabilities
    ("temperature", 5e-324),  # the smallest subnormal double
    ("temperature", 9.9e-7),
    ("repetition_penalty", 1e39),
    ("repetition_penalty", 2.1e-53),  # 0 in fp32: a seen token's logit / p was inf (the HTTP fuzz found it: a 500)
    ("repetition_penalty", 5e-324),
    ("repetition_penalty", 0.0099),
    ("repetition_penalty", 100.01),
    ("repetition_penalty", -0.0),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("min_p", float("nan")),
    ("min_p", True),
    ("min_p", None),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("presence_penalty", float("inf")),
    ("frequency_penalty", 3),
    ("frequency_penalty", "1"),
    ("logit_bias", "x"),
    ("logit_bias", 5),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"-1": 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: "1"}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", {5: None}),
    ("logit_bias", {5: 1.0, "5": 2.0}),  # the same token twice
    ("logit_bias", {i: 0.0 for i in range(301)}),
    ("logit_bias", [(1, 2, 3)]),
    ("response_format", {"type": "xml"}),
    ("response_format", "not json"),
    ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": "x"}}),
    ("response_format", {"type": "json_object", "strict": True}),
    ("response_format", 5),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"a": "x" * 70000}}}),
]


@pytest.mark.unit
@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_value_names_parameter(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.unit
def test_messages_give_the_allowed_range():
    with pytest.raises(SamplingParamsError, match=r"top_p must be in \[0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match="min_tokens must be <= max_new_tokens") as err:
        SamplingParams(max_new_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens"
    # one line naming the field and the range, as the HTTP 400 and gRPC INVALID_ARGUMENT carry it
    with pytest.raises(SamplingParamsError, match=r"^repetition_penalty must be in \[0.01, 100\] \(1 = off\), "
                                                  r"got 2.1e-53$"):
        SamplingParams(repetition_penalty=2.1e-53)
    with pytest.raises(SamplingParamsError, match=r"^temperature must be 0 \(greedy\) or in \[1e-06, 3.403e\+38\]"):
        SamplingParams(temperature=1e-40)


@pytest.mark.unit
def test_valid_edges_stored_unchanged():
    p = SamplingParams(temperature=0.0, top_p=0.0, top_k=1, seed=2**63 - 1, logprobs=20, trace=50)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs, p.trace) == (0.0, 0.0, 1, 2**63 - 1, 20, 50)
    p = SamplingParams(top_p=1.0, repetition_penalty=0.01, max_new_tokens=1, min_tokens=1, logprobs=0, trace=1)
    assert (p.top_p, p.repetition_penalty, p.min_tokens, p.logprobs, p.trace) == (1.0, 0.01, 1, 0, 1)
    assert SamplingParams(repetition_penalty=100).repetition_penalty == 100.0
    assert SamplingParams(temperature=1e-6).temperature == 1e-6 and SamplingParams(temperature=-0.0).temperature == 0
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX
    p = SamplingParams(temperature=2, top_k=np.int64(5), top_p=np.float64(0.25), stop=["a", "x" * 256] + ["b"] * 14)
    assert p.temperature == 2.0 and type(p.temperature) is float and type(p.top_k) is int and p.top_p == 0.25
    assert isinstance(p.stop, tuple) and len(p.stop) == 16
    assert p.with_seed(7).seed == 7 and p.with_seed(7).stop == p.stop and p.seed is None
    with pytest.raises(SamplingParamsError):
        p.with_seed(-1)
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))  # frozen and hashable
    p = SamplingParams(min_p=1.0, presence_penalty=-2, frequency_penalty=2.0, logit_bias={"7": 100, 5: -100.0})
    assert (p.min_p, p.presence_penalty, p.frequency_penalty) == (1.0, -2.0, 2.0)
    assert p.logit_bias == ((5, -100.0), (7, 100.0)) and hash(p) == hash(replace(p))  # JSON's string keys taken
    assert SamplingParams(logit_bias={i: 0 for i in range(300)}).logit_bias[-1] == (299, 0.0)
    assert SamplingParams(logit_bias=None).logit_bias == () == SamplingParams(logit_bias={}).logit_bias
    assert not SamplingParams().uses_history and SamplingParams(frequency_penalty=0.1).uses_history


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
)
_FIELDS = {
    "temperature": st.one_of(_ANY, st.floats(0, 5)),
    "top_k": st.one_of(_ANY, st.integers(0, 100)),
    "top_p": st.one_of(_ANY, st.floats(0, 1)),
    "repetition_penalty": st.one_of(_ANY, st.floats(0, 3)),
    "seed": _ANY,
    "max_new_tokens": st.one_of(_ANY, st.integers(1, 100)),
    "min_tokens": st.one_of(_ANY, st.integers(0, 100)),
    "ignore_eos": _ANY,
    "stop": st.one_of(_ANY, st.lists(st.text(max_size=300), max_size=18)),
    "logprobs": st.one_of(_ANY, st.integers(-2, 25)),
    "trace": st.one_of(_ANY, st.integers(-2, 55)),
    "min_p": st.one_of(_ANY, st.floats(-0.5, 1.5)),
    "presence_penalty": st.one_of(_ANY, st.floats(-3, 3)),
    "frequency_penalty": st.one_of(_ANY, st.floats(-3, 3)),
    "logit_bias": st.one_of(_ANY, st.dictionaries(st.one_of(st.integers(-3, 10**6), st.text(max_size=4)),
                                                  st.one_of(st.floats(-150, 150), _ANY), max_size=5)),
}


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional=_FIELDS))
def test_random_values_validate_or_raise_params_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except SamplingParamsError as e:
        assert e.param in _FIELDS and e.param in str(e)
        return
    # Accepted values satisfy every documented constraint.
    assert p.temperature == 0 or 1e-6 <= p.temperature <= FLOAT32_MAX
    assert 0 <= p.top_p <= 1 and p.top_k >= 0 and 0.01 <= p.repetition_penalty <= 100
    assert p.seed is None or 0 <= p.seed < 2**63
    assert 0 <= p.min_tokens <= p.max_new_tokens and isinstance(p.ignore_eos, bool)
    assert isinstance(p.stop, tuple) and len(p.stop) <= 16 and all(0 < len(s) <= 256 for s in p.stop)
    assert p.logprobs is None or 0 <= p.logprobs <= 20
    assert p.trace is None or 1 <= p.trace <= 50
    assert 0 <= p.min_p <= 1 and -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2
    assert all(t >= 0 and -100 <= b <= 100 for t, b in p.logit_bias) and len(p.logit_bias) <= 300


@pytest.mark.unit
def test_build_checks_and_flags():
    ps = [SamplingParams(temperature=0.0), SamplingParams(top_k=3, logprobs=2), SamplingParams(trace=5)]
    b = SamplingBatch.build(ps, [1, 2, 3], [0, 4, 9], None)
    assert b.history is None and b.logprobs_n == 2 and b.trace_n == 5 and b.any_filter and not b.all_greedy
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64 and b.seeds.tolist() == [1, 2, 3]
    assert SamplingBatch.build(ps[:1], [1], [0], None).all_greedy
    counted = SamplingBatch.build([SamplingParams(presence_penalty=0.5)], [1], [0], [[3, 4]], prompt_lens=[1])
    assert counted.history is not None and not counted.any_repetition  # step 2 skipped: its penalty is 1
    assert SamplingBatch.build([SamplingParams(repetition_penalty=1.2)], [1], [0], [[3]]).any_repetition
    with pytest.raises(ValueError, match="histories"):
        SamplingBatch.build([SamplingParams(repetition_penalty=1.2)], [1], [0], None)
    with pytest.raises(ValueError):
        SamplingBatch.build(ps, [1, 2], [0, 0, 0], None)
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.build(ps[:1], [2**63], [0], None)
    pen = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    b = SamplingBatch.build(pen, [1, 2], [0, 0], [[5, 6, 7], [1]])
    assert b.history.tolist() == [[5, 6, 7], [1, -1, -1]]


# ------------------------------------------------------------------------------------- the documented order


def _batch(params, histories=None, seeds=None, steps=None):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), steps or [0] * n, histories)


def _top_p_margin(row: torch.Tensor, p: SamplingParams) -> float:
    """Distance between p and the nearest prefix mass of the top-k stage: float rounding may only flip a
    top-p decision when this is ~1e-7, so the test data must keep it large (no ties at the boundary)."""
    if p.temperature == 0 or p.top_p in (0.0, 1.0):
        return math.inf
    x = ref_top_k(ref_temperature(row, p.temperature), p.top_k)
    cum = torch.softmax(x, -1).sort(descending=True).values.double().cumsum(0)
    return float((cum - p.top_p).abs().min())


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.5, top_k=10, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.0),
    SamplingParams(top_p=0.0),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95),
    SamplingParams(top_k=1),
    SamplingParams(),
    SamplingParams(temperature=1.1, top_k=200, top_p=0.3),  # k > V
    SamplingParams(temperature=0.25, top_p=0.99),
]


@pytest.mark.reference
def test_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    V = 64
    logits = torch.randn(len(MIXED), V, generator=g) * 3  # (B, V) continuous: no exact ties
    for row, p in zip(logits, MIXED):
        assert _top_p_margin(row, p) > 1e-4
    ours = filtered_probs(logits, _batch(MIXED))  # (B, V): every row with its own params, one batch
    ids = torch.zeros(1, 1, dtype=torch.long)
    for b, p in enumerate(MIXED):
        scores = TemperatureLogitsWarper(float(p.temperature))(ids, logits[b : b + 1].clone())
        if p.top_k > 0:
            scores = TopKLogitsWarper(p.top_k)(ids, scores)
        if p.top_p < 1:
            scores = TopPLogitsWarper(p.top_p)(ids, scores)  # min_tokens_to_keep=1: p = 0 keeps the top token
        hf = torch.softmax(scores, -1)[0]
        torch.testing.assert_close(ours[b], hf, atol=1e-6, rtol=0, msg=f"row {b} {p}")
        assert torch.equal(ours[b] > 0, hf > 0), f"row {b}: different survivors"


@pytest.mark.reference
def test_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    V = 50
    logits = torch.randn(4, V, generator=g) * 2  # (B, V) both signs
    logits[0, 3] = 0.0
    penalties = [1.3, 0.7, 1.0, 2.5]
    histories = [[3, 4, 4, 10, 49, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2], [7, 7, 7, V + 3]]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    batch = _batch(params, histories)
    ours = apply_penalty(logits, batch.repetition_penalty, batch.history)  # (B, V)
    for b in range(4):
        # ids past the vocabulary (row 3) count for nothing in ours and in ref_penalty; transformers 5.24 ignores
        # them too, 5.17 (the GPU images') raises: it is given the history without them
        seen = torch.tensor([[t for t in histories[b] if t < V]])
        hf = RepetitionPenaltyLogitsProcessor(penalties[b])(seen, logits[b : b + 1].clone())
        assert torch.equal(ours[b], hf[0]), b
        assert torch.equal(ours[b], ref_penalty(logits[b], histories[b], penalties[b])), b
        untouched = [v for v in range(V) if v not in histories[b]]
        assert torch.equal(ours[b, untouched], logits[b, untouched])
    assert torch.equal(ours[2], logits[2])  # penalty 1 leaves the row alone


@pytest.mark.reference
def test_fast_path_equals_reference():
    g = torch.Generator().manual_seed(2)
    V = 40
    params = MIXED + [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=7, top_p=0.8, repetition_penalty=1.4),
        SamplingParams(temperature=1.7, repetition_penalty=0.8),
    ]
    logits = torch.randn(len(params), V, generator=g) * 2.5  # (B, V)
    logits[-3, :] = logits[-3, :].abs()  # make the penalty decide the greedy token
    histories = [
        [int(t) for t in torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)]
        for _ in params
    ]
    histories[-3] = [int(logits[-3].argmax())]
    for row, p, h in zip(logits, params, histories):
        assert _top_p_margin(ref_penalty(row, h, p.repetition_penalty), p) > 1e-4
    batch = _batch(params, histories)
    fast = filtered_probs(logits, batch)  # (B, V)
    for b, p in enumerate(params):
        ref = reference_filter(logits[b], p, histories[b])
        torch.testing.assert_close(fast[b], ref, atol=1e-6, rtol=0, msg=f"row {b} {p}")
        assert torch.equal(fast[b] > 0, ref > 0)
    assert int(fast[-3].argmax()) != int(logits[-3].argmax())  # greedy after the penalty
    # Greedy and p = 0 / k = 1 rows are one-hot on the argmax.
    for b in (5, 7, len(MIXED), len(MIXED) + 1):
        assert float(fast[b].max()) == 1.0 and int((fast[b] > 0).sum()) == 1


# ------------------------------------------------------------- the controls users bring from other servers

NEW_CONTROLS = [
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=1.2, top_k=12, top_p=0.9, min_p=0.2),
    SamplingParams(temperature=0.6, min_p=1.0),  # only tokens as probable as the most probable one
    SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.9, presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=1.3),
    SamplingParams(temperature=1.1, logit_bias={3: 5.0, 7: -100.0, 39: 2.5}),
    SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
    SamplingParams(temperature=0.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, presence_penalty=0.4, logit_bias={0: -3.0}),
    SamplingParams(),  # none of them, in the same batch
    SamplingParams(temperature=0.5, top_k=4),
]


@pytest.mark.reference
def test_min_p_matches_transformers_placed_after_temperature():
    """vLLM's place for min-p (right after temperature), which the design document gives; transformers runs its
    MinPLogitsWarper after top-p instead, which differs only where top-p cuts inside min-p's set."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(11)
    rows = [p for p in NEW_CONTROLS if p.min_p > 0 and not (p.uses_history or p.logit_bias)]
    logits = torch.randn(len(rows), 64, generator=g) * 3  # (B, V)
    ours = filtered_probs(logits, _batch(rows))  # (B, V)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for b, p in enumerate(rows):
        chain = [TemperatureLogitsWarper(p.temperature), MinPLogitsWarper(p.min_p)] + (
            [TopKLogitsWarper(p.top_k)] if p.top_k else []) + ([TopPLogitsWarper(p.top_p)] if p.top_p < 1 else [])
        scores = logits[b : b + 1].clone()
        for w in chain:
            scores = w(ids, scores)
        hf = torch.softmax(scores, -1)[0]
        torch.testing.assert_close(ours[b], hf, atol=1e-6, rtol=0, msg=f"row {b} {p}")
        assert torch.equal(ours[b] > 0, hf > 0)
    assert int((ours[2] > 0).sum()) == 1  # min_p = 1: the most probable token alone (no ties here)


@pytest.mark.unit
def test_min_p_runs_before_top_p():
    # probabilities 0.5, 0.3, 0.2; min_p 0.5 drops 0.2 (< 0.25), leaving 0.625, 0.375: top-p 0.6 then keeps one
    # token. Min-p after top-p (transformers' place) would keep two: top-p on 0.5, 0.3, 0.2 keeps 0.5 and 0.3.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()  # (1, 3)
    p = SamplingParams(min_p=0.5, top_p=0.6)
    assert int((filtered_probs(logits, _batch([p]))[0] > 0).sum()) == 1
    assert int((reference_filter(logits[0], p) > 0).sum()) == 1
    assert int((filtered_probs(logits, _batch([replace(p, min_p=0.0)]))[0] > 0).sum()) == 2


@pytest.mark.unit
def test_the_order_bias_then_repetition_then_presence_frequency():
    # One token, logit 1.0, generated twice: bias +3 -> 4.0; repetition 2 -> 2.0; frequency 0.25 x 2 and
    # presence 0.5 -> 1.0. Any other order gives another number (penalty first: 3.5; presence first: 1.25).
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, logit_bias={3: 3.0})
    batch = SamplingBatch.build([p], [1], [2], [[5, 3, 3]], prompt_lens=[1])
    x = processed_logits(logits, batch)
    assert x[0, 3].item() == 1.0
    assert x[0, 5].item() == 0.0  # 5 is the prompt's: repetition (0 stays 0), never presence or frequency
    assert torch.equal(x[0, [0, 1, 2, 4, 6, 7]], torch.zeros(6))
    assert logits[0, 3].item() == 1.0, "the raw logits are not modified in place"


@pytest.mark.reference
def test_presence_frequency_and_bias_are_openais_definitions():
    g = torch.Generator().manual_seed(12)
    V = 30
    logits = torch.randn(4, V, generator=g) * 2  # (B, V)
    prompts = [[1, 2, 2], [], [4], [0] * 5]
    generated = [[2, 2, 2, 7, V + 4], [9], [4, 4], []]  # V + 4: an id past the head counts for nothing
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(presence_penalty=-2.0, logit_bias={9: 1.5, 29: -7.0}),
              SamplingParams(frequency_penalty=2.0, logit_bias={4: 100.0}),
              SamplingParams(frequency_penalty=1.0)]
    batch = SamplingBatch.build(params, [0] * 4, [len(x) for x in generated],
                                [a + b for a, b in zip(prompts, generated)], prompt_lens=[len(a) for a in prompts])
    x = processed_logits(logits, batch)  # (B, V)
    for b, p in enumerate(params):
        want = logits[b].clone()
        for t, bias in p.logit_bias:
            want[t] += bias
        for t in set(generated[b]):
            if t < V:
                c = generated[b].count(t)
                want[t] -= c * p.frequency_penalty + p.presence_penalty  # OpenAI's mu[j] - c[j] a_f - 1[c[j]>0] a_p
        torch.testing.assert_close(x[b], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(x[b], reference_filter_logits(logits[b], p, prompts[b] + generated[b],
                                                                 len(prompts[b])), atol=1e-6, rtol=0)
    assert torch.equal(x[3], logits[3]), "the prompt's tokens are not penalised"
    with pytest.raises(ValueError, match="prompt_lens"):
        SamplingBatch.build(params[:1], [0], [0], [[1]])


def reference_filter_logits(row, p, history, prompt_len):
    """Steps 1-3 of the plain reference, for one row."""
    x = ref_logit_bias(row.float(), p.logit_bias)
    x = ref_penalty(x, history, p.repetition_penalty) if p.repetition_penalty != 1 else x
    return ref_presence_frequency(x, history[prompt_len:], p.presence_penalty, p.frequency_penalty)


@pytest.mark.reference
def test_new_controls_mixed_with_plain_requests_equal_the_reference():
    g = torch.Generator().manual_seed(13)
    V = 40
    logits = torch.randn(len(NEW_CONTROLS), V, generator=g) * 2.5  # (B, V)
    prompts = [[int(t) for t in torch.randint(0, V, (5,), generator=g)] for _ in NEW_CONTROLS]
    gens = [[int(t) for t in torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)]
            for _ in NEW_CONTROLS]
    gens[7] = [int(logits[7].argmax())] * 3  # the frequency penalty must move the greedy token
    histories = [a + b for a, b in zip(prompts, gens)]
    for b, p in enumerate(NEW_CONTROLS):
        assert _top_p_margin(reference_filter_logits(logits[b], p, histories[b], 5), p) > 1e-4, b
    batch = SamplingBatch.build(NEW_CONTROLS, list(range(len(NEW_CONTROLS))), [len(x) for x in gens], histories,
                                prompt_lens=[5] * len(NEW_CONTROLS))
    fast = filtered_probs(logits, batch)  # (B, V)
    for b, p in enumerate(NEW_CONTROLS):
        ref = reference_filter(logits[b], p, histories[b], prompt_len=5)
        torch.testing.assert_close(fast[b], ref, atol=1e-6, rtol=0, msg=f"row {b} {p}")
        assert torch.equal(fast[b] > 0, ref > 0), b
    assert fast[5, 7].item() < 1e-40, "a -100 bias all but removes the token (it is added, as OpenAI does)"
    assert fast[6, 11].item() == 1.0 and fast[7].argmax() != logits[7].argmax()
    # The rows that use none of the controls get what they get in a batch without any of them.
    plain = [9, 10]
    alone = filtered_probs(logits[plain], _batch([NEW_CONTROLS[i] for i in plain]))
    assert torch.equal(fast[plain], alone)
    assert batch.min_p is not None and batch.frequency is not None and batch.bias_ids is not None
    idle = _batch(MIXED)  # nothing new used: no tensors staged for the new steps
    assert idle.min_p is None and idle.frequency is None and idle.bias_ids is None and idle.history is None


@pytest.mark.unit
def test_a_banned_token_is_never_drawn_and_a_forced_one_always():
    n, V = 2000, 16
    logits = torch.zeros(n, V)
    logits[:, 4] = 6.0  # by far the most probable
    ban = SamplingParams(logit_bias={4: -100})
    toks = sample(logits, SamplingBatch.build([ban] * n, [9] * n, list(range(n)), None)).tokens
    assert not bool((toks == 4).any()) and len(set(toks.tolist())) == V - 1
    force = SamplingParams(logit_bias={12: 100})
    toks = sample(logits, SamplingBatch.build([force] * n, [9] * n, list(range(n)), None)).tokens
    assert bool((toks == 12).all())


@pytest.mark.reference
def test_the_grammar_mask_unpacks_as_the_reference_and_applies_after_the_penalties():
    g = torch.Generator().manual_seed(14)
    V = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    words = (V + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)  # (B, W)
    mask[1] = -1  # a row without a grammar: every token allowed
    got = unpack_bitmask(mask, V)  # (B, V) bool
    for b in range(3):
        assert got[b].tolist() == ref_unpack(mask[b], V)
    assert bool(got[1].all())
    params = [SamplingParams(temperature=0.9, presence_penalty=1.0, logit_bias={3: 2.0}), SamplingParams(top_k=5),
              SamplingParams(temperature=0.0)]
    logits = torch.randn(3, V, generator=g) * 2  # (B, V)
    hist = [[1, 2, 3, 3], [4], [5]]
    batch = SamplingBatch.build(params, [1, 2, 3], [2, 0, 0], hist, prompt_lens=[2, 1, 1])
    batch.allowed = mask
    fast = filtered_probs(logits, batch)  # (B, V)
    for b, p in enumerate(params):
        ref = reference_filter(logits[b], p, hist[b], prompt_len=[2, 1, 1][b], allowed_row=mask[b])
        torch.testing.assert_close(fast[b], ref, atol=1e-6, rtol=0)
        assert not bool((fast[b] > 0)[~got[b]].any()), "a forbidden token keeps no probability"
    alone = filtered_probs(logits[1:2], _batch([params[1]]))
    assert torch.equal(fast[1], alone[0]), "a row without a grammar is as it is in a batch without one"
    assert int(fast[2].argmax()) == int(logits[2].masked_fill(~got[2], -math.inf).argmax())  # greedy: allowed argmax


@pytest.mark.unit
def test_top_p_keeps_the_crossing_token():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()  # (1, 3) exact probabilities 0.5, 0.3, 0.2
    for p, kept in [(0.0, 1), (0.4, 1), (0.6, 2), (0.75, 2), (0.85, 3), (0.999, 3), (1.0, 3)]:
        probs = filtered_probs(logits, _batch([SamplingParams(top_p=p)]))[0]
        assert int((probs > 0).sum()) == kept, p
        assert int((reference_filter(logits[0], SamplingParams(top_p=p)) > 0).sum()) == kept, p


# ------------------------------------------------------------------------------------------- random stream

M = 0xFFFFFFFF


def murmur3_32(data: bytes, seed: int) -> int:
    """Plain MurmurHash3_x86_32, the specification random_u32 vectorises."""
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & M  # noqa: E731
    h, n = seed & M, len(data)
    for i in range(0, n - n % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        h ^= rotl(k * 0xCC9E2D51 & M, 15) * 0x1B873593 & M
        h = (rotl(h, 13) * 5 + 0xE6546B64) & M
    if n % 4:
        k = int.from_bytes(data[n - n % 4 :], "little")
        h ^= rotl(k * 0xCC9E2D51 & M, 15) * 0x1B873593 & M
    h ^= n
    h ^= h >> 16
    h = h * 0x85EBCA6B & M
    h ^= h >> 13
    h = h * 0xC2B2AE35 & M
    return h ^ (h >> 16)


@pytest.mark.unit
def test_hash_is_murmur3():
    for data, seed, want in [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
    ]:
        assert murmur3_32(data, seed) == want, data
    seeds = [0, 1, 2**32 - 1, 2**32 + 5, 2**63 - 1, 123456789012345]
    steps = [0, 7, 2**31, 2**40 + 3, 99, 1]
    got = random_u32(torch.tensor(seeds), torch.tensor(steps), 300, 0x9E3779B9)  # (B, V)
    for b, (s, t) in enumerate(zip(seeds, steps)):
        for v in (0, 1, 2, 150, 299):
            msg = b"".join(w.to_bytes(4, "little") for w in (s & M, s >> 32, t & M, t >> 32, v))
            assert int(got[b, v]) == murmur3_32(msg, 0x9E3779B9), (s, t, v)


@pytest.mark.unit
def test_uniforms_in_open_interval_and_uniform():
    seeds = torch.arange(40, dtype=torch.int64)
    u = random_uniform(seeds, torch.arange(40, dtype=torch.int64) * 3, 2500)  # (40, 2500) float64
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4
    assert len(np.unique(u.numpy())) == u.numel()  # 52 bits: no collisions at this size
    # Low bits are random too (the 52 bits are not a 32-bit value scaled up).
    low = ((u * 2.0**52).long() & 0xFFFFF).flatten().numpy() / 2.0**20
    assert stats.kstest(low, "uniform").pvalue > 1e-4
    # Every word of the counter matters: high seed bits, high step bits.
    a = random_uniform(torch.tensor([5, 5 + 2**32, 5, 5]), torch.tensor([3, 3, 3 + 2**32, 4]), 16)
    assert len({tuple(r) for r in a.tolist()}) == 4


# ---------------------------------------------------------------------------------------------- chi-square

CHI_CONFIGS = [
    (0.5, 0, 1.0),
    (1.0, 0, 1.0),
    (2.0, 0, 1.0),
    (1.0, 5, 1.0),
    (0.5, 5, 0.9),
    (1.0, 0, 0.5),
    (2.0, 0, 0.9),
    (2.0, 5, 0.5),
    (1.0, 1, 1.0),
    (1.0, 0, 0.0),
    (0.0, 0, 1.0),
    (0.0, 5, 0.5),
]
N_DRAWS = 20_000
V_SMALL = 12


@pytest.fixture(scope="module")
def small_logits():
    g = torch.Generator().manual_seed(3)
    return (torch.linspace(-1.5, 1.5, V_SMALL) + 0.05 * torch.randn(V_SMALL, generator=g))[
        torch.randperm(V_SMALL, generator=g)
    ]  # (V,) distinct values, moderate spread so every surviving token has a healthy expected count


CHI_NEW = [  # the controls that change the distribution, each with the others off
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, top_p=0.95, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={3: 1.0, 5: -100}),
]
HISTORY = [1, 2, 3, 3, 8]  # the last three generated


@pytest.mark.reference
@pytest.mark.parametrize("kw", [dict(temperature=T, top_k=k, top_p=p) for T, k, p in CHI_CONFIGS] + CHI_NEW,
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_chi_square_against_filtered_distribution(small_logits, kw):
    params = SamplingParams(**kw)
    T, k, p = params.temperature, params.top_k, params.top_p
    assert _top_p_margin(small_logits, params) > 1e-3
    # One batch of N rows, same seed, steps 0..N-1: batched, and every row a different counter.
    hist = [HISTORY] * N_DRAWS if params.uses_history else None
    batch = SamplingBatch.build([params] * N_DRAWS, [20240601] * N_DRAWS, list(range(N_DRAWS)), hist,
                                prompt_lens=[2] * N_DRAWS)
    tokens = sample(small_logits.expand(N_DRAWS, V_SMALL), batch).tokens  # (N,)
    probs = reference_filter(small_logits, params, HISTORY, prompt_len=2).double()  # (V,)
    counts = torch.bincount(tokens, minlength=V_SMALL).double()  # (V,)
    alive = probs > 0
    assert float(counts[~alive].sum()) == 0, "a filtered-out token was drawn"
    if int(alive.sum()) == 1:  # T = 0, k = 1, p = 0: always the argmax
        assert bool((tokens == small_logits.argmax()).all())
        return
    expected = probs[alive] / probs[alive].sum() * N_DRAWS  # fp32 probabilities sum to 1 only within ~1e-7
    assert float(expected.min()) >= 5  # the chi-square approximation holds
    pvalue = stats.chisquare(counts[alive].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-4, (T, k, p, pvalue)


@pytest.mark.unit
@pytest.mark.parametrize("pair", ["adjacent_seeds", "adjacent_steps"])
def test_neighbouring_streams_are_independent(pair):
    """Joint chi-square over 12 x 12 token pairs from neighbouring counters: a correlated hash shows here."""
    n, V = N_DRAWS, V_SMALL
    steps = list(range(n))
    if pair == "adjacent_seeds":
        seeds, steps = [77] * n + [78] * n, steps + steps
    else:
        seeds, steps = [77] * (2 * n), list(range(0, 2 * n, 2)) + list(range(1, 2 * n, 2))
    batch = SamplingBatch.build([SamplingParams()] * (2 * n), seeds, steps, None)
    tokens = sample(torch.zeros(2 * n, V), batch).tokens  # (2N,) uniform over V
    joint = torch.bincount(tokens[:n] * V + tokens[n:], minlength=V * V).numpy()
    assert stats.chisquare(joint).pvalue > 1e-4


# --------------------------------------------------------------------------------------- reproducibility


@pytest.mark.unit
def test_same_tokens_alone_or_batched():
    g = torch.Generator().manual_seed(4)
    V, steps = 50, 25
    mine = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, repetition_penalty=1.2, seed=9)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.3, logprobs=3), SamplingParams(trace=4)]
    history = [1, 2, 3]
    alone, batched = [], []
    for step in range(steps):
        logits = torch.randn(4, V, generator=g)  # (4, V) row 2 is "my" request's logits
        out = sample(logits[2:3], SamplingBatch.build([mine], [9], [step], [history]))
        alone.append((int(out.tokens[0]), float(out.logprob[0])))
        params = [others[0], others[1], mine, others[2]]
        out = sample(logits, SamplingBatch.build(params, [1, 2, 9, 3], [0, step + 5, step, 2], [[], [7], history, []]))
        batched.append((int(out.tokens[2]), float(out.logprob[2])))
        history.append(alone[-1][0])
    assert alone == batched
    assert len({t for t, _ in alone}) > 5  # the draws are actually random


@pytest.mark.unit
def test_seeds_and_steps_change_the_draw():
    V, n = 30, 64
    logits = torch.zeros(n, V)  # (n, V) uniform: every difference comes from the stream
    draw = lambda seeds, steps: sample(logits, _batch([SamplingParams()] * n, None, seeds, steps)).tokens  # noqa: E731
    a = draw([1] * n, list(range(n)))
    assert torch.equal(a, draw([1] * n, list(range(n))))  # deterministic
    assert not torch.equal(a, draw([2] * n, list(range(n))))
    assert not torch.equal(a, draw([1 + 2**32] * n, list(range(n))))
    assert not torch.equal(a, draw([1] * n, list(range(1, n + 1))))
    assert len(set(a.tolist())) > 15  # steps 0..n-1 under one seed are not a constant


# ---------------------------------------------------------------------------------------- logprobs, trace


@pytest.mark.unit
def test_logprobs_and_trace_outputs():
    g = torch.Generator().manual_seed(5)
    V = 40
    params = [
        SamplingParams(temperature=0.7, top_k=6, top_p=0.8, repetition_penalty=1.5, logprobs=0, trace=3),
        SamplingParams(temperature=1.3, top_p=0.6, logprobs=5),
        SamplingParams(temperature=0.9, top_k=25, top_p=0.9, min_p=0.05, trace=50),
        SamplingParams(temperature=0.0, trace=2),
    ]
    histories = [[0, 1, 2, 3, 4, 5], [], [9], []]
    logits = torch.randn(4, V, generator=g) * 2  # (B, V)
    batch = _batch(params, histories, steps=[3, 1, 4, 1])
    out = sample(logits, batch)
    assert isinstance(out, SampleOutput)
    assert out.tokens.shape == (4,) and out.tokens.dtype == torch.int64
    assert out.logprob.shape == (4,) and out.logprob.dtype == torch.float32
    raw = torch.log_softmax(logits, -1)  # before penalty and temperature
    torch.testing.assert_close(out.logprob, raw.gather(1, out.tokens[:, None])[:, 0])
    ids, lps = out.top_logprobs
    assert ids.shape == lps.shape == (4, 5) and ids.dtype == torch.int64 and lps.dtype == torch.float32
    torch.testing.assert_close(lps, raw.topk(5).values)
    assert torch.equal(ids, raw.topk(5).indices)
    assert int(out.tokens[3]) == int(logits[3].argmax())

    assert tuple(out.trace) == TRACE_STAGES
    n = min(50, V)
    for name, (tid, tp) in out.trace.items():
        assert tid.shape == tp.shape == (4, n), name
        assert torch.equal(tid, out.trace["temperature"][0]), "every stage lists the same tokens"
        assert bool((tp.sum(-1) <= 1 + 1e-5).all()) and bool((tp >= 0).all())
        assert bool((tp[:, :-1] >= tp[:, 1:]).all()), "top-N is sorted"
        if name != "penalties":  # before temperature: a greedy row's distribution is still the model's
            assert torch.equal(tp[3], torch.nn.functional.one_hot(torch.tensor(0), n).float())  # greedy row
        assert int(tid[3, 0]) == int(logits[3].argmax())
    torch.testing.assert_close(out.trace["penalties"][1][3], torch.softmax(logits[3], -1).topk(n).values)
    fp = filtered_probs(logits, batch)
    for b in range(3):
        p = params[b]
        pen = ref_penalty(logits[b], histories[b], p.repetition_penalty)
        t_probs = torch.softmax(ref_temperature(pen, p.temperature), -1)
        tid, tp = out.trace["temperature"]
        torch.testing.assert_close(tp[b], t_probs[tid[b]])
        kid, kp = out.trace["top_k"]
        assert 0 < int((kp[b] > 0).sum()) <= (p.top_k or V)
        assert math.isclose(float(kp[b].sum()), 1.0, abs_tol=1e-5)  # all top-k survivors fit in N = V
        pid, pp = out.trace["top_p"]
        survivors = pid[b][pp[b] > 0]
        torch.testing.assert_close(pp[b][pp[b] > 0], fp[b][survivors])  # the last stage is the draw's
        k_mass = dict(zip(kid[b].tolist(), kp[b].tolist()))
        mass = [k_mass[int(s)] for s in survivors]
        assert sum(mass) >= p.top_p - 1e-6, "top-p survivors reach p"
        assert sum(mass[:-1]) < p.top_p, "and are the smallest such prefix"
        # The stats are exact over the vocabulary: compare with the plain per-step references.
        after_m = ref_min_p(ref_temperature(pen, p.temperature), p.min_p)
        after_k = ref_top_k(after_m, p.top_k)
        after_p = ref_top_p(after_k, p.top_p)
        km, kk, kp, mm, mk, mp, ent = out.trace_stats[b].tolist()
        assert (km, kk, kp) == tuple(int((a > -math.inf).sum()) for a in (after_m, after_k, after_p))
        assert math.isclose(mm, float(t_probs[after_m > -math.inf].sum()), rel_tol=1e-5)
        assert math.isclose(mk, float(t_probs[after_k > -math.inf].sum()), rel_tol=1e-5)
        assert math.isclose(mp, float(t_probs[after_p > -math.inf].sum()), rel_tol=1e-5)
        q = reference_filter(logits[b], p, histories[b])
        assert math.isclose(ent, float(-(q[q > 0] * q[q > 0].log()).sum()), rel_tol=1e-4)
    assert km < V, "min_p removed tokens in row 2"
    assert out.trace_stats.shape == (4, len(TRACE_STATS)) and out.trace_stats[3].tolist() == [1.0] * 6 + [0.0]
    # Only a chosen-token logprob asked for: no top list; nothing asked: no trace.
    out = sample(logits[:1], _batch([SamplingParams(logprobs=0)]))
    assert out.top_logprobs is None and out.trace is None and out.trace_stats is None and out.logprob.shape == (1,)


@pytest.mark.reference
def test_reference_steps():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    assert torch.equal(ref_temperature(row, 2.0), row / 2)
    assert torch.equal(ref_top_k(row, 2), torch.tensor([2.0, -math.inf, -math.inf, 3.0, -math.inf]))
    assert torch.equal(ref_top_k(row, 0), row)
    assert int((ref_top_p(row, 0.0) > -math.inf).sum()) == 1
    assert torch.equal(ref_top_p(row, 1.0), row)
    assert torch.equal(ref_penalty(row, [0, 1, 1], 2.0), torch.tensor([1.0, -2.0, 0.5, 3.0, -4.0]))


@pytest.mark.unit
def test_the_largest_float32_temperature_samples_uniformly_without_nan():
    p = SamplingParams(temperature=3.4e38, top_p=0.0, trace=3, seed=1, min_tokens=1, max_new_tokens=2)
    logits = torch.randn(1, 50)
    logits[0, 7] = -float("inf")  # a suppressed token (EOS under min_tokens) stays impossible
    res = sample(logits, SamplingBatch.build([p], [1], [0], None, device=torch.device("cpu")))
    assert res.tokens[0].item() != 7
    assert not any(pr.isnan().any() for _, pr in res.trace.values())
    assert not res.trace_stats.isnan().any()


# Every value the validation accepts, at its extremes: the edges of each range (read from its constants, so a wider
# range is tested at its new edges), the smallest subnormal above a lower bound of 0, values just inside each bound.
_P_LO, _P_HI = REPETITION_PENALTY_RANGE
_TINY = (1e-45, 1e-40, 1e-38, 1e-30, 1e-6)  # float32's subnormals and just above: where fp32 division overflows
_T_LOW = sorted({max(TEMPERATURE_MIN, t) for t in _TINY})  # the tiny values the range takes
_P_LOW = sorted({max(_P_LO, t) for t in _TINY})
_EXTREME_VALID = {
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, *_T_LOW, 1.0, 1e30, FLOAT32_MAX]),
                             st.floats(TEMPERATURE_MIN, FLOAT32_MAX)),
    "repetition_penalty": st.one_of(st.sampled_from([*_P_LOW, _P_LO * 1.00001, 1.0, _P_HI * 0.9999, _P_HI]),
                                    st.floats(_P_LO, _P_HI)),
    "top_p": st.sampled_from([0.0, 5e-324, 1e-45, 0.5, 1.0 - 1e-16, 1.0]),
    "min_p": st.sampled_from([0.0, 5e-324, 1e-45, 0.5, 1.0]),
    "top_k": st.sampled_from([0, 1, 2, 63, 64, 10**9]),
    "presence_penalty": st.sampled_from([-2.0, -5e-324, 0.0, 5e-324, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, -5e-324, 0.0, 5e-324, 2.0]),
    "logit_bias": st.dictionaries(st.integers(0, 70), st.sampled_from([-100.0, -5e-324, 100.0]), max_size=4),
}


@pytest.mark.unit
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(kw=st.fixed_dictionaries({}, optional=_EXTREME_VALID), scale=st.sampled_from([1.0, 30.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_every_accepted_value_gives_finite_outputs(kw, scale, seed):
    """Whatever the validation accepts, every number the sampler reports (logprobs, the trace's probabilities,
    counts, masses and entropy) is finite and the draw is from the row's support: the ranges are where the fp32
    arithmetic stays finite. The rows hold -inf (an EOS held off, a grammar's mask) and large logits."""
    params = SamplingParams(**kw, logprobs=20, trace=5)
    g = torch.Generator().manual_seed(seed)
    V = 64
    logits = torch.randn(2, V, generator=g) * scale  # (B, V)
    logits[:, 5] = -math.inf  # held off: its logprob is reported as LOGPROB_FLOOR
    logits[0, 9] = logits[0].max() + scale  # a seen token far above the rest (the penalty divides it)
    histories = [[9, 1, 2, 9], [0, 9, 63]]
    out = sample(logits, SamplingBatch.build([params] * 2, [seed, seed + 1], [0, 3], histories, prompt_lens=[2, 1]))
    assert not bool((out.tokens == 5).any()), "a token of probability 0 was drawn"
    assert bool(torch.isfinite(out.logprob).all()) and bool(torch.isfinite(out.top_logprobs[1]).all())
    assert float(out.top_logprobs[1].min()) >= LOGPROB_FLOOR
    for ids, pr in out.trace.values():
        assert bool(torch.isfinite(pr).all()) and bool(((pr >= 0) & (pr <= 1)).all()), kw
    assert bool(torch.isfinite(out.trace_stats).all()), (kw, out.trace_stats)


@pytest.mark.unit
def test_a_logprob_of_minus_infinity_is_reported_at_the_floor():
    """A token the model gives probability 0 (an EOS held off by min_tokens) has logprob -inf, which neither JSON nor
    a client's float arithmetic takes: it is reported as LOGPROB_FLOOR (-9999.0, vLLM's floor)."""
    logits = torch.tensor([[2.0, 1.0, -math.inf, -math.inf]])  # (1, V)
    out = sample(logits, _batch([SamplingParams(temperature=0.0, logprobs=4)]))
    assert out.top_logprobs[0][0, :2].tolist() == [0, 1] and sorted(out.top_logprobs[0][0, 2:].tolist()) == [2, 3]
    assert out.top_logprobs[1][0, 2:].tolist() == [LOGPROB_FLOOR] * 2
    assert out.top_logprobs[1][0, :2].tolist() == torch.log_softmax(logits[0, :2], -1).tolist()  # the rest as before


@pytest.mark.reference
def test_greedy_fast_path_matches_the_general_path():
    # A greedy batch that asks for no logprobs and no trace takes the argmax of the penalised logits alone;
    # the tokens must be those of the general path (which also computes log-softmaxes and one-hots).
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 64, generator=g) * 3  # (B, V)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins on both paths
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in (1.0, 1.3, 1.0, 2.0, 1.0)]
    histories = [[1, 2], [int(logits[1].argmax()), 5], [], [int(logits[3].argmax())], [63]]
    fast = _batch(params, histories)
    assert fast.all_greedy and not fast.want_logprob
    out = sample(logits, fast)
    assert out.logprob is None and out.top_logprobs is None and out.trace is None
    general = sample(logits, replace(fast, want_logprob=True))
    assert torch.equal(out.tokens, general.tokens)
    assert int(out.tokens[2]) == 7
    assert _batch([SamplingParams(temperature=0.0, logprobs=0)]).want_logprob
