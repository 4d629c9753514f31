"""On-demand KV blocks and preemption (server/scheduler.py, server/kv_pool.py's ``grow``): a request takes its
prompt's blocks when admitted and one more as its tokens need it; when the pool runs dry the newest running request
is preempted, goes back to the head of the queue and is taken back by recomputing what it had. Its output is the
unpreempted one: float32 tokens equal and logprobs within 1e-5, with every sampling control, ``n`` samples, JSON
mode, stop strings, prompt logprobs and streams; the pool's books hold after every step of it."""

from __future__ import annotations

import json
import queue

import pytest
import torch
from conftest import wait_until
from helpers import greedy_exact

from server import outputs as out
from server.config import EngineConfig
from server.engine import Engine
from server.kv_pool import BlockPool, KVLayout
from server.sampling_params import SamplingParams
from server.scheduler import ON_DEMAND, RESERVE, Scheduler, Sequence

BS = 16


# ------------------------------------------------------------------------------------------- the scheduler alone


def _scheduler(blocks: int, admission: str = ON_DEMAND, watermark: int = 0, prefix_cache: bool = True,
               max_batch: int = 8) -> Scheduler:
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=BS)
    pool = BlockPool(layout, blocks * layout.bytes_per_block, allocate=False, prefix_cache=prefix_cache)
    return Scheduler(pool, max_batch, 1024, admission, watermark)


def _seq(rid: str, prompt_len: int, new: int, first: int = 3, **kw) -> Sequence:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, seed=0, **kw)
    return Sequence(rid, list(range(first, first + prompt_len)), params, sink=None)


def _run_step(s: Scheduler, plan, token: int = 1) -> None:
    """What the engine does with a plan, serially: prefill chunks recorded (blocks published), every row that
    samples gets ``token``."""
    for seq, start, n in plan.prefill:
        seq.prefilled = start + n
        s.pool.publish(seq.id, seq.prefilled)
    for seq in plan.decode + [seq for seq, start, n in plan.prefill if start + n == seq.fill_len]:
        seq.generated.append(token)


@pytest.mark.unit
def test_on_demand_admission_takes_the_prompts_blocks_and_grows_a_block_at_a_time():
    s = _scheduler(20)
    a = _seq("a", 20, 100)  # reserve would take ceil(120 / 16) = 8 blocks; the prompt needs 2
    s.add(a)
    assert s.admit() == [a] and len(a.blocks) == 2 == s.pool.used_blocks
    for step in range(60):
        plan = s.plan()
        assert plan is not None
        _run_step(s, plan)
        assert len(a.blocks) == -(-a.kv_tokens // BS)  # the blocks of the positions written, no more
        s.pool.audit()
    assert a.peak_blocks == len(a.blocks) == -(-(20 + 59) // BS)


@pytest.mark.unit
def test_reserve_admission_takes_the_worst_case_and_never_grows():
    s = _scheduler(20, admission=RESERVE)
    a, b, c = _seq("a", 20, 100), _seq("b", 20, 100, first=50), _seq("c", 20, 100, first=90)
    for q in (a, b, c):
        s.add(q)
    assert s.admit() == [a, b] and len(a.blocks) == 8 and s.waiting[0] is c  # 16 of 20 blocks: c does not fit
    for _ in range(99):
        _run_step(s, s.plan())
    assert len(a.blocks) == 8 and s.preemptions == 0


@pytest.mark.unit
def test_the_newest_request_is_preempted_back_to_the_head_and_resumes_by_recomputing():
    s = _scheduler(8, prefix_cache=False)
    a, b, c = _seq("a", 20, 44), _seq("b", 20, 44, first=40), _seq("c", 20, 44, first=80)  # 4 blocks each at most
    for q in (a, b, c):
        s.add(q)
    assert s.admit() == [a, b, c]  # 2 blocks each: 6 of 8
    while not s.preemptions:
        _run_step(s, s.plan())
        s.pool.audit()
    # at position 32 a and b took the two free blocks; c, the newest, needing a third, was preempted
    assert c.preemptions == 1 and c.blocks is None and list(s.waiting) == [c] and len(a.blocks) == 3
    gen = list(c.generated)
    assert len(gen) == 32 - 20 + 1 and c.kv_written == 32
    assert c not in s.running and s.admit() == []  # no room yet: c waits at the head
    late = _seq("late", 4, 4, first=200)
    s.add(late)
    assert s.admit() == [] and list(s.waiting) == [c, late]  # nothing overtakes a preempted request
    while c not in s.running:  # a and b run to their end, then c is taken back
        _run_step(s, s.plan())
        for q in (a, b):
            if q in s.running and len(q.generated) == 44:
                s.finish(q)
        s.admit()
        s.pool.audit()
    assert a.done and b.done and s.preemptions == 1
    assert c in s.running and c.generated == gen and c.recompute == len(gen)
    assert c.fill_tokens(0, c.fill_len) == c.prompt + gen  # its prefill is its prompt and its tokens so far
    assert c.recomputed_tokens == 20 + len(gen) - 1 == s.recomputed_tokens  # all it had written, again
    plan = s.plan()
    assert [(q, st, n) for q, st, n in plan.prefill if q is c] == [(c, 0, 20 + len(gen))]
    _run_step(s, plan, token=9)
    assert c.generated == gen + [9] and not c.in_prompt and c.kv_tokens == 20 + len(gen)
    s.pool.audit()


@pytest.mark.unit
def test_a_request_taken_back_maps_its_published_prompt_blocks():
    s = _scheduler(8)
    a, b = _seq("a", 40, 60), _seq("b", 40, 60, first=100)
    s.add(a)
    s.add(b)
    s.admit()
    while not s.preemptions:
        _run_step(s, s.plan())
    assert b.preemptions == 1 and b.kv_written > 40
    s.finish(a)
    s.admit()
    assert b in s.running and b.prefilled == 2 * BS  # its two full prompt blocks stayed in the prefix cache
    assert b.recomputed_tokens == b.kv_written - 2 * BS
    assert b.cached == 0  # the response's prompt_tokens_cached counts its first admission only
    s.pool.audit()


@pytest.mark.unit
def test_a_scored_prompt_preempted_inside_it_is_scored_again_from_its_start():
    s = _scheduler(8, prefix_cache=False)
    b = _seq("b", 40, 4, prompt_logprobs=1)
    s.add(b)
    s.admit()
    b.prefilled = 16
    b.prompt_logprobs.extend(["scored"] * 16)  # as if its first chunk were scored
    s._preempt()
    assert b.preemptions == 1 and b.prompt_logprobs == [] and b.scores_prompt and b.kv_written == 16
    s.admit()
    assert b.prefilled == 0 and b.recompute == 0 and b.recomputed_tokens == 16
    assert s.plan().prefill == [(b, 0, 40)]


@pytest.mark.unit
def test_the_watermark_holds_back_admission_only_while_others_run():
    s = _scheduler(10, watermark=3)
    a, b = _seq("a", 100, 4), _seq("b", 40, 4, first=300)  # 7 blocks, then 3
    s.add(a)
    s.add(b)
    assert s.admit() == [a]  # alone it is admitted whatever the watermark
    assert list(s.waiting) == [b]  # 3 more would leave none of the 3 kept free
    s.finish(a)
    assert s.admit() == [b]


@pytest.mark.unit
def test_no_preemption_while_a_step_is_in_flight():
    s = _scheduler(4, prefix_cache=False)
    a, b = _seq("a", 32, 60), _seq("b", 32, 60, first=100)
    s.add(a)
    s.add(b)
    s.admit()  # 2 + 2 blocks: the pool is full
    _run_step(s, s.plan())  # both prefilled and sampled: each needs a third block for position 33
    assert s.plan(can_preempt=False) is None and s.preemptions == 0 and not s.waiting
    plan = s.plan()
    assert plan.decode == [a] and b.preemptions == 1 and list(s.waiting) == [b]


# --------------------------------------------------------------------------------------------- in the engine


def _make(path, cache_dir, budget: str, **kw) -> Engine:
    cfg = {"max_prefill_tokens": 64, "dtype": "float32", "memory_budget": budget, **kw}
    return Engine.from_path(str(path), EngineConfig(**cfg), cache_dir)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, cache_dir):
    """(a roomy engine that never preempts, one of 14 blocks that must, the same with overlapped steps: each step
    launched before the previous one is read, as on CUDA, where a preemption first reads the step in flight)"""
    roomy = _make(tiny_model_dir, cache_dir, "4MiB")
    tight = _make(tiny_model_dir, cache_dir, str(14 * roomy.layout.bytes_per_block))
    overlapped = _make(tiny_model_dir, cache_dir, str(14 * roomy.layout.bytes_per_block), overlap=True)
    yield roomy, tight, overlapped
    for e in (roomy, tight, overlapped):
        e.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


FORMAT = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
    "k": {"type": "string", "enum": ["a", "bb"]}, "n": {"type": "integer"}}, "required": ["k", "n"]}}}


def _requests(roomy: Engine) -> dict[str, tuple[list[int], SamplingParams, int]]:
    """name: (prompt, params, n): every control, alone and together, and the features that keep state."""
    sampled = dict(temperature=0.9, seed=11, max_new_tokens=60, min_tokens=60, logprobs=3)
    reqs = {
        "greedy": (_prompt(20, 1), greedy_exact(60, logprobs=3), 1),
        "sampled": (_prompt(36, 2), SamplingParams(top_p=0.9, top_k=50, min_p=0.02, **sampled), 1),
        "penalties": (_prompt(25, 3), SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                                     frequency_penalty=0.4, logit_bias=((7, 2.0), (9, -3.0)),
                                                     **sampled), 1),
        "n": (_prompt(20, 4), SamplingParams(**sampled | {"seed": 5}), 3),
        "scored": (_prompt(40, 5), SamplingParams(**sampled | {"seed": 6}, prompt_logprobs=2), 2),
    }
    # a stop string from the middle of the unpreempted text, so both runs stop there
    text = roomy.complete(_prompt(30, 6), SamplingParams(**sampled | {"seed": 7, "logprobs": None})).text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    reqs["stop"] = (_prompt(30, 6), SamplingParams(**sampled | {"seed": 7, "min_tokens": 0}, stop=(stop,)), 1)
    try:
        import xgrammar  # noqa: F401
        reqs["json"] = (_prompt(24, 8), SamplingParams(temperature=1.0, seed=8, max_new_tokens=60,
                                                       response_format=FORMAT), 1)
    except ImportError:
        pass
    return reqs


def _streams(engine: Engine, reqs) -> dict[tuple[str, int], list[out.Event]]:
    """Every request at once; each sample's events in the order they came."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    for name, (prompt, params, n) in reqs.items():
        engine.submit(prompt, params, lambda ev, name=name: q.put((name, ev)), request_id=name, n=n)
    events: dict[tuple[str, int], list[out.Event]] = {}
    left = sum(n for _, _, n in reqs.values())
    while left:
        name, ev = q.get(timeout=300)
        events.setdefault((name, ev.index), []).append(ev)
        left -= ev.finished
    return events


def _assert_same(got: out.Completion, want: out.Completion, what) -> None:
    assert got.token_ids == want.token_ids and got.text == want.text, what
    assert (got.finish_reason, got.stop) == (want.finish_reason, want.stop), what
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-5, what
        assert [t for t, _ in a.top] == [t for t, _ in b.top], what
    for a, b in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5, what


@pytest.mark.reference
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_preempted_requests_give_what_they_give_unpreempted(engines, overlap):
    """Seven requests at once on 14 blocks (each alone needs up to 7): many are preempted and taken back, some
    more than once. Each sample's tokens, text, finish, logprobs and prompt logprobs equal the same request's on an
    engine that never preempts, streamed without a token sent twice; the accounting says how often each was
    preempted and what it recomputed, and the pool's books are exact once all are done."""
    roomy, tight, overlapped = engines
    tight = overlapped if overlap else tight
    reqs = _requests(roomy)
    want = {key: out.collect(evs) for key, evs in _streams(roomy, reqs).items()}
    before = tight.totals()
    got_events = _streams(tight, reqs)
    after = tight.totals()
    assert after.preemptions > before.preemptions and after.recomputed_tokens > before.recomputed_tokens
    assert roomy.totals().preemptions == 0
    preempted = 0
    for key, evs in got_events.items():
        got = out.collect(evs)
        _assert_same(got, want[key], key)
        streamed = [t for ev in evs for t in ev.token_ids]
        assert streamed == list(got.token_ids) and len(streamed) == got.accounting.generated_tokens
        assert sum(bool(ev.prompt_logprobs) for ev in evs) == (reqs[key[0]][1].prompt_logprobs is not None)
        a = got.accounting
        preempted += a.preemptions > 0
        assert (a.preemptions > 0) == (a.recomputed_tokens > 0) or a.generated_tokens <= 1
        assert a.kv_bytes_own + a.kv_bytes_shared == a.kv_bytes_reserved <= 14 * tight.layout.bytes_per_block
        assert a.kv_dtype == "float32"
    assert preempted >= 2
    if "json" in reqs:
        c = out.collect(got_events[("json", 0)])
        if c.finish_reason == "stop":
            assert json.loads(c.text)["k"] in ("a", "bb")
    tight.pool.audit()
    assert tight.pool.used_blocks == 0 and not tight.scheduler.has_work


@pytest.mark.e2e
def test_cancelling_a_preempted_request_returns_everything(engines):
    """A request cancelled while it waits preempted gets its final event with what it had produced, and leaves
    nothing held; the one that preempted it runs on."""
    _, tight, _ = engines
    events: dict[str, list] = {"a": [], "b": []}
    b_preempted = []
    base = tight.scheduler.preemptions

    def sink(name):
        def f(ev):
            events[name].append(ev)
            if name == "a" and not b_preempted and tight.scheduler.preemptions > base:
                b_preempted.append(True)
                tight.cancel("b")
        return f

    tight.submit(_prompt(60, 20), greedy_exact(100), sink("a"), request_id="a")
    tight.submit(_prompt(60, 21), greedy_exact(100), sink("b"), request_id="b")
    assert wait_until(lambda: events["a"] and events["a"][-1].finished and events["b"] and events["b"][-1].finished,
                      timeout=120)
    assert tight.scheduler.preemptions > base
    fa, fb = events["a"][-1], events["b"][-1]
    assert fa.finish_reason == "length" and fb.finish_reason == "cancelled"
    assert fb.accounting.preemptions == 1
    assert len([t for ev in events["b"] for t in ev.token_ids]) == fb.accounting.generated_tokens
    tight.pool.audit()
    assert tight.pool.used_blocks == 0 and not tight.scheduler.has_work


@pytest.mark.reference
def test_in_bf16_a_preempted_request_gives_the_unpreempted_tokens(tiny_model_dir, cache_dir):
    """What holds in bfloat16: a request taken back recomputes as one prefill the K/V its decode steps wrote one
    at a time, which may round differently there. Held here: greedy tokens equal and each token's logprob within
    0.02 (the prefix cache's tolerance, tests/test_prefix_cache.py; measured 0.0000 on an AVX2-only AMD EPYC)."""
    roomy = _make(tiny_model_dir, cache_dir, "4MiB", dtype="bfloat16")
    tight = _make(tiny_model_dir, cache_dir, str(14 * roomy.layout.bytes_per_block), dtype="bfloat16")
    try:
        reqs = {f"g{i}": (_prompt(20 + 7 * i, 40 + i), greedy_exact(60, logprobs=1), 1) for i in range(6)}
        want = {k: out.collect(v) for k, v in _streams(roomy, reqs).items()}
        got = {k: out.collect(v) for k, v in _streams(tight, reqs).items()}
        assert tight.totals().preemptions >= 2
        worst = 0.0
        for key, g in got.items():
            assert g.token_ids == want[key].token_ids, key
            worst = max(worst, *(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, want[key].logprobs)))
        print(f"bf16 preemption: {tight.totals().preemptions} preemptions, worst logprob difference {worst:.4f}")
        assert worst <= 0.02
        tight.pool.audit()
    finally:
        roomy.close()
        tight.close()


@pytest.mark.e2e
def test_both_transports_and_metrics_report_preemptions(tiny_model_dir, cache_dir):
    """A live server of 14 blocks, four requests at once over gRPC and HTTP: each response's memory says how often
    it was preempted and what it recomputed, in the KV dtype it names; /metrics counts the same preemptions and
    names the KV cache's dtype and admission; the plan says the admission."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from live_server import start
    from quantserve.client import Client

    s = start(tiny_model_dir, cache_dir, memory_budget=str(14 * 16 * 512))
    try:
        # 190 tokens each (12 blocks): any two of them running at once need more than 14, however the four requests'
        # arrivals spread under load
        def one(i):
            with Client(s.http.removeprefix("http://") if i % 2 else s.grpc_target, http=bool(i % 2)) as c:
                return c.generate(_prompt(40, 60 + i), max_new_tokens=150, min_tokens=150, temperature=0.0)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(4)))
        mem = [r.memory for r in results]
        assert all(m.kv_dtype == "float32" and m.kv_bytes_per_token == 512 for m in mem)
        assert sum(m.preemptions for m in mem) >= 1
        assert all((m.preemptions > 0) == (m.recomputed_tokens > 0) for m in mem)
        metrics = httpx.get(s.http + "/metrics", timeout=30).text
        count = float(re.search(r"^quantserve_preemptions (\S+)$", metrics, re.M).group(1))
        assert count == sum(m.preemptions for m in mem)
        recomputed = float(re.search(r"^quantserve_recomputed_tokens (\S+)$", metrics, re.M).group(1))
        assert recomputed == sum(m.recomputed_tokens for m in mem)
        assert 'quantserve_kv_cache{admission="on-demand",dtype="float32"} 1.0' in metrics
        with Client(s.grpc_target) as c:
            assert c.plan([(40, 70)]).kv_admission == "on-demand"
        s.assert_idle()
    finally:
        s.shutdown()
