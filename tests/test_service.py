"""End-to-end: the real server (gRPC + HTTP over one engine) on free loopback ports, driven by real clients:
httpx, the official openai package, grpc stubs, the health and reflection clients."""

from __future__ import annotations

import json
import math
import threading
import time

import grpc
import httpx
import live_server
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_server import start
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

from server.config import Limits
from server.loadgen.drive import metric_sum

pytestmark = pytest.mark.e2e

server = live_server.module_server()
_pool_back_to_zero = live_server.pool_back_to_zero


def stub(server):
    return pb_grpc.InferenceStub(grpc.insecure_channel(server.grpc_target))


# ------------------------------------------------------------------------------------------------ HTTP


def test_http_completion_matches_the_engine_and_reports_seed_usage_memory(server):
    body = {"prompt": "The city of", "max_tokens": 12, "temperature": 0.8, "top_k": 40, "seed": 7}
    r = httpx.post(server.http + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    from server.sampling_params import SamplingParams

    ref = server.engine.complete("The city of", SamplingParams(temperature=0.8, top_k=40, seed=7, max_new_tokens=12))
    assert j["choices"][0]["text"] == ref.text and j["seed"] == 7
    assert j["usage"]["completion_tokens"] == len(ref.token_ids)
    assert j["usage"]["prompt_tokens"] == j["memory"]["prompt_tokens"]
    assert j["memory"]["kv_bytes_reserved"] > 0 and j["memory"]["engine"]["kv_capacity_bytes"] > 0
    assert j["choices"][0]["finish_reason"] in ("length", "stop")


def test_http_stream_equals_the_unary_result(server):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, memory, done = [], None, None, False
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                memory = chunk.get("memory") or memory
            else:
                usage = chunk["usage"]
    unary = httpx.post(server.http + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert done and "".join(text) == unary["choices"][0]["text"]
    assert usage == unary["usage"] and memory["kv_bytes_reserved"] == unary["memory"]["kv_bytes_reserved"]


def test_openai_client_completions_chat_and_streaming(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert len(models.data) == 1
    c = client.completions.create(model=models.data[0].id, prompt="Hello", max_tokens=5, temperature=0,
                                  logprobs=2)
    assert c.usage.completion_tokens == len(c.choices[0].logprobs.tokens)
    assert all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=6, temperature=0.7, seed=11, extra_body={"top_k": 20},
                                          logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.model_extra["seed"] == 11 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi there"}],
                                            max_tokens=6, temperature=0.7, seed=11, extra_body={"top_k": 20},
                                            stream=True)
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_new_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 10**9}, "n"),  # refused by the engine before anything is allocated per sample
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary: the engine's check
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [5, 1]}, "logit_bias"),
    ({"prompt": "x", "typical_p": 0.5}, "typical_p"),  # a field this server does not know: refused by name
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({}, "prompt"),
])
def test_http_invalid_requests_get_400_naming_the_parameter(server, body, param):
    r = httpx.post(server.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("_")[0] in err["message"]


def test_the_openai_sdk_sends_each_control_and_gets_its_effect(server):
    """min_p, presence / frequency penalties and logit_bias through the official client (OpenAI's own fields as
    arguments, min_p in extra_body), each with an effect a test can see, and the same tokens as gRPC."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    prompt = "The river runs"

    def ids(**kw):
        c = client.completions.create(model="m", prompt=prompt, max_tokens=8, seed=3, **kw)
        return c.choices[0].model_extra["token_ids"]

    forced = ids(temperature=1.0, logit_bias={"17": 100})
    assert forced == [17] * 8, "a +100 bias forces the token"
    greedy = ids(temperature=0.0)
    banned = ids(temperature=0.0, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0], "a -100 bias removes the greedy token"
    # min_p = 1 keeps only the most probable token: any temperature draws the greedy tokens
    assert ids(temperature=1.5, extra_body={"min_p": 1.0}) == greedy
    sampled = ids(temperature=1.5)
    assert sampled != greedy  # the same seed without min_p draws other tokens (a tiny random model is flat)
    # a frequency penalty of 2 on greedy decoding: each repeat costs 2 more, so repeats fall
    penalised = ids(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5)
    assert len(set(greedy)) < 4 < len(set(penalised)), (greedy, penalised)  # the tiny model loops; penalised, not
    s = stub(server)
    g = s.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParameters(
        temperature=0.0, max_new_tokens=8, seed=3, frequency_penalty=2.0, presence_penalty=0.5,
        logit_bias={greedy[0]: -100.0})), timeout=60)
    want = ids(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5, logit_bias={str(greedy[0]): -100})
    assert list(g.token_ids) == want, "gRPC and HTTP apply the same controls"


def test_echo_and_prompt_logprobs_as_lm_eval_asks_for_them(server):
    """A loglikelihood request as lm-evaluation-harness makes it (echo, logprobs 1, token ids; max_tokens 0 here, 1
    in lm-eval 0.4.13, which drops the generated token's logprob) through the openai SDK: the prompt's tokens come back with their logprobs (the first null) and top alternatives, equal to gRPC's
    prompt_logprobs and to the teacher-forced log-softmax of the engine's own forward; streaming gives the same."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    ids = server.engine.tokenize("The river runs down to the old harbour")
    c = client.completions.create(model="m", prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0.0)
    ch = c.choices[0]
    assert ch.finish_reason == "length" and ch.model_extra["token_ids"] == [] and c.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert ch.text == server.engine.decode(ids)
    g = stub(server).Generate(pb.GenerateRequest(prompt_ids=ids, sampling=pb.SamplingParameters(
        max_new_tokens=0, prompt_logprobs=1)), timeout=60)
    assert [p.token_id for p in g.prompt_logprobs] == ids[1:] and not g.token_ids
    assert lp.token_logprobs[1:] == pytest.approx([p.logprob for p in g.prompt_logprobs], abs=1e-5)
    assert [list(t.values())[0] for t in lp.top_logprobs[1:]] == \
        pytest.approx([p.top[0].logprob for p in g.prompt_logprobs], abs=1e-5)
    assert all(v <= max(t.values()) + 1e-6 for v, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    # with generation after the prompt, the logprobs run on over the generated tokens
    c2 = client.completions.create(model="m", prompt="The river", echo=True, logprobs=2, max_tokens=3,
                                   temperature=0.0)
    n_prompt = len(server.engine.tokenize("The river"))
    assert c2.choices[0].text.startswith("The river") and len(c2.choices[0].logprobs.tokens) == n_prompt + 3
    assert c2.choices[0].logprobs.token_logprobs[0] is None and None not in c2.choices[0].logprobs.token_logprobs[1:]
    stream = client.completions.create(model="m", prompt="The river", echo=True, logprobs=2, max_tokens=3,
                                       temperature=0.0, stream=True)
    chunks = [x for x in stream if x.choices]
    assert "".join(x.choices[0].text for x in chunks) == c2.choices[0].text
    assert [t for x in chunks for t in x.choices[0].logprobs.token_logprobs] == \
        pytest.approx(c2.choices[0].logprobs.token_logprobs, abs=1e-6)
    # several prompts in one body (lm-eval's batches): choice i * n + j is prompt i's sample j
    two = client.completions.create(model="m", prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=1,
                                    temperature=0.0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [len(c.logprobs.tokens) for c in two.choices] == [len(ids) + 1] * 2 + [6] * 2
    assert two.choices[0].logprobs.token_logprobs[1:-1] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert two.usage.prompt_tokens == len(ids) + 5 and two.usage.completion_tokens == 4
    for body, why in (({"prompt": [ids, ids], "stream": True}, "one prompt"),
                      ({"prompt": [ids] * 65}, "at most 64 prompts"),
                      ({"prompt": [ids * 4, [10**9]]}, "token ids must be")):  # checked before either runs
        r = httpx.post(server.http + "/v1/completions", json={**body, "max_tokens": 200}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and why in r.text, r.text
        assert not server.engine.scheduler.has_work  # nothing of it was submitted
    for body, param in (({"prompt": [-1, 5], "echo": True}, "prompt"),  # checked before it is decoded
                        ({"prompt": ids, "echo": True, "logprobs": 25}, "logprobs"),
                        ({"prompt": ids, "logit_bias": {"\u00b2": 1}}, "logit_bias")):  # a digit, not ASCII
        r = httpx.post(server.http + "/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # echo with prompt_logprobs by name: both (the echoed text, and the numbers with ids in the choice)
    both = httpx.post(server.http + "/v1/completions", timeout=30, json={
        "prompt": ids, "echo": True, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0.0}).json()
    assert [e["token_id"] for e in both["choices"][0]["prompt_logprobs"][1:]] == ids[1:]
    # vLLM's prompt_logprobs by name (extra_body): the same numbers, with ids, in the choice
    c3 = client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0.0,
                                   extra_body={"prompt_logprobs": 1})
    plp = c3.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and [e["token_id"] for e in plp[1:]] == ids[1:]
    assert [e["logprob"] for e in plp[1:]] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_the_client_gives_prompt_logprobs_on_both_transports(server):
    from quantserve.client import Client

    ids = server.engine.tokenize("A quiet morning in the valley")
    got = {}
    for http in (False, True):
        c = Client(server.http.removeprefix("http://") if http else server.grpc_target, http=http)
        r = c.generate(ids, max_new_tokens=0, prompt_logprobs=2)
        s = [x.result for x in c.stream(ids, max_new_tokens=2, prompt_logprobs=2, temperature=0.0) if x.result]
        assert s[0].prompt_logprobs == r.prompt_logprobs and len(s[0].token_ids) == 2
        got[http] = r
        c.close()
    g, h = got[False], got[True]
    assert [x.token_id for x in g.prompt_logprobs] == [x.token_id for x in h.prompt_logprobs] == ids[1:]
    assert [x.logprob for x in g.prompt_logprobs] == pytest.approx([x.logprob for x in h.prompt_logprobs], abs=1e-6)
    assert all(len(x.top) == 2 for x in g.prompt_logprobs) and g.token_ids == () and g.finish_reason == "length"


def test_http_fields_that_change_nothing_are_taken(server):
    """user, metadata, store and service_tier are OpenAI fields that change nothing here: taken, not refused."""
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        r = httpx.post(server.http + path, json={**body, "user": "u-1", "metadata": {"k": "v"}, "store": False,
                                                 "service_tier": "auto"}, timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
     "messages"),
    ("/tokenize", b'{"text": "x\\ud83d"}', "prompt"),
])
def test_http_lone_surrogate_is_400_not_500(server, path, body, param):
    """JSON can escape a lone UTF-16 surrogate, which no tokenizer takes (found by bench/fuzz.py)."""
    r = httpx.post(server.http + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_http_malformed_json_and_health_and_metrics(server):
    r = httpx.post(server.http + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(server.http + "/health").json() == {"status": "ok"}
    httpx.post(server.http + "/v1/completions", json={"prompt": "m", "max_tokens": 3}, timeout=30)
    m = httpx.get(server.http + "/metrics").text
    for name in ("quantserve_time_to_first_token_seconds_bucket", "quantserve_inter_token_latency_seconds",
                 "quantserve_generated_tokens_total", "quantserve_requests_total", "quantserve_queue_depth",
                 "quantserve_kv_pool_capacity_bytes", "quantserve_kv_pool_used_bytes"):
        assert name in m
    assert 'outcome="invalid"' in m


def test_http_extensions_token_ids_timings_info_tokenize(server):
    body = {"prompt": "The river", "max_tokens": 6, "temperature": 0.9, "seed": 5}
    j = httpx.post(server.http + "/v1/completions", json=body, timeout=60).json()
    g = stub(server).Generate(pb.GenerateRequest(prompt="The river", sampling=pb.SamplingParameters(
        temperature=0.9, seed=5, max_new_tokens=6)), timeout=60)
    assert j["choices"][0]["token_ids"] == list(g.token_ids) and 0 < j["ttft_s"] <= j["duration_s"]
    with httpx.stream("POST", server.http + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(g.token_ids)
    assert chunks[-1]["duration_s"] >= chunks[-1]["ttft_s"] > 0
    info = httpx.get(server.http + "/v1/info", timeout=10).json()
    grpc_info = stub(server).ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info["vocab_size"] == grpc_info.vocab_size and info["glue_ops"] == grpc_info.glue_ops
    assert info["memory"]["kv_capacity_bytes"] == grpc_info.memory.kv_capacity_bytes
    tk = httpx.post(server.http + "/tokenize", json={"text": "The river"}, timeout=10).json()
    assert tk["token_ids"] == server.engine.tokenize("The river") and len(tk["tokens"]) == len(tk["token_ids"])
    assert httpx.post(server.http + "/tokenize", json={"text": 3}, timeout=10).status_code == 400


def test_http_unary_request_is_cancelled_when_its_client_leaves(server):
    def cancelled() -> float:
        return metric_sum(server.http, "quantserve_requests_total", transport="http", outcome="cancelled")

    before = cancelled()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.http + "/v1/completions", timeout=0.3,
                   json={"prompt": "x", "max_tokens": 450, "ignore_eos": True})
    end = time.monotonic() + 10
    while cancelled() == before and time.monotonic() < end:
        time.sleep(0.05)
    assert cancelled() == before + 1  # the engine dropped it; it did not run to its 450 tokens


def test_http_refusals_outside_our_handlers_keep_the_error_body(server):
    def chunks():
        yield b'{"prompt": "x"}'

    r = httpx.post(server.http + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})  # a generator body is sent chunked
    assert r.status_code == 411 and "Content-Length" in r.json()["error"]["message"]
    r = httpx.post(server.http + "/v1/completions", content=b"\x80", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.get(server.http + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_requests_without_max_tokens_get_the_servers_limit_when_lower(tiny_model_dir, cache_dir):
    s = start(tiny_model_dir, cache_dir, limits=Limits(max_new_tokens=5))
    try:
        r = stub(s).Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(ignore_eos=True)),
                             timeout=60)
        assert r.final.usage.completion_tokens == 5
        c = httpx.post(s.http + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}).json()
        assert c["usage"]["completion_tokens"] == 5
        bad = httpx.post(s.http + "/v1/completions", json={"prompt": "x", "max_tokens": 6}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_new_tokens"
    finally:
        s.shutdown()


# ------------------------------------------------------------------------------------------------ gRPC


def test_grpc_generate_stream_tokenize_info(server):
    s = stub(server)
    req = pb.GenerateRequest(prompt="The river", sampling=pb.SamplingParameters(temperature=0.9, seed=5,
                                                                              max_new_tokens=10, logprobs=2, trace=3))
    r = s.Generate(req, timeout=60)
    assert r.final.seed == 5 and r.final.usage.completion_tokens == len(r.token_ids)
    assert r.final.memory.kv_bytes_reserved > 0 and r.final.memory.engine.kv_capacity_bytes > 0
    assert len(r.logprobs) == len(r.token_ids) and len(r.trace) == len(r.token_ids)
    assert all(len(t.after_temperature) <= 3 for t in r.trace)
    vocab = server.engine.info.vocab_size
    assert all(t.kept_top_k == vocab and 1 <= t.kept_top_p == vocab and t.entropy > 0 for t in r.trace)
    # HTTP carries the same trace for the same seed.
    h = httpx.post(server.http + "/v1/completions", timeout=60, json={
        "prompt": "The river", "max_tokens": 10, "temperature": 0.9, "seed": 5, "trace": 3}).json()
    for stage in ("after_penalties", "after_temperature", "after_top_k", "after_top_p", "after_min_p"):
        assert [[c["token_id"] for c in t[stage]] for t in h["trace"]] == \
            [[c.token_id for c in getattr(t, stage)] for t in r.trace]
    # an fp32 sum of 49152 probabilities: within ~1e-5 of 1 (1.07e-6 off on a 2-core EPYC, past approx's 1e-6)
    assert all(t.kept_min_p == vocab and t.mass_min_p == pytest.approx(1, abs=1e-5) for t in r.trace)
    assert [t["entropy"] for t in h["trace"]] == pytest.approx([t.entropy for t in r.trace])
    msgs = list(s.GenerateStream(req, timeout=60))
    assert "".join(m.text for m in msgs) == r.text and msgs[-1].final.finish_reason == r.final.finish_reason
    assert [t for m in msgs for t in m.token_ids] == list(r.token_ids)
    tk = s.Tokenize(pb.TokenizeRequest(text="The river"), timeout=10)
    assert list(tk.token_ids) == server.engine.tokenize("The river") and len(tk.tokens) == len(tk.token_ids)
    info = s.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.attention == "sdpa" and info.device == "cpu" and info.memory.kv_capacity_bytes > 0


@pytest.mark.parametrize("sampling,param", [
    (pb.SamplingParameters(top_p=2.0), "top_p"),
    (pb.SamplingParameters(temperature=float("nan")), "temperature"),
    (pb.SamplingParameters(seed=-1), "seed"),
    (pb.SamplingParameters(max_new_tokens=100000), "max_new_tokens"),
    (pb.SamplingParameters(logprobs=21), "logprobs"),
])
def test_grpc_invalid_argument_names_the_parameter(server, sampling, param):
    with pytest.raises(grpc.RpcError) as e:
        stub(server).Generate(pb.GenerateRequest(prompt="x", sampling=sampling), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in e.value.details()
    assert ("quantserve-param", param) in e.value.trailing_metadata()


# ------------------------------------------------------------------------- values that overflow the arithmetic

# bench/fuzz.py's finding: a repetition_penalty of 2.1e-53 is 0 in fp32, a seen token's logit / p was inf and the
# trace's probabilities NaN, so the response could not be written as JSON (a 500).
FUZZ_FOUND = {"prompt": "0", "max_tokens": 1, "repetition_penalty": 2.1e-53, "n": 2, "trace": 1}


def _strict_json(text: str):
    """JSON as RFC 8259 has it: the NaN and Infinity that Python's json module would take are a failure."""
    def refuse(name):
        raise AssertionError(f"non-finite number {name} in {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def _numbers(x):
    """Every number in a parsed JSON value or a protobuf message, recursively."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return
    if isinstance(x, (int, float)):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _numbers(v)
    elif hasattr(x, "ListFields"):
        for _, v in x.ListFields():
            yield from _numbers(list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v)


def _sse(r: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-300:]
    return [_strict_json(x) for x in lines[:-1]]


@pytest.mark.parametrize("field,value", [("repetition_penalty", 2.1e-53), ("repetition_penalty", 1e3),
                                         ("temperature", 1e-40)])
def test_a_value_that_overflows_fp32_is_refused_by_name_on_both_transports(server, field, value):
    """The exact request the fuzzer found, and its kin: 400 with one line naming the field and its range, streamed
    or not, completions or chat; gRPC INVALID_ARGUMENT, unary or streamed. Nothing reaches the engine."""
    body = {**FUZZ_FOUND, field: value}
    chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "0"}]}
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for stream in (False, True):
            r = httpx.post(server.http + path, json={**b, "stream": stream}, timeout=30)
            assert r.status_code == 400, r.text
            err = _strict_json(r.text)["error"]
            assert err["param"] == field and err["message"].startswith(f"{field} must be "), err
            assert "\n" not in err["message"] and repr(value) in err["message"]
    s = stub(server)
    req = pb.GenerateRequest(prompt="0", n=2, sampling=pb.SamplingParameters(
        max_new_tokens=1, trace=1, **{"repetition_penalty": 1.0, field: value}))
    for call in (s.Generate, lambda q, timeout: list(s.GenerateStream(q, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        assert ("quantserve-param", field) in e.value.trailing_metadata()


@pytest.mark.parametrize("edge", [{"repetition_penalty": 0.01, "temperature": 1e-6},
                                  {"repetition_penalty": 100.0, "temperature": 3.4e38},
                                  {"repetition_penalty": 0.01, "temperature": 0.0, "min_tokens": 2}])
def test_the_edges_of_the_ranges_give_finite_numbers_on_both_transports(server, edge):
    """At the edges of what is accepted (the fuzzer's request with the smallest penalty taken), every probability,
    trace figure and logprob in the response is a finite number: strict JSON over HTTP, streamed or not, and
    finite doubles over gRPC."""
    body = {**FUZZ_FOUND, "max_tokens": 3, "trace": 3, "logprobs": 5, "seed": 1, **edge}
    r = httpx.post(server.http + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = _strict_json(r.text)
    assert all(len(c["trace"]) == len(c["token_ids"]) for c in j["choices"]) and len(j["choices"]) == 2
    assert all(math.isfinite(x) for x in _numbers(j))
    chunks = _sse(httpx.post(server.http + "/v1/completions", json={**body, "stream": True}, timeout=60))
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == sum(len(c["token_ids"]) for c in j["choices"])
    assert all(math.isfinite(x) for x in _numbers(chunks))
    chat = {k: v for k, v in body.items() if k not in ("prompt", "logprobs")}
    chat |= {"messages": [{"role": "user", "content": "0"}], "logprobs": True, "top_logprobs": 5}
    for stream in (False, True):
        r = httpx.post(server.http + "/v1/chat/completions", json={**chat, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        assert all(math.isfinite(x) for x in _numbers(_sse(r) if stream else _strict_json(r.text)))
    s = stub(server)
    req = pb.GenerateRequest(prompt="0", n=2, sampling=pb.SamplingParameters(
        max_new_tokens=3, trace=3, logprobs=5, seed=1, **edge))
    g = s.Generate(req, timeout=60)
    assert len(g.choices) == 2 and all(len(c.trace) == len(c.token_ids) for c in g.choices)
    assert [list(c.token_ids) for c in g.choices] == [c["token_ids"] for c in j["choices"]]
    assert all(math.isfinite(x) for x in _numbers(g))
    assert all(math.isfinite(x) for m in s.GenerateStream(req, timeout=60) for x in _numbers(m))


def test_grpc_chat_uses_the_template_like_http(server):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = stub(server).Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in conv],
        sampling=pb.SamplingParameters(temperature=0.7, seed=4, max_new_tokens=8)), timeout=60)
    h = httpx.post(server.http + "/v1/chat/completions", timeout=60, json={
        "messages": conv, "temperature": 0.7, "seed": 4, "max_tokens": 8}).json()
    assert r.text == h["choices"][0]["message"]["content"]
    assert r.final.usage.prompt_tokens == h["usage"]["prompt_tokens"] == len(server.engine.chat_prompt(conv))


@pytest.mark.parametrize("req,param", [
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="x")]), "messages"),
    (pb.GenerateRequest(prompt="x", messages=[pb.ChatMessage(role="user", content="x")]), "messages"),
    (pb.GenerateRequest(prompt="x", prompt_ids=[1, 2]), "prompt_ids"),
])
def test_grpc_prompt_is_exactly_one_kind(server, req, param):
    with pytest.raises(grpc.RpcError) as e:
        stub(server).Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in e.value.details()


def test_grpc_corrupt_message_is_invalid_argument(server):
    raw = grpc.insecure_channel(server.grpc_target).unary_unary("/quantserve.v1.Inference/Generate")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x0a\xff\xff", timeout=30)  # field 1 claims a length far past the end
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed Generate message" in e.value.details()


def test_service_refuses_empty_and_oversized_conversations(server):
    """The Service's own checks (the transports' size limits usually refuse first)."""
    import asyncio

    from server.outputs import RequestError
    from server.service import Service

    svc = Service(server.engine, Limits(max_request_bytes=8))
    with pytest.raises(RequestError, match="messages must not be empty"):
        asyncio.run(svc.chat_prompt([]))
    with pytest.raises(RequestError, match="messages are larger than 8 bytes") as e:
        asyncio.run(svc.chat_prompt([{"role": "user", "content": "12345"}, {"role": "user", "content": "6789"}]))
    assert e.value.param == "messages"
    with pytest.raises(RequestError, match="prompt is larger than 8 bytes"):
        asyncio.run(svc.prompt_ids("\u00e9" * 5))  # 10 bytes in UTF-8, 5 characters


def test_grpc_deadline_and_cancel_free_the_kv_blocks(server):
    s = stub(server)
    long = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(max_new_tokens=400, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as e:
        s.Generate(long, timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    it = s.GenerateStream(long, timeout=60)
    next(it)
    it.cancel()  # the autouse fixture then waits for the pool to be empty


def test_grpc_health_and_reflection(server):
    ch = grpc.insecure_channel(server.grpc_target)
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="quantserve.v1.Inference"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    rs = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(rs.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"quantserve.v1.Inference", "grpc.health.v1.Health"} <= names


# ------------------------------------------------------------------------------------------------ auth, load, drain


def test_api_key_on_both_transports(tiny_model_dir, cache_dir):
    s = start(tiny_model_dir, cache_dir, api_key="s3cret")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(s.http + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(s.http + "/v1/completions", json=body, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = httpx.post(s.http + "/v1/completions", json=body, headers={"authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(s.http + "/health").status_code == 200  # probes need no key
        st = stub(s)
        with pytest.raises(grpc.RpcError) as e:
            st.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert st.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=[("authorization", "Bearer s3cret")]).model
    finally:
        s.shutdown()
    assert s.rc == 0


def test_overload_is_429_and_resource_exhausted(tiny_model_dir, cache_dir):
    from server.sampling_params import SamplingParams

    s = start(tiny_model_dir, cache_dir, max_queue=1, max_batch=1)
    gate, entered = threading.Event(), threading.Event()

    def blocking_sink(ev):  # holds the engine thread on A's first event, so B stays queued
        entered.set()
        gate.wait(30)

    try:
        s.engine.submit("x", SamplingParams(max_new_tokens=3), blocking_sink)
        assert entered.wait(30)
        done = []
        s.engine.submit("x", SamplingParams(max_new_tokens=3), lambda ev: ev.finished and done.append(ev))
        r = httpx.post(s.http + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and "overloaded" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            stub(s).Generate(pb.GenerateRequest(prompt="x"), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.set()
        end = time.monotonic() + 30  # B leaves the queue only when A is done: wait for it, or this races
        while not done and time.monotonic() < end:
            time.sleep(0.01)
        assert done
        assert httpx.post(s.http + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).is_success
    finally:
        gate.set()
        s.shutdown()
    assert s.rc == 0 and s.engine.pool.used_blocks == 0


def test_drain_cancels_what_is_left_after_the_grace_period_with_unavailable(tiny_model_dir, cache_dir):
    s = start(tiny_model_dir, cache_dir, grace_s=0.0)
    st = stub(s)
    it = st.GenerateStream(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(
        max_new_tokens=450, ignore_eos=True)), timeout=60)
    next(it)
    s.loop.call_soon_threadsafe(s.stop.set)
    with pytest.raises(grpc.RpcError) as e:
        for m in it:
            assert not m.HasField("final")  # it cannot finish: the engine cancels it at once
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    s.thread.join(60)
    assert s.rc == 0 and s.engine.pool.used_blocks == 0


def test_sigterm_drains_and_exits_zero(tiny_model_dir, tmp_path):
    """The real command in its own process: SIGTERM during a request, health goes NOT_SERVING, exit 0."""
    import os
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "quant.cli", "serve", str(tiny_model_dir), "--grpc-port", "0",
                             "--http-port", "0", "--dtype", "float32", "--memory-budget", "4MiB", "--grace", "20"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ports = None
        for line in proc.stderr:
            m = re.search(r"grpc on [\d.]+:(\d+), http on [\d.]+:(\d+)", line)
            if m:
                ports = int(m.group(1)), int(m.group(2))
                break
        assert ports, "no 'serving' line"
        ch = grpc.insecure_channel(f"127.0.0.1:{ports[0]}")
        st = pb_grpc.InferenceStub(ch)
        it = st.GenerateStream(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(
            max_new_tokens=200, ignore_eos=True)), timeout=60)
        first = next(it)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert httpx.get(f"http://127.0.0.1:{ports[1]}/health").status_code == 503
        msgs = [first, *it]  # the in-flight request still completes within the grace period
        assert msgs[-1].final.finish_reason == "length"
        assert sum(len(m.token_ids) for m in msgs) == 200
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args,msg", [
    (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "nope.pem", "--tls-key", "nope.key"], "no such file"),
    (["--grpc-port", "-1", "--http-port", "-1"], "nothing to serve"),
    (["--http-port", "70000"], "--http-port must be in"),
    (["--grace", "-1"], "--grace must be >= 0"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be an integer >= 1"),
    (["--max-queue", "0"], "--max-queue must be an integer >= 1"),
    (["--api-key-file", "no-such-key-file"], "cannot read --api-key-file"),
    (["--kv-watermark", "1.5"], "--kv-watermark"),
    (["--kv-dtype", "float16"], "--kv-dtype float16: a float KV cache is held in the activations' dtype"),
    (["--kv-dtype", "int8", "--device", "cuda"], "--kv-dtype int8: a quantized KV cache is served on the CPU only"),
])
def test_serve_refuses_bad_flags_before_loading_anything(capsys, args, msg):
    from quant.cli import main

    assert main(["serve", "/nonexistent/model", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("quant serve: error:") and msg in err and len(err.splitlines()) == 1


def test_a_cancelled_wait_cancels_its_work():
    """A batch of prompts cancels its other prompts when one fails: the wait on a prompt's request, cancelled, must
    cancel the request too (the engine then frees its blocks), not leave it running."""
    import asyncio

    from server.openai_api import _unless_disconnected

    class Connected:
        async def is_disconnected(self):
            return False

    async def main():
        started, cancelled = asyncio.Event(), []

        async def work():
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        outer = asyncio.ensure_future(_unless_disconnected(Connected(), work()))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        return cancelled

    assert asyncio.run(main()) == [True]
