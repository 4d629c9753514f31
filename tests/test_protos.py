"""The committed gRPC stubs are exactly what scripts/gen_protos.sh generates from protos/, and the proto's
sampling controls are the one list every layer derives from (quantserve.client.types.Sampling)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools")
    # this interpreter's grpcio-tools (the one importorskip found), not whatever python is first on PATH
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHON": sys.executable})
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh, "nothing generated"
    for rel in fresh:
        committed = ROOT / "clients" / rel
        assert committed.is_file(), f"{rel} is generated but not committed"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} differs from protos/: run scripts/gen_protos.sh and commit the result")


@pytest.mark.e2e
def test_stubs_import_without_torch():
    code = ("import sys; import quantserve.v1.inference_pb2_grpc; "
            "assert 'torch' not in sys.modules, 'the stubs pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------ the one list of sampling controls
# quantserve.client.types.Sampling is the source; the proto and the engine's SamplingParams declare the same controls (a
# layer each), and every transport's field list is derived from it.

@pytest.mark.unit
def test_the_proto_and_the_engine_have_the_clients_sampling_controls():
    from google.protobuf.descriptor import FieldDescriptor
    from quantserve.client.types import SAMPLING_FIELDS, SAMPLING_TYPES, Sampling
    from quantserve.v1 import inference_pb2 as pb

    from server.sampling_params import SamplingParams

    proto = pb.SamplingParameters.DESCRIPTOR.fields
    assert tuple(f.name for f in proto) == SAMPLING_FIELDS  # same names, in the proto's order
    scalar = {FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_INT64: int, FieldDescriptor.TYPE_BOOL: bool,
              FieldDescriptor.TYPE_STRING: str}
    for f in proto:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:  # logit_bias: id -> bias
            assert SAMPLING_TYPES[f.name] is dict, f.name
            key, value = f.message_type.fields
            assert (key.type, value.type) == (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_DOUBLE), f.name
        elif f.is_repeated:
            assert SAMPLING_TYPES[f.name] is tuple and f.type == FieldDescriptor.TYPE_STRING, f.name
        else:
            assert SAMPLING_TYPES[f.name] is scalar[f.type], f.name
            assert f.has_presence, f"{f.name}: optional, so that unset means the server's default"
    assert tuple(f.name for f in dataclasses.fields(SamplingParams)) == SAMPLING_FIELDS
    assert Sampling().given() == {}


@pytest.mark.unit
def test_every_transport_reads_and_writes_every_control():
    """One request with every control set goes through each transport's conversion unchanged."""
    from quantserve.client import make_sampling
    from quantserve.client.transport_grpc import request_to_proto
    from quantserve.client.transport_http import path_and_body
    from quantserve.client.types import SAMPLING_FIELDS, Request

    from server.grpc_server import params_from_proto
    from server.openai_api import ChatBody, CompletionBody, params_from_body

    values = dict(temperature=0.5, top_k=7, top_p=0.9, repetition_penalty=1.1, seed=3, max_new_tokens=9,
                  min_tokens=0, ignore_eos=True, stop=("x", "y"), logprobs=4, trace=5, min_p=0.25,  # 0: response_format
                  presence_penalty=-0.5, frequency_penalty=1.5, logit_bias={7: -100.0, 12: 2.5}, prompt_logprobs=2,
                  response_format='{"type":"json_schema","json_schema":{"schema":{"type":"object","properties":'
                                  '{"b":{"type":"integer"},"a":{"type":"string"}}}}}', speculate=False)
    assert set(values) == set(SAMPLING_FIELDS), "a new control: add it here"
    s = make_sampling(**values)
    assert s.given() == values
    values["logit_bias"] = ((7, -100.0), (12, 2.5))  # the engine's params keep (id, bias) pairs sorted by id

    got = params_from_proto(request_to_proto(Request(prompt="p", sampling=s)).sampling, 128)
    assert {f: getattr(got, f) for f in SAMPLING_FIELDS} == values

    _, body = path_and_body(Request(prompt="p", sampling=s), stream=False)
    b = CompletionBody.model_validate_json(json.dumps(body))
    got = params_from_body(b, b.max_tokens, b.logprobs)
    assert {f: getattr(got, f) for f in SAMPLING_FIELDS} == values

    _, body = path_and_body(Request(messages=(), sampling=s), stream=False)
    body["messages"] = [{"role": "user", "content": "p"}]
    b = ChatBody.model_validate_json(json.dumps(body))
    got = params_from_body(b, b.max_tokens, b.top_logprobs if b.logprobs else None)
    assert {f: getattr(got, f) for f in SAMPLING_FIELDS} == values


@pytest.mark.unit
def test_the_client_cli_has_a_flag_per_control():
    from quantserve.client.cli import build_parser
    from quantserve.client.types import SAMPLING_FIELDS

    gen = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert set(SAMPLING_FIELDS) - gen == {"trace"}  # the trace command's own --trace-n


@pytest.mark.unit
def test_the_trace_has_the_samplers_stages_on_every_layer():
    """The sampler's stages and stats (server.sampling.TRACE_STAGES / TRACE_STATS) are the engine's TraceStep, the
    proto's, the client's, and the keys of the HTTP body (which the client parses with trace_from_dict)."""
    from quantserve.client import types
    from quantserve.v1 import inference_pb2 as pb

    from server import outputs
    from server.sampling import TRACE_STAGES, TRACE_STATS

    assert tuple(f.name for f in dataclasses.fields(outputs.TraceStep)) == TRACE_STAGES + TRACE_STATS + ("draft",)
    wire = {f"after_{s}" for s in TRACE_STAGES} | set(TRACE_STATS) | {"draft_token_id", "draft_token"}
    assert {f.name for f in pb.TraceStep.DESCRIPTOR.fields} == wire
    assert {f.name for f in dataclasses.fields(types.TraceStep)} == wire
    assert types.TRACE_STAGES == TRACE_STAGES
    assert {f"{k}_{c}" for k in ("kept", "mass") for c in types.TRACE_CONTROLS} | {"entropy"} == set(TRACE_STATS)


@pytest.mark.unit
def test_a_traced_steps_draft_reaches_both_transports_and_the_table():
    """A step speculation drafted for carries the drafted token through gRPC and HTTP to the client's TraceStep and
    the trace table (accepted when drawn, rejected otherwise); an undrafted step carries none."""
    import json
    from types import SimpleNamespace

    from quantserve.client import transport_grpc
    from quantserve.client.render import trace_table
    from quantserve.client.types import TokenLogprob, trace_from_dict
    from rich.console import Console

    from server import grpc_server, openai_api, outputs

    svc = SimpleNamespace(token_text=lambda i: f"tok{i}")
    cands = ((5, 0.6), (9, 0.4))
    stats = dict(kept_min_p=2, kept_top_k=2, kept_top_p=2, mass_min_p=1.0, mass_top_k=1.0, mass_top_p=1.0,
                 entropy=0.67)
    steps = tuple(outputs.TraceStep(cands, cands, cands, cands, cands, **stats, draft=d) for d in (5, 9, None))
    via_grpc = transport_grpc._trace(grpc_server._trace(svc, steps))
    via_http = tuple(trace_from_dict(d) for d in json.loads(json.dumps(openai_api._trace(svc, steps))))
    assert via_grpc == via_http
    assert [(t.draft_token_id, t.draft_token) for t in via_grpc] == [(5, "tok5"), (9, "tok9"), (None, None)]
    console = Console(width=300, record=True)
    for t in via_grpc:
        console.print(trace_table(0, t, TokenLogprob(5, "tok5", -0.51, ()), 2))
    text = console.export_text()
    assert "drafted 'tok5': accepted" in text and "drafted 'tok9': rejected" in text and text.count("drafted") == 2
