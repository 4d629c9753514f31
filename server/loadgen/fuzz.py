"""Fuzzing the service edge with hypothesis: malformed and extreme requests over HTTP and gRPC.

Every answer must be a refusal naming what is wrong (HTTP 400 / 411 / 413 with OpenAI's error body; gRPC
INVALID_ARGUMENT with a message) or a well-formed completion within the server's limits, and the server must
answer its health check after every request. ``fuzz_http`` / ``fuzz_grpc`` run ``n`` examples (derandomized:
the same requests every run) and return a count of outcomes; a violation raises with the request that caused
it (hypothesis shrinks it first).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import httpx
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

INT64 = (-(2**63), 2**63 - 1)

# Unicode that has broken tokenizers and servers before: NUL, zero-width and bidi controls, BOM, combining
# marks, ZWJ emoji sequences, the last code point, lone surrogates (JSON can carry them escaped; UTF-8 cannot).
EDGE_TEXT = ("", " ", "\x00", "\u200b\u200d", "\ufeff", "e\u0301\u0301", "\U0001f469\u200d\U0001f467",
             "\U0010ffff", "\u202eabc", "\r\n\t", "\U0001d518\U0001d52b", "\u0645\u0631\u062d\u0628\u0627")
SURROGATES = ("\ud800", "a\udfffb", "\udbff\udc00")  # the last pair is valid UTF-16, still not UTF-8 via JSON
HUGE_TEXT = ("word " * 20_000, "\u4e2d" * 30_000, "ab " * 700)  # over the byte limit / over the token limit

floats_any = st.floats(allow_nan=True, allow_infinity=True)
# Floats at the edges of float64 and float32, drawn on purpose (a uniform float draw rarely lands there): zeros, the
# smallest subnormals, values that are 0 or subnormal in fp32 (the logits' type) and just above, and the largest
# float32 and float64 values. Every float sampling field draws from these: a repetition_penalty of 2.1e-53 (0 in
# fp32) made the trace NaN and the response a 500, and only one hypothesis version's examples happened to hold one.
EXTREME_FLOATS = (0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 2.1e-53, 1e-45, 1.4e-45, 1e-40, 1e-38,
                  1.2e-38, 1e-30, 1e-7, 9.99e-7, 1e-6, 0.0099, 100.01, 1e30, 3.4028234663852886e38, 3.5e38, 1e300,
                  1.7976931348623157e308, -1e-45, -1e-300, -3.5e38, -1.7976931348623157e308)
floats_extreme = st.one_of(st.sampled_from(EXTREME_FLOATS), st.sampled_from(EXTREME_FLOATS).map(lambda x: -x),
                           floats_any)
garbage = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), floats_any, st.text(max_size=12),
                    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                               max_size=2))
texts = st.one_of(st.text(max_size=40), st.sampled_from(EDGE_TEXT),
                  st.lists(st.sampled_from(EDGE_TEXT), min_size=1, max_size=4).map("".join))


_ABSENT = object()
# A system prompt many valid requests begin with (several KV blocks' worth): the prefix cache shares its blocks
# between requests that run at once, are cancelled, fail or time out, and the server's pool must still balance.
SHARED_PREFIX = "You are a careful assistant who answers in plain words and checks each step twice. " * 3


def _sampling_fields(limit_new_tokens: int) -> dict[str, tuple]:
    """Per sampling field: (values the server must accept, extreme values it may refuse). Every numeric field
    of the client's list (quantserve.client.types.SAMPLING_TYPES) is here; tests/test_reliability.py holds it so."""
    return {
        "temperature": (st.one_of(st.just(0.0), st.floats(1e-6, 2)), floats_extreme),
        "top_p": (st.floats(0, 1), floats_extreme),
        "top_k": (st.integers(0, 100), st.integers(*INT64)),
        "seed": (st.integers(0, 2**63 - 1), st.integers(*INT64)),
        "repetition_penalty": (st.floats(0.5, 2), floats_extreme),
        "max_new_tokens": (st.integers(1, limit_new_tokens), st.integers(*INT64)),
        "min_tokens": (st.integers(0, 2), st.integers(-2, 2**40)),
        "ignore_eos": (st.booleans(), st.booleans()),
        "logprobs": (st.integers(0, 20), st.integers(*INT64)),
        "trace": (st.integers(1, 50), st.integers(-2, 60)),
        "min_p": (st.floats(0, 1), floats_extreme),
        "presence_penalty": (st.floats(-2, 2), floats_extreme),
        "frequency_penalty": (st.floats(-2, 2), floats_extreme),
        "logit_bias": (st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
                       st.dictionaries(st.integers(*INT64), floats_extreme, max_size=3)),
        "prompt_logprobs": (st.integers(0, 5), st.integers(*INT64)),
    }


def _field_values(draw, table: dict[str, tuple], mode: str, loose: bool) -> dict:
    """``mode`` "valid": some fields, all in range; "mutated": valid plus one or two extreme fields; "wild":
    any field may be extreme, or (``loose``: JSON) of the wrong type altogether."""
    out = {}
    names = sorted(table)
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    bad = set(draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=2))) if mode == "mutated" \
        else set()
    for name in sorted(set(chosen) | bad):
        good, extreme = table[name]
        if mode == "wild":
            strategy = st.one_of(good, extreme, garbage) if loose else st.one_of(good, extreme)
        else:
            strategy = extreme if name in bad else good
        out[name] = draw(strategy)
    return out


# An "edge" request is valid but for one float control set to a magnitude at float32's edges (0 or subnormal in
# fp32, just above, past the largest), with its trace and logprobs on: what the server accepts must give finite
# numbers, what it refuses it must name. Each run makes dozens of them, so every run meets such values whatever
# examples this hypothesis version's derandomized search makes (a uniform float draw almost never lands there).
EDGE_FIELDS = ("repetition_penalty", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "logit_bias")
EDGE_MAGNITUDES = (2.1e-53, 1e-45, 1e-40, 5e-324, 1e-38, 1e-30, 1e-7, 1e-6, 0.0099, 100.01, 3.5e38, 1e300)


def _edge_fields(draw, chat: bool, grpc_names: bool = False) -> dict:
    """The sampling fields of an edge request (HTTP's names, or the proto's with ``grpc_names``)."""
    field = draw(st.sampled_from(EDGE_FIELDS))
    value = draw(st.sampled_from(EDGE_MAGNITUDES))
    if field in ("presence_penalty", "frequency_penalty", "logit_bias") and draw(st.booleans()):
        value = -value
    out = {field: {draw(st.integers(0, 1000)): value} if field == "logit_bias" else value,
           "trace": draw(st.integers(1, 5)), "max_new_tokens" if grpc_names else "max_tokens": draw(st.integers(1, 3))}
    if grpc_names or not chat:
        out["logprobs"] = draw(st.integers(0, 5))
    else:
        out |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 5))}
    return out


@st.composite
def http_requests(draw, limit_new_tokens: int):
    """(path, body bytes, headers): JSON objects that are valid, at a float edge, mutated or wild, and some raw
    garbage."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = draw(st.sampled_from(["valid"] * 3 + ["edge"] * 4 + ["mutated"] * 3 + ["wild"] * 3
                                + ["raw", "non_object"]))
    headers = {"content-type": "application/json"}
    if kind == "raw":
        return path, draw(st.one_of(st.binary(max_size=64), st.just(b'{"prompt": "x", "max_tok'))), headers
    if kind == "non_object":
        return path, json.dumps(draw(garbage)).encode(), headers
    table = _sampling_fields(limit_new_tokens)
    table["max_tokens"] = table.pop("max_new_tokens")
    table["stop"] = (st.lists(st.text(min_size=1, max_size=4), max_size=3), st.lists(texts, max_size=20))
    table["stream"] = (st.booleans(), st.booleans())
    if chat:
        table["logprobs"] = (st.booleans(), st.booleans())
        table["top_logprobs"] = (st.integers(0, 20), st.integers(-1, 25))
    if kind == "edge":
        body = _edge_fields(draw, chat) | {"stream": draw(st.booleans()), "n": draw(st.integers(1, 2))}
    else:
        body = _field_values(draw, table, kind, loose=True)
    if chat and body.get("top_logprobs") is not None and kind == "valid":
        body["logprobs"] = True
    if kind != "edge" and draw(st.integers(0, 9)) == 0:  # n samples; a field we refuse by name, or do not know
        body[draw(st.sampled_from(["n", "best_of", "unknown_field"]))] = 2
    valid = kind in ("valid", "edge")  # the rest of the request (the prompt or messages)
    good_text = st.text(min_size=1, max_size=40).filter(lambda t: t.strip())
    if chat:
        role = st.sampled_from(["user", "system", "assistant"])
        if valid:
            message = st.fixed_dictionaries({"role": role, "content": good_text})
            system = st.just([{"role": "system", "content": SHARED_PREFIX}])
            body["messages"] = draw(st.one_of(st.just([]), system)) + draw(st.lists(message, min_size=1, max_size=3))
        else:
            message = st.fixed_dictionaries({
                "role": st.one_of(role, garbage),
                "content": st.one_of(texts, st.sampled_from(HUGE_TEXT[:1] + SURROGATES),
                                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                     "text": texts}), max_size=2), garbage)})
            messages = draw(st.one_of(st.just(_ABSENT), st.lists(message, max_size=3), garbage))
            if messages is not _ABSENT:
                body["messages"] = messages
    elif valid:
        body["prompt"] = draw(st.one_of(good_text, st.lists(st.integers(0, 40_000), min_size=1, max_size=6),
                                        good_text.map(lambda t: SHARED_PREFIX + t)))
    else:
        prompt = draw(st.one_of(st.just(_ABSENT), texts, st.sampled_from(HUGE_TEXT + SURROGATES),
                                st.lists(st.integers(-5, 2**40), max_size=6), st.lists(texts, min_size=1, max_size=2),
                                garbage))
        if prompt is not _ABSENT:
            body["prompt"] = prompt
    return path, json.dumps(body, allow_nan=True).encode(), headers  # NaN / Infinity literals on purpose


def _strict_json(text: str):
    """JSON as RFC 8259 has it: a NaN or Infinity (which json.loads would take) breaks the contract."""
    def refuse(name):
        raise AssertionError(f"non-finite number {name} in the response: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def check_http(r: httpx.Response, limit_new_tokens: int) -> str:
    """The outcome name, or AssertionError when the answer breaks the contract."""
    if r.status_code in (400, 411, 413):
        err = _strict_json(r.text)["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        return f"http {r.status_code}"
    assert r.status_code == 200, f"unexpected {r.status_code}: {r.text[:300]}"
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", r.text[-300:]
        chunks = [_strict_json(x) for x in lines[:-1]]
        assert not any("error" in c for c in chunks), r.text[-300:]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") or chunks[-1].get("usage")
        return "http 200 stream"
    j = _strict_json(r.text)
    n = len(j["choices"])  # the body's n (1 when absent)
    assert n >= 1 and [c["index"] for c in j["choices"]] == list(range(n)), j
    assert all(c["finish_reason"] in ("length", "stop") for c in j["choices"]), j
    assert 0 <= j["usage"]["completion_tokens"] <= n * limit_new_tokens and isinstance(j["seed"], int), j
    return "http 200"


def fuzz_http(base: str, n: int, limit_new_tokens: int, timeout: float = 60.0) -> Counter:
    seen: Counter = Counter()
    with httpx.Client(base_url=base, timeout=timeout) as c:
        @settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=http_requests(limit_new_tokens))
        def one(case):
            path, body, headers = case
            seen[check_http(c.post(path, content=body, headers=headers), limit_new_tokens)] += 1
            assert c.get("/health").status_code == 200, "the server stopped answering its health check"

        one()
    return seen


# ----------------------------------------------------------------------------------------------------- gRPC


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@st.composite
def grpc_requests(draw, limit_new_tokens: int):
    """(method, request message or raw bytes): valid, at a float edge, mutated or wild requests, and raw
    garbage."""
    method = draw(st.sampled_from(["Generate"] * 4 + ["GenerateStream"] * 3 + ["Tokenize", "raw"]))
    if method == "raw":
        return method, draw(st.binary(max_size=64))
    utext = st.one_of(texts, st.sampled_from(HUGE_TEXT)).filter(_utf8)
    if method == "Tokenize":
        return method, pb.TokenizeRequest(text=draw(utext))
    kind = draw(st.sampled_from(["valid", "edge", "edge", "mutated", "wild"]))
    if kind == "edge":
        kw = _edge_fields(draw, False, grpc_names=True)
    else:
        kw = _field_values(draw, _sampling_fields(limit_new_tokens), kind, loose=False)
    valid = kind in ("valid", "edge")
    stop = draw(st.lists(st.text(min_size=1, max_size=4).filter(_utf8), max_size=3) if valid
                else st.lists(texts.filter(_utf8), max_size=20))
    req = pb.GenerateRequest(sampling=pb.SamplingParameters(stop=stop, **kw))
    if kind == "edge" and method == "Generate":  # (a stream of n samples ends each with its own final message)
        req.n = draw(st.integers(1, 2))
    if valid:
        good_text = st.text(min_size=1, max_size=40).filter(lambda t: t.strip() and _utf8(t))
        part = draw(st.sampled_from(["prompt", "prompt_ids", "messages"]))
        if part == "prompt":
            req.prompt = draw(st.one_of(good_text, good_text.map(lambda t: SHARED_PREFIX + t)))
        elif part == "prompt_ids":
            req.prompt_ids.extend(draw(st.lists(st.integers(0, 40_000), min_size=1, max_size=8)))
        else:
            req.messages.add(role="user", content=draw(good_text))
        return method, req
    for part in draw(st.lists(st.sampled_from(["prompt", "prompt_ids", "messages", "request_id"]), max_size=2,
                              unique=True)):
        if part == "prompt":
            req.prompt = draw(utext)
        elif part == "prompt_ids":
            req.prompt_ids.extend(draw(st.lists(st.one_of(st.integers(0, 50_000), st.integers(*INT64)),
                                                max_size=8)))
        elif part == "messages":
            for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "system", "bogus", ""]),
                                                         utext), max_size=3)):
                req.messages.add(role=role, content=content)
        else:
            req.request_id = draw(st.text(max_size=8).filter(_utf8))
    return method, req


def _nonfinite(msg) -> list:
    """The NaN and infinite doubles anywhere in a protobuf message (logprobs, trace probabilities and figures)."""
    out = []
    for field, value in msg.ListFields():
        for v in ([value] if isinstance(value, (Message, str, bytes, int, float)) else value):  # else repeated
            if isinstance(v, Message):
                out += _nonfinite(v)
            elif isinstance(v, float) and not math.isfinite(v):
                out.append((field.name, v))
    return out


def check_grpc(method: str, stub, raw, req, limit_new_tokens: int, timeout: float) -> str:
    try:
        if method == "raw":
            raw(req, timeout=timeout)  # a random byte string may well be a valid (empty-ish) request
            return "grpc OK raw"
        if method == "Tokenize":
            stub.Tokenize(req, timeout=timeout)
            return "grpc OK tokenize"
        if method == "Generate":
            r = stub.Generate(req, timeout=timeout)
            assert not _nonfinite(r), (_nonfinite(r)[:5], req)
            final = r.final
        else:
            msgs = list(stub.GenerateStream(req, timeout=timeout))
            assert msgs and msgs[-1].HasField("final") and not any(m.HasField("final") for m in msgs[:-1])
            assert not any(_nonfinite(m) for m in msgs), ([_nonfinite(m) for m in msgs][:5], req)
            final = msgs[-1].final
        assert final.finish_reason in ("length", "stop"), final
        assert 0 <= final.usage.completion_tokens <= limit_new_tokens, final
        return "grpc OK"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or ""):
            return "grpc RESOURCE_EXHAUSTED (message size)"  # gRPC's own 413, before any handler runs
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details(), \
            f"{method}: {e.code().name} {e.details()} for {req!r:.300}"
        return "grpc INVALID_ARGUMENT"


def fuzz_grpc(target: str, n: int, limit_new_tokens: int, timeout: float = 60.0) -> Counter:
    seen: Counter = Counter()
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        raw = ch.unary_unary("/quantserve.v1.Inference/Generate")  # bytes in, bytes out: no (de)serializers
        health = health_pb2_grpc.HealthStub(ch)

        @settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=grpc_requests(limit_new_tokens))
        def one(case):
            method, req = case
            seen[check_grpc(method, stub, raw, req, limit_new_tokens, timeout)] += 1
            h = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING, "the server stopped serving"

        one()
    return seen
