"""The client's pure parts, no server: sweep metrics (hand-computed values), error mapping, request building,
SSE parsing, sweep files and the PNG sizes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from quantserve.client.errors import (
    ClientError,
    from_grpc,
    from_http,
    param_from_message,
)
from quantserve.client.metrics import (
    cell_metrics,
    distinct_n,
    ngrams,
    pooled_mean,
    repeats,
    repetition_rate,
)
from quantserve.client.types import (
    Candidate,
    EngineMemory,
    MemoryAccounting,
    Message,
    Request,
    Result,
    Sampling,
    TokenLogprob,
    TraceStep,
    Usage,
    to_dict,
    trace_from_dict,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_importing_the_client_loads_no_torch_server_or_transformers():
    code = ("import sys, quantserve.client, quantserve.client.cli, quantserve.client.plot, quantserve.client.sweep, quantserve.client.render; "
            "bad = [m for m in ('torch', 'server', 'transformers', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad; print('clean')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr


# ------------------------------------------------------------------------------------------ metrics


@pytest.mark.unit
def test_ngrams_and_distinct_n_by_hand():
    assert ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)] and ngrams([1], 2) == []
    assert distinct_n([[1, 2, 1, 2]], 1) == pytest.approx(2 / 4)
    assert distinct_n([[1, 2, 1, 2]], 2) == pytest.approx(2 / 3)  # (1,2) (2,1) (1,2)
    # pooled over sequences, n-grams never cross a boundary: [1,2] + [2,1] -> (1,2), (2,1): 2 unique of 2;
    # a boundary-crossing (2,2) would have made it 3 n-grams
    assert distinct_n([[1, 2], [2, 1]], 2) == pytest.approx(1.0)
    # two seeds giving the same tokens halve distinct-1: {7, 8} of 4 tokens
    assert distinct_n([[7, 8], [7, 8]], 1) == pytest.approx(0.5)
    assert math.isnan(distinct_n([[], [5]], 2)) and math.isnan(distinct_n([], 1))
    with pytest.raises(ValueError):
        ngrams([1], 0)


@pytest.mark.unit
def test_repetition_rate_by_hand():
    assert repeats([5, 6, 5, 5]) == 2
    assert repetition_rate([[5, 6, 5, 5], [7]]) == pytest.approx(2 / 5)
    assert repetition_rate([[1, 2], [1, 2]]) == 0.0  # a token seen only in another request is no repeat
    assert repetition_rate([["a", "b", "a"]]) == pytest.approx(1 / 3)  # token texts work as keys too (HTTP)
    assert math.isnan(repetition_rate([[]]))


@pytest.mark.unit
def test_pooled_mean_weighs_every_value_the_same():
    assert pooled_mean([[1.0, 2.0, 3.0], [10.0]]) == pytest.approx(16 / 4)
    assert math.isnan(pooled_mean([[], []]))


def _result(ids, lps, entropies, reserved, used, peak, http=False) -> Result:
    mem = MemoryAccounting(512, 2, reserved, used, peak, "sdpa", EngineMemory(1, 2, 0, 16, 0, 0))
    return Result(request_id="r", text="", token_ids=None if http else tuple(ids), finish_reason="length", stop=None,
                  seed=0, usage=Usage(3, len(ids)), memory=mem,
                  logprobs=tuple(TokenLogprob(None if http else i, f"t{i}", lp) for i, lp in zip(ids, lps)),
                  trace=tuple(TraceStep((), (), (), (), (), 10, 10, 5, 1.0, 1.0, 0.9, e) for e in entropies))


@pytest.mark.unit
@pytest.mark.parametrize("http", [False, True])
def test_cell_metrics_by_hand(http):
    a = _result([1, 2, 1], [-1.0, -2.0, -3.0], [0.5, 1.5, 1.0], 1000, 300, 50, http)
    b = _result([3, 3], [-4.0, -5.0], [2.0, 2.0], 2000, 500, 70, http)
    m = cell_metrics([a, b])
    assert m.requests == 2 and m.mean_length == pytest.approx(2.5)
    assert m.distinct_1 == pytest.approx(3 / 5)  # {1, 2, 3} of 5 tokens
    assert m.distinct_2 == pytest.approx(3 / 3)  # (1,2) (2,1) | (3,3)
    assert m.repetition_rate == pytest.approx(2 / 5)  # the second 1, the second 3
    assert m.mean_logprob == pytest.approx(-15 / 5) and m.mean_entropy == pytest.approx(7 / 5)
    assert (m.kv_bytes_reserved, m.kv_bytes_used, m.activation_peak_bytes) == (1500, 400, 60)


# ------------------------------------------------------------------------------------------ errors


class _FakeRpcError(Exception):
    def __init__(self, name, details):
        self.name, self._details = name, details

    def code(self):
        import grpc

        return getattr(grpc.StatusCode, self.name)

    def details(self):
        return self._details


@pytest.mark.unit
@pytest.mark.parametrize("name,details,code,param", [
    ("INVALID_ARGUMENT", "top_p must be in [0, 1], got 2.0", "invalid_argument", "top_p"),
    ("INVALID_ARGUMENT", "messages[0].role must be one of system, user", "invalid_argument", "messages"),
    ("INVALID_ARGUMENT", "request id 'x' is already in use", "invalid_argument", None),
    ("UNAVAILABLE", "the server is draining and takes no new requests", "unavailable", None),
    ("UNAVAILABLE", "failed to connect to all addresses; last error: Connection refused", "connection", None),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", "deadline_exceeded", None),
    ("UNAUTHENTICATED", "missing or invalid API key", "unauthenticated", None),
    ("RESOURCE_EXHAUSTED", "queue full", "resource_exhausted", None),
    ("INTERNAL", "internal error", "internal", None),
    ("UNKNOWN", "boom", "internal", None),
])
def test_grpc_status_maps_to_one_code(name, details, code, param):
    e = from_grpc(_FakeRpcError(name, details))
    assert (e.code, e.param, e.message) == (code, param, details) and str(e) == f"{code}: {details}"


@pytest.mark.unit
@pytest.mark.parametrize("status,body,code,param", [
    (400, {"error": {"message": "top_p must be in [0, 1], got 2.0", "param": "top_p", "code": 400}},
     "invalid_argument", "top_p"),
    (400, {"error": {"message": "max_tokens: Input should be a valid integer", "param": "max_tokens"}},
     "invalid_argument", "max_new_tokens"),  # HTTP's spelling -> the proto's
    (401, {"error": {"message": "missing or invalid API key", "param": None}}, "unauthenticated", None),
    (429, {"error": {"message": "queue full"}}, "resource_exhausted", None),
    (503, {"error": {"message": "draining"}}, "unavailable", None),
    (504, {"error": {"message": "deadline"}}, "deadline_exceeded", None),
    (500, {"error": {"message": "internal error"}}, "internal", None),
    (404, "Not Found", "internal", None),
])
def test_http_status_maps_to_the_same_codes(status, body, code, param):
    e = from_http(status, body)
    assert (e.code, e.param) == (code, param) and e.status == status
    assert param_from_message("temperature must be finite and >= 0, got -1") == "temperature"


@pytest.mark.unit
def test_sampling_is_type_checked_and_unset_fields_are_not_sent():
    from quantserve.client.client import make_sampling
    from quantserve.client.transport_grpc import request_to_proto
    from quantserve.client.transport_http import path_and_body

    s = make_sampling(temperature=1, top_k=5, stop="END", max_new_tokens=None)
    assert s == Sampling(temperature=1.0, top_k=5, stop=("END",)) and s.given() == {
        "temperature": 1.0, "top_k": 5, "stop": ("END",)}
    for bad in ({"temperature": "hot"}, {"top_k": 2.5}, {"ignore_eos": 1}, {"seed": True}, {"stop": [1]}):
        with pytest.raises(ClientError) as ei:
            make_sampling(**bad)
        assert ei.value.code == "invalid_argument" and ei.value.param == next(iter(bad))
    with pytest.raises(TypeError, match="unknown sampling"):
        make_sampling(temprature=1.0)
    p = request_to_proto(Request(prompt="x", sampling=Sampling(top_p=0.5, logprobs=2)))
    assert p.sampling.HasField("top_p") and not p.sampling.HasField("temperature") and p.prompt == "x"
    path, body = path_and_body(Request(prompt_ids=(1, 2), sampling=Sampling(max_new_tokens=4, logprobs=2)), False)
    assert (path, body) == ("/v1/completions", {"prompt": [1, 2], "max_tokens": 4, "logprobs": 2})
    path, body = path_and_body(Request(messages=(Message("user", "hi"),), sampling=Sampling(logprobs=3)), True)
    assert path == "/v1/chat/completions" and body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["stream_options"] == {"include_usage": True} and body["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.unit
def test_sse_events_join_into_one_result_and_errors_in_the_stream_raise():
    from quantserve.client.transport_http import _Events

    step = {"after_penalties": [], "after_temperature": [{"token_id": 4, "token": "a", "prob": 0.5}],
            "after_top_k": [], "after_top_p": [], "after_min_p": [], "kept_top_k": 9, "kept_top_p": 3, "kept_min_p": 20,
            "mass_top_k": 0.9, "mass_top_p": 0.6, "mass_min_p": 0.95, "entropy": 1.2}
    lines = [
        'data: ' + json.dumps({"id": "c1", "choices": [{"text": "He", "finish_reason": None}], "seed": 5,
                               "trace": [step]}),
        "",
        'data: ' + json.dumps({"id": "c1", "choices": [{"text": "llo", "finish_reason": "length"}], "seed": 5,
                               "stop": None, "memory": {"kv_bytes_reserved": 10, "kv_bytes_used": 4,
                                                        "engine": {"kv_block_size": 16}}}),
        'data: ' + json.dumps({"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}),
        "data: [DONE]",
    ]
    ev, chunks = _Events(None), []
    for line in lines:
        chunks += ev.feed(line)
    assert [c.text for c in chunks] == ["He", "llo"] and chunks[0].result is None
    r = chunks[-1].result
    assert (r.text, r.seed, r.usage, r.finish_reason, r.token_ids) == ("Hello", 5, Usage(2, 2), "length", None)
    assert r.memory.kv_bytes_used == 4 and r.memory.engine.kv_block_size == 16
    assert r.trace == (trace_from_dict(step),) and to_dict(r.trace[0])["after_temperature"][0]["token_id"] == 4
    with pytest.raises(ClientError) as ei:
        _Events(None).feed('data: {"error": {"message": "the server stopped", "code": 503}}')
    assert ei.value.code == "unavailable"


# ------------------------------------------------------------------------------------------ files and plots


@pytest.mark.unit
def test_sweep_files_round_trip_and_plots_have_the_documented_size(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread
    from quantserve.client import plot
    from quantserve.client.metrics import CellMetrics
    from quantserve.client.sweep import (
        COLUMNS,
        SweepRow,
        SweepSpec,
        read_rows,
        write_csv,
        write_json,
    )

    spec = SweepSpec("p", (0.0, 1.0), (0, 5), (1.0, 0.5), seeds=2)
    rows = [SweepRow(t, k, p, CellMetrics(2, 4.0, 0.5 + t / 4, math.nan if k else 0.25 * p, 0.1, -3.0, 1.0 * t,
                                          100, 50, 70)) for t, k, p in spec.cells()]
    write_csv(rows, tmp_path / "s.csv")
    write_json(rows, tmp_path / "s.json", spec, "grpc")
    from_csv, from_json = read_rows(tmp_path / "s.csv"), read_rows(tmp_path / "s.json")
    assert len(from_csv) == len(from_json) == 8 and list(from_csv[0]) == list(COLUMNS)
    for a, b in zip(from_csv, from_json):
        assert a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)
    assert plot.plot_sweep(from_json, "distinct_1", str(tmp_path / "s.png")) == 2
    assert imread(tmp_path / "s.png").shape[:2] == plot.sweep_png_size(2)[::-1] == (400, 900)
    plot.plot_sweep(from_csv, "distinct_2", str(tmp_path / "nan.png"))  # NaN cells stay blank, no error
    with pytest.raises(ValueError, match="not in the sweep file"):
        plot.plot_sweep(from_csv, "nope", str(tmp_path / "x.png"))

    step = TraceStep(tuple(Candidate(i, f"t{i}", 0.25 / (i + 1)) for i in range(6)),
                     tuple(Candidate(i, f"t{i}", 0.3 / (i + 1)) for i in range(6)),
                     tuple(Candidate(i, f"t{i}", 0.4 / (i + 1)) for i in range(5)),
                     tuple(Candidate(i, f"t{i}", 0.6 / (i + 1)) for i in range(3)),
                     tuple(Candidate(i, f"t{i}", 0.7 / (i + 1)) for i in range(2)), 5, 3, 2, 0.9, 0.7, 0.5, 0.9)
    plot.plot_trace_step(step, str(tmp_path / "t.png"), "step 0")
    assert imread(tmp_path / "t.png").shape[:2] == plot.trace_png_size()[::-1] == (450, 900)
