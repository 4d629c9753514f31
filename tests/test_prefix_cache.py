"""The prefix cache in the engine (server/kv_pool.py's BlockPool, mapped at admission by server/scheduler.py): a
request whose prompt starts with full blocks an earlier request wrote prefills only the rest and gets, token for
token, what it gets without the cache; its accounting splits the blocks it shared from those it owned, and the
pool's books equal a recount after every test."""

from __future__ import annotations

import threading

import pytest
import torch
from archs import ARCHITECTURES
from conftest import wait_until
from helpers import greedy_exact

from server.config import EngineConfig
from server.engine import Engine
from server.outputs import RequestError
from server.sampling_params import SamplingParams

BS = 16  # the engine's block size


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=seed, max_new_tokens=n, min_tokens=n,
                          logprobs=3)


def make(path, cache_dir, prefix_cache=True, budget="2MiB", **kw) -> Engine:
    kw = {"max_prefill_tokens": 64, "dtype": "float32", **kw}
    return Engine.from_path(str(path), EngineConfig(memory_budget=budget, prefix_cache=prefix_cache, **kw), cache_dir)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, cache_dir):
    on, off = make(tiny_model_dir, cache_dir), make(tiny_model_dir, cache_dir, prefix_cache=False)
    yield on, off
    for e in (on, off):
        e.close()


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) <= 1e-5


def assert_books(engine: Engine) -> None:
    engine.pool.audit()
    assert engine.pool.used_blocks == 0 and not engine.scheduler.has_work


@pytest.mark.reference
def test_outputs_with_the_cache_equal_those_without_and_say_what_was_cached(engines):
    """Prompts sharing a 48-token stem, one after another: ending on a block boundary (32), just past it (33, 35),
    a whole stem, past it, and diverging inside the second block. The cached tokens are the full blocks before the
    block of the prompt's last token that an earlier request wrote; greedy and seeded outputs, logprobs included,
    equal the uncached engine's."""
    on, off = engines
    stem = ids(48, 1)
    prompts = [stem[:32], stem[:32] + [7], stem[:33] + [9, 9], stem, stem + ids(5, 2), stem[:16] + ids(20, 3)]
    first = [0, 32, 32, 32, 48, 16]  # the first pass: what earlier prompts of the pass published
    again = [16, 32, 32, 32, 48, 32]  # the second: a prompt ending on a boundary maps all but its last block
    for params, cached in ((greedy_exact(8, logprobs=3), first), (sampled(8, 11), again)):
        for p, want_cached in zip(prompts, cached):
            got, want = on.complete(p, params), off.complete(p, params)
            assert_same(got, want)
            a = got.accounting
            assert a.prompt_tokens_cached == want_cached and want.accounting.prompt_tokens_cached == 0
            assert a.kv_bytes_own + a.kv_bytes_shared == a.kv_bytes_reserved
            assert a.kv_bytes_shared == want_cached // BS * on.layout.bytes_per_block
            assert want.accounting.kv_bytes_shared == 0
    t = on.totals()
    assert t.prefix_cache and not off.totals().prefix_cache
    assert t.prefix_hit_tokens == sum(first) + sum(again) and t.prefix_queried_tokens == 2 * sum(map(len, prompts))
    assert t.kv_cached_bytes == on.pool.cached_blocks * on.layout.bytes_per_block > 0
    for e in engines:
        assert_books(e)


@pytest.mark.reference
def test_in_bf16_the_cache_gives_the_uncached_tokens(tiny_model_dir, cache_dir):
    """What holds in bfloat16: a cached block's K/V was computed in another prefill chunk of another step than the
    uncached request computes it, and a projection's kernel may be chosen per row count (quant/runtime/kernel_choice.py),
    so the two may round differently. Held here: greedy tokens equal and each token's logprob within 0.02."""
    on = make(tiny_model_dir, cache_dir, dtype="bfloat16")
    off = make(tiny_model_dir, cache_dir, prefix_cache=False, dtype="bfloat16")
    try:
        for i in range(4):
            stem = ids(48, 100 + i)
            on.complete(stem, greedy_exact(1))
            p = stem + ids(7, 200 + i)
            a, b = on.complete(p, greedy_exact(8, logprobs=1)), off.complete(p, greedy_exact(8, logprobs=1))
            assert a.accounting.prompt_tokens_cached == 48
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 0.02
        assert_books(on)
    finally:
        on.close()
        off.close()


@pytest.mark.e2e
def test_requests_sharing_a_prefix_at_once_count_shared_blocks_once(tiny_model_dir, cache_dir):
    """A leader prefills a 40-token prompt; three followers extending it map its two full blocks while it still
    runs. While all four run (each holding its whole reservation: --kv-admission reserve), the engine's used KV
    counts the shared blocks once (5 + 3 x 2 blocks, not 5 + 3 x 4); each response's own + shared = reserved, the
    leader's shared blocks being the ones the followers mapped."""
    on = make(tiny_model_dir, cache_dir, kv_admission="reserve")
    try:
        _sharing_at_once(on)
    finally:
        on.close()


def _sharing_at_once(on: Engine) -> None:
    prompt = ids(40, 5)
    bpb = on.layout.bytes_per_block
    leader_first, leader_done = threading.Event(), []
    on.submit(prompt, greedy_exact(30), lambda ev: (leader_first.set(), ev.finished and leader_done.append(ev)))
    assert leader_first.wait(30)  # its prefill is done: its two full blocks are published
    firsts, finals = threading.Semaphore(0), {}
    used = []

    def sink(i):
        def f(ev):
            if ev.token_ids and not ev.finished and i not in finals:
                firsts.release()
            if ev.finished:
                finals[i] = ev
        return f

    for i in range(3):
        on.submit(prompt + [100 + i], greedy_exact(20), sink(i))
    for _ in range(3):
        assert firsts.acquire(timeout=30)
    if not leader_done:
        used.append(on.totals().kv_used_bytes)
    assert used and used[0] == (5 + 3 * 2) * bpb
    wait_until(lambda: leader_done and len(finals) == 3)
    leader = leader_done[0].accounting
    assert leader.prompt_tokens_cached == 0 and leader.kv_bytes_shared == 2 * bpb
    assert leader.kv_bytes_own + leader.kv_bytes_shared == leader.kv_bytes_reserved == 5 * bpb
    for i, ev in sorted(finals.items()):
        a = ev.accounting
        assert a.prompt_tokens_cached == 32 and a.kv_bytes_shared == 2 * bpb
        assert a.kv_bytes_own == a.kv_bytes_reserved - 2 * bpb == 2 * bpb
        assert on.pool.cached_prefix(prompt + [100 + i]) == 2
    assert_books(on)


@pytest.mark.reference
def test_a_full_pool_evicts_cached_blocks_least_recently_used_and_stays_exact(tiny_model_dir, cache_dir):
    """A pool of 8 blocks: prompts of five stems (two full blocks each) fill it with cached blocks; each new request
    evicts the least recently released ones it needs, never a block a running request holds, and outputs stay the
    uncached ones."""
    bpb_engine = make(tiny_model_dir, cache_dir, budget="4MiB")
    small = bpb_engine.layout.bytes_per_block * 8
    bpb_engine.close()
    on = make(tiny_model_dir, cache_dir, budget=str(small))
    off = make(tiny_model_dir, cache_dir, prefix_cache=False, budget=str(small))
    try:
        stems = [ids(40, 20 + i) for i in range(5)]
        for rnd in range(2):
            for s in stems:
                p = s + ids(3, 50 + rnd)
                assert_same(on.complete(p, greedy_exact(20, logprobs=2)), off.complete(p, greedy_exact(20, logprobs=2)))
                on.pool.audit()
        assert on.pool.evictions > 0 and on.totals().prefix_evictions == on.pool.evictions
        assert on.pool.free_blocks == on.pool.num_blocks
    finally:
        on.close()
        off.close()


@pytest.mark.reference
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_family_gives_the_uncached_tokens(arch, arch_dirs, cache_dir):
    """Each registered family (sliding-window layers, partial rotary, soft-capping among them) over a 32-token stem
    that spans its window: the cached request's greedy tokens and logprobs equal the same engine's with the cache
    switched off."""
    engine = make(arch_dirs(arch), cache_dir, budget="8MiB", max_prefill_tokens=16)
    try:
        stem = ids(33, 7)
        engine.complete(stem, greedy_exact(2))  # publishes its two full blocks
        prompts = [stem[:32] + ids(9, 8), stem + ids(16, 9)]
        cached = [engine.complete(p, greedy_exact(12, logprobs=2)) for p in prompts]
        assert [c.accounting.prompt_tokens_cached for c in cached] == [32, 32]
        engine.pool.prefix_cache = False  # the same engine, nothing mapped
        for p, c in zip(prompts, cached):
            u = engine.complete(p, greedy_exact(12, logprobs=2))
            assert u.accounting.prompt_tokens_cached == 0
            assert_same(c, u)
        assert_books(engine)
    finally:
        engine.close()


@pytest.mark.e2e
def test_cancel_failure_and_close_give_back_exactly_the_references_taken(tiny_model_dir, cache_dir, monkeypatch):
    """With shared blocks in flight: a leader cancelled while followers hold its blocks (they go on, and give the
    uncached tokens), a step that fails with a follower in it, and close() with requests sharing blocks; after each
    the pool's books equal a recount and nothing is held."""
    on, off = make(tiny_model_dir, cache_dir), make(tiny_model_dir, cache_dir, prefix_cache=False)
    try:
        prompt = ids(40, 30)
        started = threading.Event()
        h = on.submit(prompt, greedy_exact(200), lambda ev: started.set())
        assert started.wait(30)
        follower = prompt + [5]
        got = on.complete(follower, greedy_exact(10))  # admitted while the leader runs: maps its two blocks
        assert got.accounting.prompt_tokens_cached == 32
        h.cancel()
        assert got.token_ids == off.complete(follower, greedy_exact(10)).token_ids
        wait_until(lambda: on.pool.used_blocks == 0)
        assert_books(on)
        assert on.pool.cached_prefix(follower) == 2  # the cancelled leader's published blocks stay cached

        real = on.runner.forward
        calls = []

        def fail_once(step):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("planted")
            return real(step)

        monkeypatch.setattr(on.runner, "forward", fail_once)
        failed = on.complete(prompt + [6], greedy_exact(5))
        assert failed.finish_reason == "error"
        assert_books(on)
        ok = on.complete(prompt + [6], greedy_exact(5))
        assert ok.accounting.prompt_tokens_cached == 32 and ok.finish_reason == "length"
        assert_books(on)

        events = []
        for i in range(3):
            on.submit(prompt + [7 + i], greedy_exact(300), lambda ev: ev.finished and events.append(ev))
        wait_until(lambda: on.pool.used_blocks > 2)
        on.close()
        assert len(events) == 3 and {ev.finish_reason for ev in events} == {"cancelled"}
        on.pool.audit()
        assert on.pool.used_blocks == 0
    finally:
        on.close()
        off.close()


# ------------------------------------------------------------------------------------------- n samples


@pytest.mark.reference
def test_n_samples_share_one_prefill_and_each_is_its_seed_alone(engines):
    """A request of n = 4 samples of a 40-token prompt: admitted together, the first prefills the two shared
    blocks, the others their own last block; sample i equals a request of seed s + i alone (tokens and
    logprobs), each says what it shared, and while they run the four hold 2 + 4 x 2 blocks, not 4 x 4."""
    on, off = engines
    prompt = ids(40, 40)
    params = sampled(12, seed=123)
    got = on.samples(prompt, params, 4)
    for i, c in enumerate(got):
        alone = off.complete(prompt, params.with_seed(123 + i))
        assert c.seed == 123 + i
        assert_same(c, alone)
        a = c.accounting
        assert a.kv_bytes_own + a.kv_bytes_shared == a.kv_bytes_reserved == 4 * on.layout.bytes_per_block
        assert a.kv_bytes_shared == 2 * on.layout.bytes_per_block
        assert a.prompt_tokens_cached == (32 if i else 0)  # the first prefilled them (nothing was cached)
    assert len({c.token_ids for c in got}) > 1  # four seeds, not one sample four times
    assert on.pool.group_blocks(40, 52, 4) == 4 + 3 * 2
    assert_books(on)


@pytest.mark.e2e
def test_n_is_checked_and_a_cancelled_request_ends_every_sample(engines):
    on, _ = engines
    with pytest.raises(RequestError, match=r"n must be an integer in \[1, 64\]"):
        on.submit([5, 6, 7], greedy_exact(2), print, n=0)
    with pytest.raises(RequestError, match="KV blocks with the prompt's shared; the pool has"):
        on.submit(ids(100, 1), greedy_exact(400), print, n=64)
    # A sample's pool id is its request's id and "/i": taken ids are refused, whichever comes first.
    hold = on.submit(ids(20, 1), greedy_exact(300), print, request_id="x", n=2)
    with pytest.raises(RequestError, match="'x/1' is already in use"):
        on.submit([5, 6], greedy_exact(2), print, request_id="x/1")
    hold2 = on.submit([5, 6], greedy_exact(300), print, request_id="y/1")
    with pytest.raises(RequestError, match="request id 'y' names its samples 'y/i'; 'y/1' is already in use"):
        on.submit([5, 6], greedy_exact(2), print, request_id="y", n=2)
    hold.cancel()
    hold2.cancel()
    # A sink that fails for a later sample cancels the whole request (its blocks back at once, not at its end).
    def broken(ev):
        if ev.index == 1:
            raise RuntimeError("the caller went away")
    on.submit(ids(40, 42), greedy_exact(300), broken, n=2)
    wait_until(lambda: on.pool.used_blocks == 0 and not on.scheduler.has_work)
    assert_books(on)
    events = []
    started = threading.Event()
    h = on.submit(ids(40, 41), greedy_exact(300), lambda ev: (started.set(), events.append(ev)), n=3)
    assert started.wait(30)
    h.cancel()
    wait_until(lambda: sum(ev.finished for ev in events) == 3)
    finals = [ev for ev in events if ev.finished]
    assert sorted(ev.index for ev in finals) == [0, 1, 2] and {ev.finish_reason for ev in finals} == {"cancelled"}
    assert {ev.request_id for ev in events} == {h.id}
    assert_books(on)


@pytest.fixture(scope="module")
def server(tiny_model_dir, cache_dir):
    from live_server import start

    s = start(tiny_model_dir, cache_dir)
    yield s
    s.shutdown()


@pytest.mark.e2e
def test_n_over_http_grpc_the_openai_sdk_and_the_client(server):
    """n = 3 through every door: the openai SDK's completions and chat (choices[i], streaming interleaved by index),
    gRPC's Generate (choices) and GenerateStream (index), the Python client (Result.samples) over both transports;
    sample i is the request of seed + i alone, and the response says what the prefix cache gave."""
    import grpc
    import openai
    from quantserve.client import Client
    from quantserve.v1 import inference_pb2 as pb
    from quantserve.v1 import inference_pb2_grpc as pb_grpc

    prompt = ids(40, 60)
    kw = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=6)
    oa = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    r = oa.completions.create(model="m", prompt=prompt, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [oa.completions.create(model="m", prompt=prompt, **{**kw, "seed": 7 + i}) for i in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 18
    assert alone[1].usage.prompt_tokens_details.cached_tokens == 32  # the n request published the stem
    streamed = {}
    for chunk in oa.completions.create(model="m", prompt=prompt, n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in r.choices]
    chat = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me about rivers"}],
                                      n=2, temperature=0.8, seed=3, max_tokens=5)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content is not None for c in chat.choices)

    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.grpc_target))
    req = pb.GenerateRequest(prompt_ids=prompt, n=3, sampling=pb.SamplingParameters(
        temperature=0.9, top_p=0.95, seed=7, max_new_tokens=6))
    g = stub.Generate(req, timeout=60)
    assert [c.index for c in g.choices] == [0, 1, 2] and [c.final.seed for c in g.choices] == [7, 8, 9]
    by_index = {}
    for m in stub.GenerateStream(req, timeout=60):
        by_index.setdefault(m.index, []).extend(m.token_ids)
    assert [by_index[i] for i in range(3)] == [list(c.token_ids) for c in g.choices]
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt_ids=prompt, n=0), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be an integer" in e.value.details()

    for http in (False, True):
        target = server.http.removeprefix("http://") if http else server.grpc_target
        with Client(target, http=http) as c:
            res = c.generate(prompt, n=3, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=6)
            assert [s.seed for s in res.samples] == [7, 8, 9]
            assert [s.token_ids for s in res.samples] == [tuple(c.token_ids) for c in g.choices]
            for s in res.samples:
                m = s.memory
                assert m.kv_bytes_own + m.kv_bytes_shared == m.kv_bytes_reserved and m.kv_bytes_shared > 0
            chunks = list(c.stream(prompt, n=3, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=6))
            results = {ch.index: ch.result for ch in chunks if ch.result is not None}
            assert sorted(results) == [0, 1, 2] and chunks[-1].result is not None
            assert [results[i].token_ids for i in range(3)] == [s.token_ids for s in res.samples]
            assert [results[i].seed for i in range(3)] == [7, 8, 9]
            assert all(results[i].usage.completion_tokens == 6 for i in range(3))
    bad = httpx_post(server.http + "/v1/completions", {"prompt": "x", "n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    server.assert_idle()


def httpx_post(url: str, body: dict):
    import httpx

    return httpx.post(url, json=body, timeout=60)


@pytest.mark.e2e
def test_the_plan_counts_a_requests_shared_blocks_once_and_predicts_what_is_admitted(tiny_model_dir, cache_dir):
    """The blocks a request of n samples reserves (kv_pool.group_blocks: the plan counts with it) are what the
    pool's group reservation takes; a Plan of 5 requests of n = 4 samples (200-token prompt, 40 new: 15 blocks a
    sample, 12 of them shared, 24 a request) on a 100-block pool says 4 admitted and 1 queued, and the engine then
    runs exactly 16 samples with one request waiting."""
    from server.capacity import Shape
    from server.kv_pool import BlockPool, KVLayout, group_blocks

    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=BS)
    for (p_len, new, n), want in zip(((200, 40, 4), (32, 1, 3), (33, 15, 2), (1, 5, 7), (1024, 128, 8)),
                                     (15 + 3 * 3, 3 + 2 * 2, 3 + 1, 1 + 6 * 1, 72 + 7 * 9)):
        pool = BlockPool(layout, 200 * layout.bytes_per_block, allocate=False)
        assert pool.try_reserve_group([f"r/{i}" for i in range(n)], p_len + new, ids(p_len, 1)) is not None
        assert group_blocks(p_len, p_len + new, n, BS, 0) == pool.used_blocks == want
    probe = make(tiny_model_dir, cache_dir)
    bpb = probe.layout.bytes_per_block
    probe.close()
    eng = make(tiny_model_dir, cache_dir, budget=str(100 * bpb), kv_admission="reserve")
    try:
        plan = eng.plan([Shape(200, 40, 5, 4)], lambda n, m: None).result(30)
        s = plan.shapes[0]
        assert (s.kv_blocks, s.kv_blocks_shared, s.kv_bytes_reserved) == (24, 12, 15 * bpb)
        assert (s.fit_now, s.admitted, s.queued, s.refused) == (4, 4, 1, 0)
        assert plan.outcomes == ("admitted",) * 4 + ("queued",)
        bad = eng.plan([Shape(200, 40, 1, 65)], lambda n, m: None).result(30).shapes[0]  # over --max-batch
        assert bad.refused == 1 and bad.refusal.param == "n"
        assert "n must be an integer in [1, 64]" in bad.refusal.message
        started: set = set()  # (request, sample) that have a token
        handles = [eng.submit(ids(200, 70 + i), greedy_exact(40), lambda ev: ev.token_ids and started.add(
            (ev.request_id, ev.index)), n=4) for i in range(5)]
        wait_until(lambda: len(started) >= 16)
        assert len(started) == 16
        t = eng.totals()
        assert (t.running, t.queued, t.kv_used_bytes) == (16, 1, 96 * bpb)
        for h in handles:
            h.cancel()
        wait_until(lambda: eng.pool.used_blocks == 0 and not eng.scheduler.has_work)
        assert_books(eng)
    finally:
        eng.close()


@pytest.mark.e2e
def test_the_sweep_sends_a_cells_seeds_as_n_and_gets_the_rows_of_a_request_per_seed(server):
    """quant-client sweep: a cell's seeds as the samples of one request (a greedy cell as one sample standing for
    each seed) give, in float32, the rows of a request per seed (the same tokens; logprobs computed in other
    batches, equal within 1e-6)."""
    from quantserve.client import Client
    from quantserve.client.sweep import SweepSpec, run_sweep

    spec = SweepSpec(prompt="The old mill by the river", temperatures=(0.0, 0.9), top_ks=(0, 40), top_ps=(0.9,),
                     seeds=3, max_new_tokens=6, concurrency=3)
    seen = []
    with Client(server.grpc_target) as c:
        by_n = run_sweep(c, spec, progress=lambda done, total: seen.append((done, total)))
        per_seed = run_sweep(c, spec, per_request=1)
    for a, b in zip(by_n, per_seed, strict=True):  # logprobs of the same tokens in other batches: within 1e-6
        assert a.as_dict() == pytest.approx(b.as_dict(), rel=1e-6, abs=1e-6)
    assert seen[-1] == (12, 12)
    server.assert_idle()


@pytest.mark.reference
@pytest.mark.slow
def test_the_default_model_in_float32_gives_the_uncached_tokens_and_logprobs(cache_dir):
    """The real model: prompts sharing a 200-token stem (a system prompt and a question), one after another, with
    the cache and without, greedy and seeded: the same tokens, logprobs within 1e-5. The built-in kernel rules:
    with measured plans the uncached run's long prefill and the cached run's short one may also take different
    kernels for the same tokens' projections (a plan picks per row count from timings), which sum the same products
    in another order (1.2e-5 and 1.4e-5 apart in a top logprob on an AVX2 EPYC, the cache aside)."""
    on = Engine.from_path(None, EngineConfig(memory_budget="64MiB", dtype="float32", max_prefill_tokens=256,
                                             kernels="static"), cache_dir)
    try:
        system = ("You are a helpful assistant who knows the history of rivers, mills and market towns, and who "
                  "answers in short plain sentences. ") * 10
        stem = on.tokenize(system)[:200]
        assert len(stem) == 200
        prompts = [stem + on.tokenize(q) for q in (" Where do rivers begin?", " Why were mills built by water?",
                                                   " What is a market town?")]
        runs = {}
        for cache in (False, True):  # the same engine, its pool mapping nothing, then with its cache
            on.pool.prefix_cache = cache
            runs[cache] = [on.complete(p, params) for params in (greedy_exact(8, logprobs=2), sampled(8, 5))
                           for p in prompts]
        for i, (got, want) in enumerate(zip(runs[True], runs[False], strict=True)):
            assert want.accounting.prompt_tokens_cached == 0
            assert got.accounting.prompt_tokens_cached == (192 if i else 0)  # 12 blocks of the stem, once written
            assert_same(got, want)
        assert_books(on)
    finally:
        on.close()
