"""Reliability of the service edge on the tiny model: fuzz (400 requests over both transports), 64 streaming
clients with 20% cancelled over three rounds, SIGTERM under load, TLS end to end. Loopback only, bounded.

The drivers are server/loadgen's; bench/reliability.py runs the long versions."""

from __future__ import annotations

import asyncio
import ssl
import time

import grpc
import httpx
import live_server
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_server import self_signed_cert, start
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

from server.config import Limits
from server.loadgen.drive import ServerProcess, drain_under_load, load_round, reference_texts, wait_idle
from server.loadgen.fuzz import fuzz_grpc, fuzz_http

pytestmark = pytest.mark.e2e

LIMIT_NEW = 32
LIMITS = Limits(max_new_tokens=LIMIT_NEW, max_request_bytes=64 * 1024)

server = live_server.module_server(limits=LIMITS)


def assert_idle_and_healthy(s) -> None:
    assert wait_idle(s.http) == 0  # what an operator sees on /metrics
    s.assert_idle()
    assert httpx.get(s.http + "/health", timeout=10).status_code == 200
    h = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.grpc_target)).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert h.status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------------------------ fuzz


def test_the_fuzzers_draw_extreme_values_for_every_numeric_sampling_field():
    """Every numeric control of the client's list is fuzzed, and every float one (logit_bias's values too) from
    the edges of float64 and float32 (subnormals, values that are 0 in fp32, the largest floats) on every run,
    whatever examples this hypothesis version's derandomized search happens to make."""
    from quantserve.client.types import SAMPLING_TYPES

    from server.loadgen.fuzz import EDGE_FIELDS, EDGE_MAGNITUDES, EXTREME_FLOATS, _sampling_fields, floats_extreme

    table = _sampling_fields(LIMIT_NEW)
    numeric = {f for f, t in SAMPLING_TYPES.items() if t in (int, float, dict)}
    assert numeric <= set(table), numeric - set(table)
    floats = {f for f, t in SAMPLING_TYPES.items() if t is float}
    assert all(table[f][1] is floats_extreme for f in floats)
    assert set(EDGE_FIELDS) == floats | {"logit_bias"}  # the "edge" requests: one float control at an edge
    assert {2.1e-53, 5e-324, 1e-45, 1e-40, 3.5e38} <= set(EXTREME_FLOATS) & set(EDGE_MAGNITUDES)


def test_fuzz_http(server):
    hits = server.engine.totals().prefix_hit_tokens
    seen = fuzz_http(server.http, 200, LIMIT_NEW)
    print(dict(seen))
    assert sum(seen.values()) == 200, seen
    # The generator must reach both sides of the contract, or it tests nothing; and shared KV blocks, or the
    # pool's recount at the end (assert_idle) checks no sharing.
    assert seen["http 400"] >= 35 and seen["http 200"] + seen["http 200 stream"] >= 10, seen
    assert server.engine.totals().prefix_hit_tokens > hits
    assert_idle_and_healthy(server)


def test_fuzz_grpc(server):
    hits = server.engine.totals().prefix_hit_tokens
    seen = fuzz_grpc(server.grpc_target, 200, LIMIT_NEW)
    print(dict(seen))
    assert sum(seen.values()) == 200, seen
    assert seen["grpc INVALID_ARGUMENT"] >= 35 and seen["grpc OK"] >= 10, seen
    assert server.engine.totals().prefix_hit_tokens > hits
    assert_idle_and_healthy(server)


# ------------------------------------------------------------------------------------------------ load


def test_load_64_streams_20pct_cancelled_three_rounds(tiny_model_dir):
    """In its own process, so the resident memory measured is the server's alone."""
    new = 16
    srv = ServerProcess(str(tiny_model_dir), "--dtype", "float32", "--memory-budget", "8MiB", "--max-batch", "64",
                        "--threads", "1", env={"OMP_NUM_THREADS": "1"}, timeout=120)
    try:
        ref = reference_texts(srv.http, range(64), new)
        rss = []
        for _ in range(3):
            r = asyncio.run(load_round(srv.grpc_target, srv.http, clients=64, max_new_tokens=new, timeout=240))
            assert r.failures == [], r.failures[:5]
            assert (r.completed, r.cancelled) == (51, 13)  # seeds 0, 5, ..., 60 cancel after their second chunk
            # Batched with 63 others, cut short neighbours and all, each request gives what it gives alone.
            assert r.texts == {s: ref[s] for s in r.texts}
            assert wait_idle(srv.http) == 0  # the KV pool is back at zero
            time.sleep(0.5)  # the engine trims its heap when it goes idle, just after the pool empties
            rss.append(srv.rss_bytes())
        print("server RSS per round (MiB):", [round(x / 2**20, 1) for x in rss])
        assert (rss[2] - rss[1]) / rss[1] < 0.05, rss
        assert httpx.get(srv.http + "/health", timeout=10).status_code == 200
        srv.sigterm()
        assert srv.wait(60) == 0
    finally:
        srv.kill()


# ----------------------------------------------------------------------------------------------- drain


@pytest.mark.parametrize("grace", [60.0, 0.0], ids=["grace-finishes-all", "no-grace-cuts-the-long"])
def test_sigterm_under_load_ends_every_request_cleanly(tiny_model_dir, grace):
    """SIGTERM once 16 streams (both transports) have their first chunk: new requests are refused, none hangs, the
    process exits 0, and every stream either completes or ends with UNAVAILABLE / 503. What ends which way is held
    without a race against the machine's speed: a grace of 60 s lets every request (6 or 40 tokens) finish; a
    grace of 0 cuts every 450-token one (a short one may still finish in the moment before the cut)."""
    srv = ServerProcess(str(tiny_model_dir), "--dtype", "float32", "--memory-budget", "8MiB", "--grace", str(grace),
                        "--threads", "1", env={"OMP_NUM_THREADS": "1"}, timeout=120)
    try:
        d = asyncio.run(drain_under_load(srv, clients=16, short_tokens=6, long_tokens=40 if grace else 450,
                                         timeout=90))
    finally:
        srv.kill()
    assert d.failures == [] and d.exit_code == 0 and d.refused_after_sigterm, d
    assert d.completed + d.unavailable == 16, d
    if grace:
        assert d.completed == 16, d
    else:
        assert d.unavailable >= 8, d  # the eight long ones at least


# ------------------------------------------------------------------------------------------------- TLS


def test_tls_on_both_transports(tiny_model_dir, cache_dir, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    s = start(tiny_model_dir, cache_dir, tls=(cert, key), api_key="k3y")
    try:
        body = {"prompt": "Secure", "max_tokens": 4, "seed": 1}
        r = httpx.post(f"https://127.0.0.1:{s.ports['http']}/v1/completions", json=body, verify=ssl.create_default_context(cafile=cert),
                       headers={"authorization": "Bearer k3y"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate is refused
            httpx.post(f"https://127.0.0.1:{s.ports['http']}/v1/completions", json=body, timeout=10)
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port gets no answer
            httpx.post(f"http://127.0.0.1:{s.ports['http']}/v1/completions", json=body, timeout=10)

        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        st = pb_grpc.InferenceStub(grpc.secure_channel(s.grpc_target, creds))
        g = st.Generate(pb.GenerateRequest(prompt="Secure", sampling=pb.SamplingParameters(max_new_tokens=4, seed=1)),
                        metadata=[("authorization", "Bearer k3y")], timeout=60)
        assert g.text == r.json()["choices"][0]["text"]
        with pytest.raises(grpc.RpcError) as e:  # plaintext to the TLS port
            pb_grpc.InferenceStub(grpc.insecure_channel(s.grpc_target)).Generate(
                pb.GenerateRequest(prompt="x"), metadata=[("authorization", "Bearer k3y")], timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.shutdown()
    assert s.rc == 0
