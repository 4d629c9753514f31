"""Structured output end to end on the default model (the real thing: a random model never closes a string):
response_format JSON schema and JSON object through the openai SDK and gRPC, every seeded sample parsing and
validating, bad formats refused by name, and a constrained request beside free ones changing nothing for them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import pytest
from live_server import start
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

from quant.format import sources as models

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("xgrammar")

SCHEMA = {  # nested objects, arrays and enums; bounded strings so a sample ends within the token budget
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "teacher", "farmer", "doctor"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, role, tags and address."}]


@pytest.fixture(scope="module")
def server(cache_dir):
    s = start(str(models.resolve(None, cache_dir).path), cache_dir, memory_budget="512MiB", max_prefill_tokens=256)
    yield s
    s.shutdown()
    assert s.rc == 0


def test_twenty_seeded_samples_at_temperature_one_parse_and_validate(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)

    def ask(seed, n=10):  # n samples, seeds seed .. seed + n - 1
        return client.chat.completions.create(model="m", messages=ASK, temperature=1.0, seed=seed, n=n,
                                              max_tokens=160, response_format=FORMAT)

    with ThreadPoolExecutor(2) as pool:  # two requests at once
        replies = list(pool.map(ask, range(0, 20, 10)))
    texts = [c.message.content for r in replies for c in r.choices]
    assert len(texts) == 20
    for r in replies:
        assert all(c.finish_reason == "stop" for c in r.choices), [c.message.content for c in r.choices]
    docs = [json.loads(t) for t in texts]
    for d in docs:
        jsonschema.validate(d, SCHEMA)
        assert list(d) == list(SCHEMA["properties"]), "the schema's property order"
    assert len({json.dumps(d) for d in docs}) > 16  # seeded samples differ
    again = ask(10, n=3)  # seeded: the same seeds alone give the same documents (a sample's seed is seed + i)
    assert [c.message.content for c in again.choices] == texts[10:13]
    server.assert_idle()


def test_json_object_mode_and_a_free_request_beside_it(server):
    body = {"messages": [{"role": "user", "content": "Reply with a JSON object with one key, city, naming a city."}],
            "max_tokens": 60, "temperature": 0.0}
    free = httpx.post(server.http + "/v1/chat/completions", json=body, timeout=120).json()
    with ThreadPoolExecutor(2) as pool:
        obj, free2 = pool.map(lambda b: httpx.post(server.http + "/v1/chat/completions", json=b, timeout=120).json(),
                              [{**body, "response_format": {"type": "json_object"}}, body])
    assert obj["choices"][0]["finish_reason"] == "stop", obj
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    assert free2["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]
    g = pb_grpc.InferenceStub(grpc.insecure_channel(server.grpc_target)).Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])], sampling=pb.SamplingParameters(
            temperature=0.0, max_new_tokens=120, response_format=json.dumps(FORMAT))), timeout=120)
    jsonschema.validate(json.loads(g.text), SCHEMA)
    server.assert_idle()


@pytest.mark.parametrize("fmt,param,words", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "response_format", "not supported"),
    ({"type": "yaml"}, "response_format", "type must be"),
    ({"type": "json_schema"}, "response_format", "needs"),
])
def test_bad_response_formats_are_refused_naming_them(server, fmt, param, words):
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "response_format": fmt},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.InferenceStub(grpc.insecure_channel(server.grpc_target)).Generate(pb.GenerateRequest(
            prompt="x", sampling=pb.SamplingParameters(max_new_tokens=4, response_format=json.dumps(fmt))), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    r = httpx.post(server.http + "/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 4, "min_tokens": 2, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    server.assert_idle()
