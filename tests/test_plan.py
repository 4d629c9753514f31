"""The capacity preflight (server/capacity.py): the pure plan, the plan against what the engine then does with
the same requests, the Plan call on both transports against the accounting of real responses, invalid plan
inputs, and `quant estimate --requests` against the live server's plan."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import grpc
import httpx
import pytest
import torch
from live_server import start
from quantserve.client import Client, ClientError, RequestShape
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

from server import capacity
from server.capacity import Refusal, Shape
from server.config import EngineConfig, Limits
from server.engine import Engine
from server.kv_pool import KVLayout
from server.loading import load_for_serving
from server.outputs import OverloadedError, RequestError
from server.sampling_params import SamplingParams

# ------------------------------------------------------------------------------------------------ pure


def _state(**kw) -> capacity.EngineState:
    base = dict(num_blocks=10, free_blocks=10, block_size=16, bytes_per_block=100, running=0, max_batch=3,
                max_prefill_tokens=64, waiting=(), queued=0, max_queue=2, admission="reserve")
    return capacity.EngineState(**{**base, **kw})


def _ok(n, m):
    return None


def _est(chunk, past):
    return 1000 * chunk + past


@pytest.mark.unit
def test_fifo_batch_and_queue_limits_in_order():
    # 4 blocks each: two fit the 10 blocks; the third waits for blocks, the fourth behind it, the fifth overloads.
    r = capacity.plan([Shape(40, 24, 5)], _state(), _ok, _est)
    assert r.outcomes == ("admitted", "admitted", "queued", "queued", "refused")
    (p,) = r.shapes
    assert (p.kv_blocks, p.kv_bytes_reserved) == (4, 400)
    assert (p.fit_now, p.fit_now_limited_by, p.fit_empty, p.fit_empty_limited_by) == (2, "kv_blocks", 2, "kv_blocks")
    assert p.refusal.code == "RESOURCE_EXHAUSTED" and "--max-queue 2" in p.refusal.message
    assert p.activation_peak_bytes == 40_000  # one chunk of 40 (< 64)
    # A small request behind a queued one still queues: strict FIFO, nobody overtakes.
    r = capacity.plan([Shape(40, 24, 3), Shape(1, 1)], _state(max_queue=5), _ok, _est)
    assert r.outcomes == ("admitted", "admitted", "queued", "queued")


@pytest.mark.unit
def test_an_int4_cache_s_tail_is_counted_in_every_sample_s_blocks():
    """int4 holds a sequence's incomplete block in a two-block tail: admission, the per-request and per-sample
    figures and the fits count it for each sample (server/kv_pool.py's group_blocks)."""
    st = _state(num_blocks=40, free_blocks=40, block_size=32, max_batch=64, max_queue=64, admission="on-demand",
                tail_blocks=2)
    # 100-token prompt: 4 blocks at admission + 2; to 100 + 60 - 1 written tokens, 5 + 2 a sample; n = 2 shares 3
    r = capacity.plan([Shape(100, 60, 1, n=2, expected_new_tokens=20)], st, _ok, _est)
    (p,) = r.shapes
    assert (p.kv_blocks_admission, p.kv_blocks, p.kv_blocks_expected) == (4 + 1 + 4, 5 + 2 + 4, 4 + 1 + 4)
    assert p.kv_bytes_reserved == (5 + 2) * 100
    assert (p.fit_empty, p.fit_expected) == (40 // 11, 40 // 9)
    with pytest.raises(RequestError, match="needs 7 KV blocks"):
        capacity.check_shape(100, 60, 2048, 4, KVLayout(2, 1, 64, torch.float32, 32, "int4"))


@pytest.mark.unit
def test_on_demand_admits_by_the_prompt_and_says_guaranteed_and_expected_concurrency():
    """On demand a request is admitted by its prompt's blocks (the watermark left free while others run); the plan
    gives the guaranteed concurrency (each to max_new_tokens) and the expected one at the stated length."""
    st = _state(num_blocks=100, free_blocks=100, max_batch=64, max_queue=64, admission="on-demand",
                watermark_blocks=2)
    # 200-token prompt (13 blocks), 2048 new at most (141 blocks: more than the pool), ~300 expected (32 blocks)
    r = capacity.plan([Shape(200, 1000, 8, expected_new_tokens=300)], st, _ok, _est)
    (p,) = r.shapes
    assert (p.kv_blocks, p.kv_blocks_admission, p.kv_blocks_expected) == (75, 13, 32)
    assert p.kv_bytes_reserved == 75 * 100  # ceil((200 + 1000 - 1) / 16): the last token's K/V is never written
    assert (p.fit_empty, p.fit_expected, p.fit_expected_limited_by) == (1, 3, "kv_blocks")
    # 13 blocks each: 7 admitted (the 8th would leave 100 - 91 - 13 < 2 free), then FIFO
    assert r.outcomes == ("admitted",) * 7 + ("queued",)
    reserve = capacity.plan([Shape(200, 1000, 8, expected_new_tokens=300)], _state(
        num_blocks=100, free_blocks=100, max_batch=64, max_queue=64), _ok, _est)
    assert reserve.outcomes == ("admitted",) + ("queued",) * 7 and reserve.shapes[0].fit_expected == 1
    # an idle engine admits a request whatever the watermark; a stated length beyond max_new_tokens is refused
    assert capacity.plan([Shape(1500, 10)], st, _ok, _est).outcomes == ("admitted",)
    with pytest.raises(RequestError) as e:
        capacity.plan([Shape(10, 10, expected_new_tokens=11)], st, _ok, _est)
    assert e.value.param == "requests[0].expected_new_tokens"


@pytest.mark.unit
def test_batch_slots_and_waiting_requests_of_the_snapshot():
    r = capacity.plan([Shape(1, 1, 2)], _state(running=2), _ok, _est)
    assert r.outcomes == ("admitted", "queued") and r.shapes[0].fit_now_limited_by == "max_batch"
    # The waiting head that fits is admitted first (what the engine's next admission does); one that does not
    # keeps everything behind it queued.
    assert capacity.plan([Shape(1, 1)], _state(waiting=((3, 1),), queued=1), _ok, _est).outcomes == ("admitted",)
    r = capacity.plan([Shape(1, 1)], _state(free_blocks=2, waiting=((3, 1),), queued=1), _ok, _est)
    assert r.outcomes == ("queued",) and r.shapes[0].fit_now == 2


@pytest.mark.unit
def test_long_prompts_are_planned_in_prefill_chunks():
    # 150 tokens at 64 per step: chunks (64, 0), (64, 64), (22, 128); the estimate is largest on the second.
    (p,) = capacity.plan([Shape(150, 10)], _state(num_blocks=100, free_blocks=100), _ok, _est).shapes
    assert p.activation_peak_bytes == max(_est(64, 0), _est(64, 64), _est(22, 128))


@pytest.mark.unit
def test_a_refused_shape_is_an_outcome_with_the_reason():
    def check(n, m):
        return Refusal("INVALID_ARGUMENT", "too long", "prompt") if n > 100 else None

    r = capacity.plan([Shape(101, 1, 2), Shape(1, 1)], _state(), check, _est)
    assert r.outcomes == ("refused", "refused", "admitted")
    p = r.shapes[0]
    assert (p.refused, p.fit_now, p.fit_now_limited_by, p.activation_peak_bytes) == (2, 0, "refused", 0)
    assert p.refusal == Refusal("INVALID_ARGUMENT", "too long", "prompt")


@pytest.mark.unit
@pytest.mark.parametrize("shapes, param", [
    ([], "requests"),
    ([Shape(0, 1)], "requests[0].prompt_tokens"),
    ([Shape(1, 1), Shape(1, -2)], "requests[1].max_new_tokens"),
    ([Shape(1, 1, 0)], "requests[0].count"),
    ([Shape(1, 1, 65537)], "requests"),
    ([Shape(1, 1)] * 257, "requests"),
])
def test_invalid_plans_name_the_field(shapes, param):
    with pytest.raises(RequestError) as e:
        capacity.plan(shapes, _state(), _ok, _est)
    assert e.value.param == param


# ------------------------------------------------------------------------------- the engine, step by step


@pytest.mark.e2e
@pytest.mark.parametrize("admission", ["on-demand", "reserve"])
def test_the_plan_is_what_the_engine_then_does(tiny_model_dir, cache_dir, admission):
    """Outcomes and KV for a grid of shapes: planned from a snapshot, then sent one by one with the engine's own
    admission run after each (the loop's drain + admit, by hand, so nothing races); each admitted request holds the
    blocks the plan says it takes at admission."""
    import torch

    model, tok, name, scheme = load_for_serving(str(tiny_model_dir), torch.float32, "cpu", cache_dir)
    cfg = EngineConfig(memory_budget="64KiB", max_batch=3, max_queue=3, dtype="float32", max_prefill_tokens=32,
                       kv_admission=admission)
    eng = Engine(model, tok, cfg, name, scheme)  # not started: this test is the loop
    grid = [Shape(20, 10), Shape(100, 60, 2), Shape(600, 10), Shape(5, 5, 3), Shape(30, 500), Shape(1, 1, 2)]
    planned = eng.plan(grid, lambda n, m: capacity.Refusal("INVALID_ARGUMENT", "x") if _refused(eng, n, m) else None
                       ).result(5)
    got, reserved = [], {}
    for s in grid:
        for _ in range(s.count):
            try:
                h = eng.submit([7] * s.prompt_tokens, SamplingParams(max_new_tokens=s.max_new_tokens, seed=0),
                               lambda ev: None)
            except (RequestError, OverloadedError):
                got.append("refused")
                continue
            eng._drain_inbox(block=False)
            for _ in eng.scheduler.admit():
                eng._dequeued()
            running = {q.id: q for q in eng.scheduler.running}
            got.append("admitted" if h.id in running else "queued")
            if h.id in running:
                reserved.setdefault(s, len(running[h.id].blocks))
    assert tuple(got) == planned.outcomes
    assert set(planned.outcomes) == {"admitted", "queued", "refused"}  # the grid reaches every outcome
    assert reserved
    for p in planned.shapes:
        if p.shape in reserved:
            assert reserved[p.shape] == p.kv_blocks_admission


def _refused(eng, n, m) -> bool:
    try:
        eng.check(n, m)
    except RequestError:
        return True
    return False


# ------------------------------------------------------------------------------------ both transports


@pytest.fixture(scope="module")
def server(tiny_model_dir, cache_dir):
    s = start(tiny_model_dir, cache_dir, limits=Limits(max_new_tokens=64))
    yield s
    s.shutdown()


@pytest.mark.e2e
@pytest.mark.parametrize("http", [False, True])
def test_plan_matches_the_accounting_of_real_requests(server, http):
    target = server.http.removeprefix("http://") if http else server.grpc_target
    grid = [RequestShape(5, 8), RequestShape(70, 3), RequestShape(130, 20), RequestShape(10, 65),
            RequestShape(600, 4)]
    rng = random.Random(int(http))  # prompts no earlier request began with: the Plan is for uncached prompts
    with Client(target, http=http) as c:
        plan = c.plan(grid)
        for shape, p in zip(grid, plan.shapes):
            try:
                r = c.generate([rng.randrange(3, 1000) for _ in range(shape.prompt_tokens)],
                               max_new_tokens=shape.max_new_tokens, min_tokens=shape.max_new_tokens, seed=1)
            except ClientError as e:
                assert (p.refused, p.refusal.code, p.refusal.message, p.refusal.param) == (1, e.code, e.message,
                                                                                           e.param)
                continue
            assert (p.admitted, p.refusal) == (1, None)  # an idle server runs each at once
            assert r.memory.kv_bytes_reserved == p.kv_bytes_reserved  # run to max_new_tokens (min_tokens)
            assert r.memory.activation_peak_bytes == p.activation_peak_bytes  # prefilled alone
    assert sum(p.refused for p in plan.shapes) == 2  # over the server's max_new_tokens; over the context
    assert plan.kv_free_blocks == plan.kv_capacity_blocks and plan.engine.running == 0
    server.assert_idle()


@pytest.mark.e2e
def test_invalid_plan_inputs_are_400_and_invalid_argument_naming_the_field(server):
    for body, param in (({"requests": [{"prompt_tokens": 3, "max_new_tokens": 0}]}, "requests[0].max_new_tokens"),
                        ({"prompt_tokens": 3}, "max_new_tokens"),
                        ({"prompt_tokens": 3, "max_new_tokens": 2, "concurrency": 0}, "concurrency"),
                        ({"requests": [], }, "requests"),
                        ({"requests": [{"prompt_tokens": "3", "max_new_tokens": 2}]}, "requests"),
                        ({"requests": [{"prompt_tokens": 3, "max_new_tokens": 2}], "prompt_tokens": 3},
                         "prompt_tokens")):
        r = httpx.post(server.http + "/v1/plan", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.grpc_target))
    with pytest.raises(grpc.RpcError) as e:
        stub.Plan(pb.PlanRequest(requests=[pb.RequestShape(prompt_tokens=3, max_new_tokens=2, count=0)]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requests[0].count" in e.value.details()
    assert dict(e.value.trailing_metadata())["quantserve-param"] == "requests[0].count"
    ok = stub.Plan(pb.PlanRequest(requests=[pb.RequestShape(prompt_tokens=3, max_new_tokens=2)]), timeout=30)
    assert ok.shapes[0].shape.count == 1 and ok.shapes[0].admitted == 1  # count defaults to 1


# ------------------------------------------------------------------------------------ offline


@pytest.mark.e2e
@pytest.mark.slow
def test_quant_estimate_requests_answers_what_the_live_server_plans(cache_dir):
    """The default model: `quant estimate --requests` (config only) and an idle server's Plan, same settings, with an
    int8 KV cache (its bytes per token, scales included, in both)."""
    from quant.format import sources as models

    default_model_dir = models.resolve(None, cache_dir).path
    shapes = "300x100x4,1000x200x40,9000x10"
    flags = ["--memory-budget", "48MiB", "--max-batch", "8", "--max-queue", "16", "--max-prefill-tokens", "256"]
    r = subprocess.run([sys.executable, "-m", "quant.cli", "estimate", "--model", str(default_model_dir),
                        "--requests", shapes, "--dtype", "float32", "--kv-dtype", "int8", "--json", *flags],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    offline = json.loads(r.stdout)
    s = start(default_model_dir, cache_dir, memory_budget="48MiB", max_batch=8, max_queue=16, dtype="float32",
              max_prefill_tokens=256, kv_dtype="int8")
    try:
        with Client(s.grpc_target) as c:
            live = c.plan([tuple(int(x) for x in t.split("x")) for t in shapes.split(",")])
    finally:
        s.shutdown()
    from quantserve.client.types import plan_from_dict

    want = plan_from_dict(offline)
    assert live.shapes == want.shapes
    assert {o for p in live.shapes for o in ("admitted", "queued", "refused") if getattr(p, o)} == {
        "admitted", "queued", "refused"}
    assert (live.kv_capacity_blocks, live.kv_bytes_per_token, live.max_batch, live.max_prefill_tokens) == (
        want.kv_capacity_blocks, want.kv_bytes_per_token, want.max_batch, want.max_prefill_tokens)
    assert live.kv_dtype == want.kv_dtype == "int8" and live.kv_bytes_per_token == 30 * 3 * 2 * (64 + 2)


@pytest.mark.unit
def test_a_shape_string_may_state_the_expected_new_tokens():
    from quantserve.client.types import parse_shape

    assert parse_shape("200x2048x8~300") == RequestShape(200, 2048, 8, 1, 300)
    assert parse_shape("5x6x2x3") == RequestShape(5, 6, 2, 3, 0)
    for bad in ("5x6~", "5x6~3x", "~3", "5x6~-1"):
        with pytest.raises(ValueError, match="PROMPTxMAX_NEW"):
            parse_shape(bad)


@pytest.mark.e2e
@pytest.mark.parametrize("http", [False, True])
def test_the_expected_concurrency_over_both_transports(server, http):
    target = server.http.removeprefix("http://") if http else server.grpc_target
    with Client(target, http=http) as c:
        (p,) = c.plan([RequestShape(40, 60, 1, 1, 10)]).shapes
    assert p.shape.expected_new_tokens == 10 and p.kv_blocks_admission == 3  # ceil(40 / 16)
    assert p.kv_blocks_expected == 4 and p.fit_expected >= p.fit_empty  # ceil(49 / 16); 100 tokens: 7 blocks


@pytest.mark.e2e
def test_quant_estimate_requests_refuses_a_bad_shape_in_one_line():
    r = subprocess.run([sys.executable, "-m", "quant.cli", "estimate", "--requests", "12x0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "requests[0].max_new_tokens" in lines[0], r.stderr


@pytest.mark.e2e
def test_the_client_and_cli_refuse_a_plan_without_one_clear_shape(server, capsys):
    from quantserve.client.cli import main

    with Client(server.grpc_target) as c:
        for kw, param in (({}, "prompt_tokens"), ({"prompt_tokens": 5}, "max_new_tokens"),
                          ({"shapes": [(5, 5)], "prompt_tokens": 5}, "shapes")):
            with pytest.raises(ClientError) as e:
                c.plan(**kw)
            assert e.value.code == "invalid_argument" and e.value.param == param
    for args, says in ((["plan"], "needs --prompt-tokens"),
                       (["plan", "--shape", "5x5", "--max-new-tokens", "5"], "not both"),
                       (["plan", "--shape", "5x"], "--shape: a request shape is PROMPTxMAX_NEW[xCOUNT[xN]][~EXPECTED]"),
                       (["plan", "--shape", "5x5~x"], "--shape: a request shape is")):
        assert main([*args, "--target", server.grpc_target]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert main(["plan", "--shape", "5x5~9", "--target", server.grpc_target]) != 0  # the server's refusal
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "requests[0].expected_new_tokens" in err, err
