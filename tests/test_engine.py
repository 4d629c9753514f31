"""The engine: runner equivalence with transformers' forward, continuous batching, seeded replay, stops, EOS,
accounting, admission, cancellation and faults. After every test the KV pool is back to zero blocks in use."""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading
import time

import pytest
import torch
from conftest import wait_until
from helpers import greedy, hf_causal_lm, hf_logits
from transformers import AutoTokenizer

from quant.runtime.measure import MemoryTracker, weight_report
from quant.shape.memory import engine_prefill_bytes
from quant.shape.model import ModelShape
from server import fastops
from server.config import EngineConfig
from server.engine import Engine
from server.kv_pool import BlockPool, KVLayout
from server.outputs import EngineClosedError, OverloadedError, RequestError, collect
from server.runner import ModelRunner, build_step
from server.sampling_params import SamplingParams, SamplingParamsError

CPU = torch.device("cpu")


def assert_idle(engine: Engine) -> None:
    assert wait_until(lambda: engine.pool.used_blocks == 0 and not engine.scheduler.has_work), engine.pool.stats()
    assert engine.pool.stats()["requests"] == 0
    assert engine._queued == 0
    engine.pool.audit()  # with the prefix cache on (the default): every reference given back, nothing mapped freed


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return hf_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_engine(tiny_model_dir, cache_dir, **kw) -> Engine:
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=64)
    cfg.update(kw)
    return Engine.from_path(str(tiny_model_dir), EngineConfig(**cfg), cache_dir)


@pytest.fixture(scope="module", params=["serial", "overlap"])
def engine(request, tiny_model_dir, cache_dir):
    """Every engine test runs with serial steps (the CPU default) and with overlapped ones (CUDA's: a step launched
    before the previous one's samples are read), which must behave the same in every respect."""
    eng = make_engine(tiny_model_dir, cache_dir, overlap=request.param == "overlap")
    assert eng.overlap == (request.param == "overlap")
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _pool_back_to_zero(request):
    yield
    if "engine" in request.fixturenames:
        assert_idle(request.getfixturevalue("engine"))


# ------------------------------------------------------------------------------------------------ runner


@pytest.mark.reference
@pytest.mark.parametrize("fused_ops", [True, False])
def test_runner_matches_hf_forward_with_chunks_fragmented_blocks_and_mixed_steps(hf_model, fused_ops):
    model = hf_model
    lay = KVLayout.from_config(model.config, torch.float32, block_size=4)
    pool = BlockPool(lay, lay.bytes_per_block * 64)
    runner = ModelRunner(model, pool.storage, 4, "sdpa", fused_ops=fused_ops)
    assert runner.ops.fused == (fused_ops and fastops.load())
    # Fragment the pool so block tables are not contiguous.
    pool.try_reserve("x", 12)
    pool.try_reserve("y", 12)
    pool.release("x")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 1000, (19,), generator=g).tolist()
    b = torch.randint(0, 1000, (6,), generator=g).tolist()
    c = torch.randint(0, 1000, (9,), generator=g).tolist()
    ta, tb, tc = (pool.try_reserve(n, 40) for n in "abc")
    # step 1: a's first chunk, b whole; step 2: a's last chunk + b decoding; step 3: a, b decoding + c prefill
    l1 = runner.forward(build_step([], [(a[:8], 0, ta, False), (b, 0, tb, True)], 4, CPU))
    assert l1.shape[0] == 1
    torch.testing.assert_close(l1[0], hf_logits(model, b)[-1], atol=1e-4, rtol=1e-4)
    nb = 11
    l2 = runner.forward(build_step([(nb, 6, tb)], [(a[8:], 8, ta, True)], 4, CPU))
    torch.testing.assert_close(l2[0], hf_logits(model, b + [nb])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l2[1], hf_logits(model, a)[-1], atol=1e-4, rtol=1e-4)
    na, nb2 = 5, 7
    l3 = runner.forward(build_step([(na, 19, ta), (nb2, 7, tb)], [(c, 0, tc, True)], 4, CPU))
    torch.testing.assert_close(l3[0], hf_logits(model, a + [na])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l3[1], hf_logits(model, b + [nb, nb2])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l3[2], hf_logits(model, c)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.reference
@pytest.mark.parametrize("fused", [False, True])
def test_runner_single_row_decode_paths(hf_model, fused):
    """A lone decode row: eager ops attend to a view of the cache (no gather); the fused ops read the block
    table in C++. Both give transformers' logits."""
    if fused and not fastops.load():
        pytest.skip(f"fused ops not built: {fastops.unavailable_reason()}")
    lay = KVLayout.from_config(hf_model.config, torch.float32, block_size=4)
    pool = BlockPool(lay, lay.bytes_per_block * 16)
    runner = ModelRunner(hf_model, pool.storage, 4, "sdpa", fused_ops=fused)
    t = pool.try_reserve("a", 30)
    assert t == list(range(t[0], t[0] + len(t)))  # a fresh pool hands out consecutive blocks
    ids = list(range(40, 53))
    runner.forward(build_step([], [(ids, 0, t, True)], 4, CPU))
    step = build_step([(99, 13, t)], [], 4, CPU)
    meta = runner.backend.prepare(step)
    if fused:
        assert meta.decode_tables is not None and not meta.decode_range and meta.decode_slots is None
    else:
        assert meta.decode_range and meta.decode_slots is None  # a view of the cache, no gather
    torch.testing.assert_close(runner.forward(step)[0], hf_logits(hf_model, ids + [99])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.reference
def test_fused_and_reference_ops_agree_in_bf16(tiny_model_dir):
    """The fused glue ops against the eager ones on a whole bf16 forward (prefill, then decode steps)."""
    model = hf_causal_lm(tiny_model_dir, torch.bfloat16)
    lay = KVLayout.from_config(model.config, torch.bfloat16, block_size=16)
    outs = []
    for fused in (True, False):
        pool = BlockPool(lay, lay.bytes_per_block * 8)
        runner = ModelRunner(model, pool.storage, 16, "sdpa", fused_ops=fused)
        t = pool.try_reserve("a", 64)
        ids = list(range(500, 530))
        logits = [runner.forward(build_step([], [(ids, 0, t, True)], 16, CPU))[0]]
        for p in range(30, 36):
            logits.append(runner.forward(build_step([(int(logits[-1].argmax()), p, t)], [], 16, CPU))[0])
        outs.append(torch.stack(logits))  # (7, V)
    fused, ref = outs
    assert torch.equal(fused.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(fused, ref, atol=0.02 * ref.abs().max().item(), rtol=0)


@pytest.mark.reference
@pytest.mark.parametrize("scheme,dtype", [("int8-sym", torch.float32), ("w4a16", torch.bfloat16)])
def test_runner_on_quantized_artifacts_matches_their_own_forward(tmp_path, tiny_model_dir, text_file, scheme, dtype):
    from conftest import run_cli

    from quant.runtime.loader import load

    out = tmp_path / scheme
    assert run_cli("build", "--model", tiny_model_dir, "--scheme", scheme, "--calib", text_file, "--calib-samples",
                   "4", "--calib-seqlen", "64", "--no-progress", "--out", out) == 0
    model = load(out, dtype=dtype).model
    ids = list(range(300, 340))
    ref = hf_logits(model, ids)  # before the runner fuses projections
    lay = KVLayout.from_config(model.config, dtype, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 8)
    runner = ModelRunner(model, pool.storage, 16, "sdpa")
    assert runner.fused_groups == 2 * len(runner.layers)  # both schemes fuse q/k/v and gate/up
    # The accounting counts each held weight byte once: the model's tensors (int8 parts are views of their fused
    # projection) plus the fused int4 projections (whose parts then hold nothing).
    derived = {id(b) for mod in model.modules() for n, b in mod.named_buffers(recurse=False)
               if n in mod._non_persistent_buffers_set}  # rotary inv_freq: computed from the config, not weights
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in runner.held_tensors()
                if id(t) not in derived}
    assert weight_report(model)["total"] + runner.runtime_weight_bytes() == sum(storages.values())
    assert (runner.runtime_weight_bytes() > 0) == (scheme == "w4a16")
    t = pool.try_reserve("a", 60)
    # The first step allocates nothing but activations (kernel tables were built with the runner).
    peak = measured_step_peak(runner, build_step([], [(ids[:24], 0, t, False)], 16, CPU), pool)
    est = engine_prefill_bytes(ModelShape.from_config(model.config), 24, dtype.itemsize,
                               "fused" if runner.ops.fused else "eager", sampled=0,
                               transients=runner.projection_transients(24))
    assert 0.85 <= est / peak <= 1.15, (est, peak)
    got = runner.forward(build_step([], [(ids[24:], 24, t, True)], 16, CPU))[0]
    tol = 1e-4 if dtype == torch.float32 else 0.05 * ref[-1].abs().max().item()
    torch.testing.assert_close(got, ref[-1], atol=tol, rtol=0)


def measured_step_peak(runner, step, pool) -> int:
    """Live tensor bytes at the peak of one runner step, not counting the KV pool (it existed before)."""
    with MemoryTracker().exclude(pool.storage) as mt:
        runner.forward(step)
    return mt.peak


@pytest.mark.e2e
@pytest.mark.parametrize("fused_ops", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_within_15_percent_of_the_runner_peak(tiny_model_dir, fused_ops, dtype):
    model = hf_causal_lm(tiny_model_dir, dtype)
    lay = KVLayout.from_config(model.config, dtype, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 64)
    runner = ModelRunner(model, pool.storage, 16, "sdpa", fused_ops=fused_ops)
    glue = "fused" if runner.ops.fused else "eager"
    shape = ModelShape.from_config(model.config)
    g = torch.Generator().manual_seed(0)
    for chunk, past in ((1, 0), (16, 0), (128, 0), (300, 0), (64, 64), (200, 300)):
        t = pool.try_reserve("m", past + chunk)
        ids = torch.randint(0, 1000, (past + chunk,), generator=g).tolist()
        if past:
            runner.forward(build_step([], [(ids[:past], 0, t, False)], 16, CPU))
        got = measured_step_peak(runner, build_step([], [(ids[past:], past, t, True)], 16, CPU), pool)
        est = engine_prefill_bytes(shape, chunk, torch.empty((), dtype=dtype).element_size(), glue, past=past)
        assert 0.85 <= est / got <= 1.15, (chunk, past, est, got)
        pool.release("m")


@pytest.mark.e2e
def test_activation_estimate_counts_dequantization_above_the_kernel_rows(tmp_path, tiny_model_dir, text_file):
    """int8 weight-only layers dequantize above 64 rows; the estimate carries that transient."""
    from conftest import run_cli

    from quant.runtime.loader import load

    out = tmp_path / "int8"
    assert run_cli("build", "--model", tiny_model_dir, "--scheme", "int8-sym", "--calib", text_file,
                   "--calib-samples", "2", "--calib-seqlen", "32", "--no-progress", "--out", out) == 0
    model = load(out, dtype=torch.bfloat16).model
    lay = KVLayout.from_config(model.config, torch.bfloat16, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 32)
    runner = ModelRunner(model, pool.storage, 16, "sdpa")
    shape = ModelShape.from_config(model.config)
    assert runner.projection_transients(64) == {"qkv": 0, "o": 0, "gate_up": 0, "down": 0}  # the kernel runs
    assert runner.projection_transients(200)["gate_up"] > 0
    for chunk in (16, 200):
        t = pool.try_reserve("m", chunk)
        ids = list(range(100, 100 + chunk))
        got = measured_step_peak(runner, build_step([], [(ids, 0, t, True)], 16, CPU), pool)
        est = engine_prefill_bytes(shape, chunk, 2, "fused" if runner.ops.fused else "eager",
                                   transients=runner.projection_transients(chunk))
        assert 0.85 <= est / got <= 1.15, (chunk, est, got)
        pool.release("m")


# ------------------------------------------------------------------------------------------------ engine


def hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.reference
def test_greedy_equals_hf_generate_while_batched(engine, hf_model, tok):
    prompts = ["The castle stood on the hill", "In 1887 the railway", "Lobsters are"]
    results = [None] * len(prompts)

    def run(i):
        results[i] = engine.complete(prompts[i], greedy(24, min_tokens=24))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, r in zip(prompts, results):
        assert list(r.token_ids) == hf_greedy(hf_model, tok, p, 24)
        assert r.finish_reason == "length"
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)


@pytest.mark.e2e
def test_chunked_prefill_gives_the_same_tokens(engine, tiny_model_dir, cache_dir, tok):
    prompt = " ".join(["the river runs past the mill and"] * 30)
    assert len(tok(prompt).input_ids) > 150
    small = make_engine(tiny_model_dir, cache_dir, max_prefill_tokens=7)
    try:
        a = small.complete(prompt, greedy(16, min_tokens=16))
    finally:
        small.close()
    b = engine.complete(prompt, greedy(16, min_tokens=16))
    assert a.token_ids == b.token_ids


@pytest.mark.e2e
def test_seeded_replay_is_exact_alone_or_batched(engine):
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234, max_new_tokens=20, min_tokens=20)
    alone = engine.complete("A seeded request", p)
    others = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=30) for s in range(5)]
    results = {}

    def run(key, prompt, params):
        results[key] = engine.complete(prompt, params)

    threads = [threading.Thread(target=run, args=(i, f"other prompt {i}", q)) for i, q in enumerate(others)]
    threads.append(threading.Thread(target=run, args=("me", "A seeded request", p)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["me"].token_ids == alone.token_ids
    assert results["me"].seed == 1234
    # No seed: the engine picks one, reports it, and it replays.
    free = engine.complete("A seeded request", SamplingParams(temperature=1.0, max_new_tokens=12, min_tokens=12))
    assert 0 <= free.seed < 2**63
    again = engine.complete("A seeded request", SamplingParams(temperature=1.0, max_new_tokens=12, min_tokens=12,
                                                               seed=free.seed))
    assert again.token_ids == free.token_ids


@pytest.mark.e2e
def test_stop_string_cuts_text_before_it(engine):
    base = engine.complete("Once upon a time", greedy(40, min_tokens=40))
    text = base.text
    stop = text[12:16]
    assert stop and stop in text
    r = engine.complete("Once upon a time", greedy(40, stop=(stop,)))
    assert r.finish_reason == "stop" and r.stop == stop
    assert r.text == text[: text.find(stop)]
    assert len(r.token_ids) < 40


@pytest.mark.e2e
@pytest.mark.parametrize("overlap", [False, True])
def test_eos_ignore_eos_and_min_tokens(tiny_model_dir, tok, hf_model, overlap):
    g = hf_greedy(hf_model, tok, "The old bridge", 12)
    j = next(i for i in range(2, 12) if g[i] not in g[:i])
    model = hf_causal_lm(tiny_model_dir)
    model.generation_config.eos_token_id = [g[j]]
    eng = Engine(model, tok, EngineConfig(memory_budget="1MiB", dtype="float32", overlap=overlap)).start()
    try:
        r = eng.complete("The old bridge", greedy(12))
        assert list(r.token_ids) == g[: j + 1]
        assert (r.finish_reason, r.stop) == ("stop", "<eos>")
        assert r.text == tok.decode(g[:j], skip_special_tokens=True)
        r = eng.complete("The old bridge", greedy(12, ignore_eos=True))
        assert list(r.token_ids) == g and r.finish_reason == "length"
        r = eng.complete("The old bridge", greedy(12, min_tokens=j + 2))
        assert g[j] not in r.token_ids[: j + 2] and len(r.token_ids) >= j + 2
        assert list(r.token_ids[:j]) == g[:j]
        assert_idle(eng)
    finally:
        eng.close()


def _split_event(ev) -> tuple[tuple, list[float]]:
    """(what must be equal, the floats that are equal up to rounding): a step's logits depend, in their last bits,
    on which rows share the step, and overlapped steps batch requests at other moments than serial ones."""
    floats = [x for lp in ev.logprobs for x in (lp.logprob, *(v for _, v in lp.top))]
    floats += [x for st in ev.trace for stage in (st.temperature, st.top_k, st.top_p) for _, x in stage]
    floats += [x for st in ev.trace for x in (st.mass_top_k, st.mass_top_p, st.entropy)]
    exact = (ev.text, ev.token_ids, tuple(lp.token_id for lp in ev.logprobs),
             tuple((st.kept_top_k, st.kept_top_p) for st in ev.trace), ev.finished, ev.finish_reason, ev.stop,
             None if ev.accounting is None else (ev.accounting.generated_tokens, ev.accounting.kv_bytes_used))
    return exact, floats


@pytest.mark.e2e
def test_overlapped_steps_give_every_event_the_serial_ones_do(tiny_model_dir, cache_dir, monkeypatch):
    """Concurrent requests of every kind (greedy, seeded sampling, a repetition penalty, a stop string, logprobs and
    a trace, EOS suppressed by min_tokens, different lengths, joining while others decode) through an engine with
    overlapped steps and one with serial steps: the same events, token by token, text and accounting included."""
    kinds = [
        ("The old bridge", greedy(30)),
        ("A seeded one", SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_new_tokens=25)),
        ("With a penalty", SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3, max_new_tokens=20)),
        ("Once upon a time", greedy(40, stop=("e",))),
        ("Logprobs please", SamplingParams(temperature=1.0, seed=5, max_new_tokens=9, logprobs=3, trace=4)),
        ("Short", greedy(1)),
        ("At least", greedy(14, min_tokens=14)),
        ("A long prompt " * 12, greedy(17)),
    ]
    import server.step as step_module

    fed = {False: 0, True: 0}
    real_build = step_module.build_step

    def counting_build(*a, **kw):
        # decode rows fed from the previous step's samples on the device (the start-up cost probe feeds none)
        fed[overlap] += len(a) > 4 and a[4] is not None
        return real_build(*a, **kw)

    monkeypatch.setattr(step_module, "build_step", counting_build)
    got = {}
    for overlap in (False, True):
        eng = make_engine(tiny_model_dir, cache_dir, overlap=overlap, max_prefill_tokens=16)
        try:
            results: dict = {}

            def run(i, prompt, params, delay):
                time.sleep(delay)
                results[i] = [_split_event(ev) for ev in eng.stream(prompt, params, request_id=f"r{i}")[1]]

            threads = [threading.Thread(target=run, args=(i, pr, pa, 0.02 * (i % 3))) for i, (pr, pa) in
                       enumerate(kinds)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert_idle(eng)
            got[overlap] = results
        finally:
            eng.close()
    for i in got[False]:
        serial, overlapped = got[False][i], got[True][i]
        assert [e for e, _ in serial] == [e for e, _ in overlapped], i
        for (_, a), (_, b) in zip(serial, overlapped):
            assert len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a, b)), i
    assert got[False][3][-1][0][5] == "stop" and got[False][0][-1][0][5] == "length"
    assert any(f for _, f in got[False][4])  # the logprobs and trace were compared
    assert fed[False] == 0 and fed[True] > 20  # the overlapped engine did feed tokens on the device


@pytest.mark.reference
def test_logprobs_and_trace(engine, hf_model, tok):
    p = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=7, max_new_tokens=6, min_tokens=6,
                       logprobs=3, trace=5)
    r = engine.complete("The harbour", p)
    assert len(r.logprobs) == len(r.trace) == len(r.token_ids) == 6
    first = torch.log_softmax(hf_logits(hf_model, tok("The harbour").input_ids)[-1], -1)
    assert r.logprobs[0].logprob == pytest.approx(first[r.token_ids[0]].item(), abs=1e-4)
    for lp, tr, t in zip(r.logprobs, r.trace, r.token_ids):
        assert lp.token_id == t and len(lp.top) == 3
        assert [x[1] for x in lp.top] == sorted([x[1] for x in lp.top], reverse=True)
        assert lp.logprob <= lp.top[0][1] + 1e-6
        assert sum(pr > 0 for _, pr in tr.top_k) <= 4
        kept = [i for i, pr in tr.top_p if pr > 0]
        assert t in kept  # the drawn token survived every stage
        assert sum(pr for _, pr in tr.top_p) == pytest.approx(1.0, abs=1e-5)
        assert tr.kept_top_k == 4 and 1 <= tr.kept_top_p <= 4 == sum(pr > 0 for _, pr in tr.top_k)
        assert tr.kept_top_p == len(kept) and 0 < tr.mass_top_p <= tr.mass_top_k <= 1
        assert tr.mass_top_k == pytest.approx(sum(pr for _, pr in tr.temperature[:4]), rel=1e-5)
        assert 0 <= tr.entropy <= math.log(tr.kept_top_p) + 1e-6


@pytest.mark.e2e
def test_logprobs_zero_gives_the_chosen_token_alone(engine):
    # Found by the fuzz: with no row asking for alternatives the batch had no logprobs at all.
    r = engine.complete("The harbour", SamplingParams(temperature=0.8, seed=3, max_new_tokens=4, min_tokens=4,
                                                      logprobs=0))
    assert [lp.token_id for lp in r.logprobs] == list(r.token_ids) and all(lp.top == () for lp in r.logprobs)
    assert all(lp.logprob <= 0 for lp in r.logprobs)


# --------------------------------------------------------------------------------------- prompt logprobs


def _teacher_forced(hf_model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf_model, ids), -1)  # (T, V) fp32: row i predicts token i + 1


@pytest.mark.reference
def test_prompt_logprobs_are_the_teacher_forced_log_softmax_across_chunks(engine, hf_model):
    """150 prompt tokens prefilled in chunks of 64: every prompt token after the first gets the model's fp32
    log-softmax at the position before it (within 1e-4) and its 3 most probable alternatives, computed in the
    prefill; the generated tokens are what they are without scoring."""
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 1000, (150,), generator=g).tolist()
    want = _teacher_forced(hf_model, ids)  # (150, V)
    r = engine.complete(ids, greedy(4, prompt_logprobs=3))
    assert len(r.prompt_logprobs) == 149 and [lp.token_id for lp in r.prompt_logprobs] == ids[1:]
    got = torch.tensor([lp.logprob for lp in r.prompt_logprobs])
    torch.testing.assert_close(got, want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    top = want[:-1].topk(3)
    for i, lp in enumerate(r.prompt_logprobs):
        assert [t for t, _ in lp.top] == top.indices[i].tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values[i].tolist(), abs=1e-4)
    assert r.token_ids == engine.complete(ids, greedy(4)).token_ids
    assert r.accounting.prompt_tokens_cached == 0  # scored prompts are computed whole, never mapped from the cache


def _together(engine, requests: dict) -> dict:
    """Submit ``requests`` (id -> (prompt, params)) at once, so they share steps; their completions by id."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    for rid, (prompt, params) in requests.items():
        engine.submit(prompt, params, q.put, rid)
    events: dict[str, list] = {rid: [] for rid in requests}
    while sum(ev.finished for evs in events.values() for ev in evs) < len(requests):
        ev = q.get()
        events[ev.request_id].append(ev)
    return {rid: collect(evs) for rid, evs in events.items()}


@pytest.mark.reference
def test_prompt_logprobs_with_no_generation_and_beside_other_requests(engine, hf_model):
    """max_new_tokens 0 scores the prompt and ends ("length", no tokens, its blocks given back); scoring rows in a
    batch do not change the other requests' tokens; a request's samples each get the prompt's logprobs."""
    ids = list(range(5, 45))
    want = _teacher_forced(hf_model, ids)
    plain = [engine.complete("The harbour", SamplingParams(temperature=0.9, seed=s, max_new_tokens=5))
             for s in (1, 2)]
    done = _together(engine, {"score": (ids, SamplingParams(max_new_tokens=0, prompt_logprobs=0)),
                              **{f"p{s}": ("The harbour", SamplingParams(temperature=0.9, seed=s, max_new_tokens=5))
                                 for s in (1, 2)}})
    scored = done["score"]
    assert scored.finish_reason == "length" and scored.token_ids == () and scored.text == ""
    assert [lp.top for lp in scored.prompt_logprobs] == [()] * 39  # prompt_logprobs 0: the chosen token's alone
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in scored.prompt_logprobs]),
                               want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    assert [done[f"p{s}"].token_ids for s in (1, 2)] == [c.token_ids for c in plain]
    a, b = engine.samples(ids, SamplingParams(temperature=1.0, seed=4, max_new_tokens=3, prompt_logprobs=1), 2)
    assert a.prompt_logprobs == b.prompt_logprobs and all(len(lp.top) == 1 for lp in a.prompt_logprobs)
    assert [lp.logprob for lp in a.prompt_logprobs] == pytest.approx([lp.logprob for lp in scored.prompt_logprobs],
                                                                      abs=1e-5)


@pytest.mark.e2e
def test_response_format_rows_wait_for_their_last_token_and_stay_in_the_grammar(engine):
    """A constrained request beside free ones, with serial and with overlapped steps (where a constrained row is
    never decoded from a sample still on the device): every token is one its grammar accepts (a refused one would
    fail the request), and the free requests get their own tokens."""
    pytest.importorskip("xgrammar")
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "k": {"type": "string", "enum": ["a", "bb"]}}, "required": ["k"]}}}
    free = [engine.complete("The harbour", SamplingParams(temperature=0.9, seed=s, max_new_tokens=6)) for s in (1, 2)]
    done = _together(engine, {
        "json": ("The harbour", SamplingParams(temperature=1.0, seed=5, max_new_tokens=40, response_format=fmt)),
        **{f"f{s}": ("The harbour", SamplingParams(temperature=0.9, seed=s, max_new_tokens=6)) for s in (1, 2)}})
    c = done["json"]
    assert c.finish_reason in ("stop", "length") and c.error is None, c
    if c.finish_reason == "stop":  # the grammar completed: its document parses
        assert json.loads(c.text)["k"] in ("a", "bb")
    assert [done[f"f{s}"].token_ids for s in (1, 2)] == [x.token_ids for x in free]
    with pytest.raises(SamplingParamsError) as e:
        engine.submit("x", SamplingParams(response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "nonsense"}}}), lambda ev: None)
    assert e.value.param == "response_format"


@pytest.mark.unit
def test_prompt_logprobs_bad_values_are_refused_naming_them():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(SamplingParamsError, match=r"0 only with prompt_logprobs") as e:
        SamplingParams(max_new_tokens=0)
    assert e.value.param == "max_new_tokens"
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=5).max_new_tokens == 0


@pytest.mark.e2e
def test_accounting_matches_the_formula(engine, tok):
    prompt = "Memory accounting for one request"
    n = len(tok(prompt).input_ids)
    r = engine.complete(prompt, greedy(10, min_tokens=10))
    a = r.accounting
    cfg = engine.model.config
    bpt = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert a.kv_bytes_per_token == bpt
    assert (a.prompt_tokens, a.generated_tokens) == (n, 10)
    assert a.kv_blocks_reserved == math.ceil((n + 10) / 16)
    assert a.kv_bytes_reserved == a.kv_blocks_reserved * 16 * bpt
    assert a.kv_bytes_used == (n + 10 - 1) * bpt  # the last token's K/V is never written
    shape = ModelShape.from_config(cfg)
    glue = "fused" if engine.runner.ops.fused else "eager"
    assert a.activation_peak_bytes == engine_prefill_bytes(shape, n, 4, glue)
    assert a.attention == "sdpa"
    # fp32 dense weights: the fused projections are the parts' own storage, so nothing is added at runtime
    assert engine.runner.runtime_weight_bytes() == 0
    assert a.engine.weight_bytes == weight_report(engine.model)["total"]
    assert a.engine.kv_capacity_bytes == engine.pool.capacity_bytes
    assert a.engine.kv_used_bytes == 0 and a.engine.running == 0  # measured after the request left
    assert r.ttft_s is not None and 0 < r.ttft_s <= r.duration_s


# ------------------------------------------------------------------------------------------------ admission


@pytest.mark.e2e
def test_invalid_requests_are_rejected_before_any_work(engine):
    ctx = engine.context_length
    with pytest.raises(RequestError, match="prompt is empty") as e:
        engine.submit("", greedy(4), print)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match=f"prompt has {ctx + 5} tokens; the model's context is {ctx}"):
        engine.submit([1] * (ctx + 5), greedy(4), print)
    with pytest.raises(RequestError, match=rf"\(10 tokens\) \+ max_new_tokens \({ctx}\)") as e:
        engine.submit([1] * 10, greedy(ctx), print)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(RequestError, match="token ids must be integers"):
        engine.submit([1, -3], greedy(4), print)
    with pytest.raises(RequestError, match="token ids must be integers"):
        engine.submit([1, engine.vocab_size], greedy(4), print)
    with pytest.raises(RequestError, match="string or a list"):
        engine.submit(42, greedy(4), print)
    with pytest.raises(TypeError):
        engine.submit("hi", {"temperature": 0}, print)
    assert engine._queued == 0 and engine.pool.used_blocks == 0


@pytest.mark.e2e
def test_request_larger_than_the_pool_is_rejected_with_both_numbers(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir, memory_budget=str(8 * 16 * 512))  # 8 blocks = 128 tokens
    try:
        assert eng.pool.num_blocks == 8
        with pytest.raises(RequestError, match=r"needs 19 KV blocks = 155648 bytes; the whole KV pool is 8 blocks "
                                               r"= 65536 bytes") as e:
            eng.submit([5] * 100, greedy(200), print)
        assert e.value.param == "max_new_tokens"
        assert eng.complete([5] * 100, greedy(28)).finish_reason in ("length", "stop")  # exactly 8 blocks fits
        assert_idle(eng)
    finally:
        eng.close()


@pytest.mark.e2e
def test_bounded_queue_overload_and_no_overflow(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir, memory_budget=str(8 * 16 * 512), max_queue=2, max_batch=4)
    seen_used = []
    try:
        events = []
        gate = threading.Event()

        def sink_for(name):
            def sink(ev):
                if ev.accounting:
                    seen_used.append(ev.accounting.engine.kv_used_bytes)
                events.append((name, ev))
                if name == "a":
                    gate.wait(10)  # hold the engine thread inside A's first event: B and C must queue
            return sink

        eng.submit([5] * 20, greedy(80, min_tokens=80), sink_for("a"))  # 100 tokens: 7 of the 8 blocks
        assert wait_until(lambda: len(eng.scheduler.running) == 1)
        eng.submit([6] * 20, greedy(80), sink_for("b"))
        eng.submit([7] * 20, greedy(80), sink_for("c"))
        with pytest.raises(OverloadedError, match="--max-queue 2"):
            eng.submit([8] * 20, greedy(8), sink_for("d"))
        gate.set()
        assert wait_until(lambda: sum(ev.finished for _, ev in events) == 3)
        finals = {n: ev for n, ev in events if ev.finished}
        assert set(finals) == {"a", "b", "c"}
        assert all(ev.finish_reason in ("length", "stop") for ev in finals.values())
        assert max(seen_used) <= eng.pool.capacity_bytes
        assert_idle(eng)
    finally:
        gate.set()
        eng.close()


# ------------------------------------------------------------------------------------------------ cancellation


@pytest.mark.e2e
def test_cancel_while_waiting_for_blocks(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir, memory_budget=str(8 * 16 * 512), kv_admission="reserve")
    try:
        ha, ea = eng.stream([5] * 20, greedy(100, min_tokens=100))
        hb, eb = eng.stream([6] * 20, greedy(80))
        assert wait_until(lambda: len(eng.scheduler.waiting) == 1)
        hb.cancel()
        fb = [ev for ev in eb][-1]
        assert fb.finish_reason == "cancelled" and fb.accounting.generated_tokens == 0
        assert fb.accounting.kv_bytes_reserved == 0
        ha.cancel()
        assert [ev for ev in ea][-1].finish_reason == "cancelled"
        assert_idle(eng)
    finally:
        eng.close()


@pytest.mark.e2e
def test_cancel_during_prefill(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir, max_prefill_tokens=1)
    try:
        h, evs = eng.stream([9] * 400, greedy(8))
        assert wait_until(lambda: any(0 < s.prefilled < 400 for s in list(eng.scheduler.running)))
        h.cancel()
        final = [ev for ev in evs][-1]
        assert final.finish_reason == "cancelled"
        assert final.accounting.generated_tokens == 0 and 0 < final.accounting.kv_bytes_used
        assert_idle(eng)
    finally:
        eng.close()


@pytest.mark.e2e
def test_cancel_during_decode_and_async_early_exit(engine):
    h, evs = engine.stream("Cancel me", greedy(200, min_tokens=200))
    got = []
    for ev in evs:
        got.append(ev)
        if len(got) == 3:
            h.cancel()
    assert got[-1].finish_reason == "cancelled" and 3 <= got[-1].accounting.generated_tokens < 200

    async def early_exit():
        n = 0
        async for _ in engine.generate("Async request", greedy(200, min_tokens=200)):
            n += 1
            if n == 2:
                break
        return n

    assert asyncio.run(early_exit()) == 2


@pytest.mark.e2e
def test_many_cancellations_at_once(engine):
    handles = [engine.stream(f"request {i}", greedy(60 + i)) for i in range(20)]
    for h, _ in handles:
        h.cancel()
    reasons = [[ev for ev in evs][-1].finish_reason for _, evs in handles]
    assert set(reasons) <= {"cancelled", "length", "stop"} and "cancelled" in reasons


# ------------------------------------------------------------------------------------------------ faults


@pytest.mark.e2e
def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(step)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    r = engine.complete("fault", greedy(10, min_tokens=10))
    assert r.finish_reason == "error" and "RuntimeError" in r.error
    assert_idle(engine)
    assert engine.complete("after the fault", greedy(4, min_tokens=4)).finish_reason == "length"


@pytest.mark.e2e
def test_a_request_that_fails_to_advance_fails_alone_and_the_engine_keeps_serving(engine, monkeypatch):
    """An error while a step's samples are applied to one request (detokenizing, stop matching) ends that request
    with an error event; the others in the step and later requests are served."""
    import server.engine

    real = server.engine.next_token
    hit = {"n": 0}

    def flaky(seq, *a):
        if seq.id == "doomed":
            hit["n"] += 1
            if hit["n"] == 3:
                raise RuntimeError("boom")
        return real(seq, *a)

    monkeypatch.setattr(server.engine, "next_token", flaky)
    results = {}

    def run(rid):
        results[rid] = engine.complete(f"prompt of {rid}", greedy(8, min_tokens=8), request_id=rid)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ("doomed", "bystander")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results["doomed"].finish_reason == "error" and "RuntimeError" in results["doomed"].error
    assert results["bystander"].finish_reason == "length" and len(results["bystander"].token_ids) == 8
    assert_idle(engine)
    assert engine.complete("after it", greedy(3, min_tokens=3)).finish_reason == "length"


@pytest.mark.e2e
def test_a_broken_sink_cancels_only_its_request(engine):
    def bad(ev):
        raise RuntimeError("client gone")

    engine.submit("broken", greedy(50, min_tokens=50), bad)
    assert engine.complete("fine", greedy(5, min_tokens=5)).finish_reason == "length"


@pytest.mark.e2e
def test_close_cancels_in_flight_and_refuses_new(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir)
    h, evs = eng.stream("long", greedy(400, min_tokens=400))
    assert wait_until(lambda: len(eng.scheduler.running) == 1)
    eng.close(grace_s=0.0)
    final = [ev for ev in evs][-1]
    assert final.finish_reason == "cancelled"
    assert eng.pool.used_blocks == 0
    with pytest.raises(EngineClosedError):
        eng.submit("late", greedy(4), print)


@pytest.mark.e2e
def test_close_with_grace_lets_short_requests_finish(tiny_model_dir, cache_dir):
    eng = make_engine(tiny_model_dir, cache_dir)
    h, evs = eng.stream("short", greedy(8, min_tokens=8))
    eng.close(grace_s=30.0)
    assert [ev for ev in evs][-1].finish_reason == "length"


@pytest.mark.e2e
def test_duplicate_request_id_is_rejected(engine):
    h, evs = engine.stream("first", greedy(40, min_tokens=40), request_id="same-id")
    with pytest.raises(RequestError, match="request id 'same-id' is already in use") as e:
        engine.submit("second", greedy(4), print, request_id="same-id")
    assert e.value.param == "request_id"
    h.cancel()
    assert [ev for ev in evs][-1].request_id == "same-id"


@pytest.mark.unit
@pytest.mark.parametrize("field,value,message", [
    ("max_queue", 0, "--max-queue must be an integer >= 1"),
    ("max_batch", -1, "--max-batch must be an integer >= 1"),
    ("max_prefill_tokens", 2.5, "--max-prefill-tokens must be an integer >= 1"),
    ("block_size", True, "--block-size must be an integer >= 1"),
    ("dtype", "int8", "--dtype must be bfloat16, float16 or float32"),
    ("threads", 0, "--threads must be an integer >= 1"),
])
def test_invalid_engine_config_is_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value}).validate()


@pytest.mark.e2e
def test_fractional_budget_sizes_the_pool_after_the_runner(tiny_model_dir, tok, monkeypatch):
    """A fraction of free memory is taken after the runner exists, from what is free then, and the backend attends
    over that pool; a fraction that would leave less than one step's activation workspace is refused in one line
    that names the numbers, before the engine serves."""
    from server import accounting
    from server.kv_pool import KVBudgetError

    model = hf_causal_lm(tiny_model_dir)
    monkeypatch.setattr(accounting, "free_memory", lambda device: 64 * 2**20)  # what "free" reads, after the runner
    eng = Engine(model, tok, EngineConfig(memory_budget="0.25", dtype="float32"))
    assert eng.pool.capacity_bytes == (16 * 2**20 // eng.layout.bytes_per_block) * eng.layout.bytes_per_block
    assert eng.runner.backend.kv.untyped_storage().data_ptr() == eng.pool.storage.untyped_storage().data_ptr()
    eng.start()
    try:
        assert len(eng.complete("The old bridge", greedy(5)).token_ids) == 5
    finally:
        eng.close()
    workspace = eng.step_workspace()
    monkeypatch.setattr(accounting, "free_memory", lambda device: workspace * 2)
    with pytest.raises(KVBudgetError, match=r"--memory-budget 0\.9 of .* MiB free leaves .* for the activations of one "
                                            r"step, which need .*; use at most 0\.50"):
        Engine(model, tok, EngineConfig(memory_budget="0.9", dtype="float32"))
