"""End-to-end: the Python client and `quant-client` against a real server (tiny model, both transports, an API
key) on loopback. Every command runs over gRPC and HTTP in-process (quantserve.client.cli.main), plus one real
subprocess; results must agree between transports for the same seed; errors are one line and a distinct exit
status."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import live_server
import pytest
from live_server import self_signed_cert, start
from quantserve.client import AsyncClient, Client, ClientError, to_dict
from quantserve.client.cli import main

from server.loadgen.drive import metric_sum

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
KEY = "k3y-for-tests"
TRANSPORTS = ("grpc", "http")

server = live_server.module_server(api_key=KEY)
_pool_back_to_zero = live_server.pool_back_to_zero


def target(server, transport: str) -> str:
    return server.http if transport == "http" else server.grpc_target


def client(server, transport: str, **kw) -> Client:
    return Client(target(server, transport), http=transport == "http", api_key=KEY, **kw)


def cli(capsys, server, transport: str, command: str, *args: str, key: str | None = KEY):
    """Run `quant-client COMMAND --target ... ARGS` in-process: (exit status, stdout, stderr)."""
    flags = ["--target", target(server, transport)] + (["--http"] if transport == "http" else [])
    flags += ["--api-key", key] if key else []
    rc = main([command, *flags, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def comparable(r):
    """A result without what legitimately differs between calls and transports (timings, request id, the ids
    of logprob alternatives: an HTTP completion keys them by text, what the prefix cache held when it arrived)."""
    d = to_dict(r)
    for k in ("ttft_s", "duration_s", "request_id", "transport"):
        d.pop(k)
    d["usage"].pop("cached_tokens")
    if d["memory"]:
        for k in ("kv_bytes_shared", "kv_bytes_own", "prompt_tokens_cached", "activation_peak_bytes"):
            d["memory"].pop(k)
        for k in ("kv_cached_bytes", "prefix_hit_tokens", "prefix_queried_tokens", "prefix_evictions"):
            d["memory"]["engine"].pop(k)
    for lp in d["logprobs"]:
        lp.pop("token_id")
        lp["top"] = sorted((a["token"], a["logprob"]) for a in lp["top"])
    return d


SAMPLING = dict(temperature=0.9, top_k=50, top_p=0.95, seed=3, max_new_tokens=6, logprobs=2, trace=3)


# ------------------------------------------------------------------------------------------ Python client


def test_results_are_equal_between_transports_and_streams_equal_unary(server):
    results = {}
    for t in TRANSPORTS:
        with client(server, t) as c:
            r = c.generate("The river", **SAMPLING)
            chunks = list(c.stream("The river", **SAMPLING))
            chat = c.chat([{"role": "user", "content": "Hi there"}], seed=4, max_new_tokens=5)
        assert chunks[-1].result is not None and all(ch.result is None for ch in chunks[:-1])
        assert "".join(ch.text for ch in chunks) == r.text
        assert comparable(chunks[-1].result) == comparable(r)
        assert len(r.logprobs) == len(r.trace) == r.usage.completion_tokens and r.seed == 3
        results[t] = (r, chat)
    (g, gchat), (h, hchat) = results["grpc"], results["http"]
    assert comparable(g) == comparable(h) and comparable(gchat) == comparable(hchat)
    assert len(g.token_ids) == g.usage.completion_tokens and h.token_ids == g.token_ids
    assert [lp.token_id for lp in g.logprobs] == list(g.token_ids)
    assert g.ttft_s > 0 and g.duration_s >= g.ttft_s and h.duration_s >= h.ttft_s > 0
    assert g.memory.kv_bytes_reserved >= g.memory.kv_bytes_used > 0 and g.memory.engine.kv_capacity_bytes > 0
    # trace: top_k=50 keeps 50 tokens, top_p keeps a subset of them; masses are ordered
    for s in g.trace:
        assert s.kept_top_k == 50 and 1 <= s.kept_top_p <= 50 and 1.0 + 1e-6 >= s.mass_top_k >= s.mass_top_p
        assert len(s.after_temperature) == 3


def test_async_client_over_both_transports(server):
    async def run(t):
        async with AsyncClient(target(server, t), http=t == "http", api_key=KEY) as c:
            r = await c.generate("The river", **SAMPLING)
            chunks = [ch async for ch in c.stream("The river", **SAMPLING)]
            info = await c.info()
            return r, chunks, info

    for t in TRANSPORTS:
        r, chunks, info = asyncio.run(run(t))
        with client(server, t) as c:
            assert comparable(r) == comparable(c.generate("The river", **SAMPLING))
        assert comparable(chunks[-1].result) == comparable(r) and info.context_length == 512


def test_python_client_errors_carry_code_and_param(server):
    for t in TRANSPORTS:
        with client(server, t) as c:
            with pytest.raises(ClientError) as ei:
                c.generate("x", top_p=2.0)
            assert (ei.value.code, ei.value.param) == ("invalid_argument", "top_p") and "top_p" in ei.value.message
            with pytest.raises(ClientError) as ei:
                c.generate("x", max_new_tokens=0)
            assert ei.value.param == "max_new_tokens"


# ------------------------------------------------------------------------------------------ CLI, per transport


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_generate_stream_and_json(server, capsys, transport):
    args = ["The river", "--temperature", "0.9", "--seed", "5", "--max-new-tokens", "6", "--stop", "zzzz"]
    with client(server, transport) as c:
        want = c.generate("The river", temperature=0.9, seed=5, max_new_tokens=6, stop=["zzzz"])
    rc, out, err = cli(capsys, server, transport, "generate", *args)
    assert rc == 0 and out == want.text + "\n"
    assert f"{want.usage.completion_tokens} tokens" in err and "seed 5" in err and "KV peak" in err
    assert "activation peak" in err
    rc, out2, err2 = cli(capsys, server, transport, "stream", *args)
    assert rc == 0 and out2 == out and err2.splitlines()[-1].startswith("[")
    rc, js, _ = cli(capsys, server, transport, "generate", *args, "--json")
    d = json.loads(js)
    assert rc == 0 and d["text"] == want.text and d["seed"] == 5 and d["usage"]["total_tokens"] > 0
    assert d["memory"]["engine"]["kv_capacity_bytes"] > 0 and d["memory"]["kv_bytes_per_token"] > 0
    assert d["duration_s"] >= d["ttft_s"] > 0 and len(d["token_ids"]) == d["usage"]["completion_tokens"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_chat_keeps_history_with_piped_stdin(server, capsys, monkeypatch, transport):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nHow are you?\n/exit\nnever read\n"))
    rc, out, err = cli(capsys, server, transport, "chat", "--temperature", "0", "--max-new-tokens", "5",
                       "--system", "Be brief.")
    with client(server, transport) as c:  # greedy: the reply depends on the whole conversation, not on a seed
        hist = [("system", "Be brief."), ("user", "Hello there")]
        first = c.chat(hist, temperature=0.0, max_new_tokens=5)
        second = c.chat(hist + [("assistant", first.text), ("user", "How are you?")], temperature=0.0,
                        max_new_tokens=5)
    assert rc == 0 and out == first.text + "\n" + second.text + "\n"
    # the second turn was sent with the whole history (system, user, assistant, user)
    prompts = [int(x) for x in re.findall(r"\(prompt (\d+)\)", err)]
    assert prompts == [first.usage.prompt_tokens, second.usage.prompt_tokens] and prompts[1] > prompts[0] + 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_info_and_tokenize(server, capsys, transport):
    rc, out, _ = cli(capsys, server, transport, "info", "--json")
    d = json.loads(out)
    assert rc == 0 and d["context_length"] == 512 and d["scheme"] == "none"
    rc, table, _ = cli(capsys, server, transport, "info")
    assert rc == 0 and "context length" in table and "512" in table
    assert d["vocab_size"] == 49152 and d["memory"]["kv_capacity_bytes"] > 0 and d["glue_ops"]
    assert d["dtype"] == "float32" and d["max_new_tokens_limit"] > 0 and "KV pool capacity" in table
    rc, out, err = cli(capsys, server, transport, "tokenize", "The river", "--json")
    assert rc == 0 and json.loads(out)["token_ids"] == server.engine.tokenize("The river")


def test_cli_trace_tables_json_and_plot_on_both_transports(server, capsys, tmp_path):
    from matplotlib.image import imread

    docs = {}
    for t in TRANSPORTS:
        path = tmp_path / f"trace-{t}.json"
        rc, out, err = cli(capsys, server, t, "trace", "The river", "--trace-n", "4", "--temperature", "0.8",
                           "--top-k", "5", "--top-p", "0.6", "--min-p", "0.5", "--seed", "2", "--max-new-tokens",
                           "3", "--json", str(path))
        assert rc == 0 and out.count("step ") == 3 and "after top-k" in out and "after top-p" in out
        assert "after penalties" in out and "after min-p" in out and "min-p kept" in out
        assert "top-k kept " in out and "entropy" in out and "3 tokens" in err
        docs[t] = json.loads(path.read_text())
    g, h = docs["grpc"], docs["http"]
    assert g["trace"] == h["trace"] and g["tokens"] == h["tokens"] and g["text"] == h["text"]
    for s in g["trace"]:
        # min-p removes most of the vocabulary, top-k keeps at most 5 of what is left, top-p some of those
        assert 49152 > s["kept_min_p"] and s["kept_top_k"] == min(5, s["kept_min_p"]) and 1 <= s["kept_top_p"] <= 5
        assert len(s["after_top_k"]) == 4 and len(s["after_penalties"]) == len(s["after_min_p"]) == 4
        assert s["mass_top_p"] <= s["mass_top_k"] <= s["mass_min_p"] <= 1 + 1e-6 and s["entropy"] > 0
    png = tmp_path / "step.png"
    assert main(["plot", "--trace", str(tmp_path / "trace-http.json"), "--step", "1", "--out", str(png)]) == 0
    assert imread(png).shape[:2] == (450, 900) and "(900x450 px)" in capsys.readouterr().err
    assert main(["plot", "--trace", str(tmp_path / "trace-http.json"), "--step", "7", "--out", str(png)]) == 1
    assert "--step must be in [0, 3)" in capsys.readouterr().err


def test_cli_sweep_csv_json_and_heatmaps(server, capsys, tmp_path):
    from matplotlib.image import imread
    from quantserve.client.sweep import COLUMNS

    grid = ["--temperature", "0,1", "--top-k", "0,5", "--top-p", "1.0,0.5", "--seeds", "2",
            "--max-new-tokens", "4", "--concurrency", "2"]
    rows = {}
    for t in TRANSPORTS:
        csv_path, json_path = tmp_path / f"{t}.csv", tmp_path / f"{t}.json"
        rc, out, _ = cli(capsys, server, t, "sweep", "The river", *grid, "--csv", str(csv_path),
                         "--json", str(json_path))
        assert rc == 0 and "distinct-2" in out and "8 cells x 2 seeds" in out
        lines = csv_path.read_text().splitlines()
        assert lines[0].split(",") == list(COLUMNS) and len(lines) == 1 + 8
        rows[t] = json.loads(json_path.read_text())["rows"]
    for g, h in zip(rows["grpc"], rows["http"]):
        for k in ("temperature", "top_k", "top_p", "requests", "mean_length", "mean_logprob", "mean_entropy",
                  "kv_bytes_reserved", "kv_bytes_used", "activation_peak_bytes"):
            assert g[k] == pytest.approx(h[k]), k
        assert g["requests"] == 2 and g["mean_length"] == 4 and g["kv_bytes_reserved"] > 0
        if g["temperature"] == 0:  # greedy: every seed gives the same tokens and the draw has no entropy
            assert g["mean_entropy"] == 0 and g["distinct_1"] <= 0.5
        elif g["top_k"] == 5:
            assert 0 < g["mean_entropy"] <= 1.61  # at most log(5) nats
    for src in (tmp_path / "grpc.json", tmp_path / "http.csv"):
        png = tmp_path / f"{src.stem}-{src.suffix[1:]}.png"
        assert main(["plot", "--sweep", str(src), "--metric", "mean_entropy", "--out", str(png)]) == 0
        assert imread(png).shape[:2] == (400, 900)  # 2 top-k panels of 450 x 400 px
    assert "(900x400 px)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ errors


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_errors_are_one_line_and_a_distinct_exit_status(server, capsys, transport):
    def one_line(err: str, prefix: str) -> None:
        assert err.startswith(f"error: {prefix}:") and len(err.strip().splitlines()) == 1, err

    rc, out, err = cli(capsys, server, transport, "generate", "x", "--top-p", "2.0")
    assert rc == 3 and out == "" and "top_p" in err
    one_line(err, "invalid_argument")
    rc, _, err = cli(capsys, server, transport, "generate", "x", "--max-new-tokens", "450", "--ignore-eos",
                     "--timeout", "0.3")
    assert rc == 6
    one_line(err, "deadline_exceeded")
    rc, _, err = cli(capsys, server, transport, "info", key="wrong")
    assert rc == 7
    one_line(err, "unauthenticated")
    rc, _, err = cli(capsys, server, transport, "generate", "x", key=None)
    assert rc == 7
    port = _closed_port()
    rc = main(["info", "--target", f"127.0.0.1:{port}", "--timeout", "5"] + (["--http"] if transport == "http" else []))
    err = capsys.readouterr().err
    assert rc == 4
    one_line(err, "connection")


def test_real_subprocess_quant_client(server, tmp_path):
    exe = shutil.which("quant-client")
    cmd = [exe] if exe else [sys.executable, "-m", "quantserve.client.cli"]
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    port = server.http.rsplit(":", 1)[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "clients"), "OMP_NUM_THREADS": "1"}  # this checkout, whatever is installed
    r = subprocess.run(cmd + ["generate", "The river", "--http", "--target", f"127.0.0.1:{port}", "--api-key-file",
                              str(key_file), "--seed", "9", "--max-new-tokens", "5", "--temperature", "0.7"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    with client(server, "grpc") as c:
        want = c.generate("The river", seed=9, max_new_tokens=5, temperature=0.7)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text + "\n" and "5 tokens" in r.stderr
    bad = subprocess.run(cmd + ["generate", "x", "--target", server.grpc_target, "--api-key", KEY,
                                "--temperature", "-1"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 3 and bad.stderr.startswith("error: invalid_argument: temperature")


# ------------------------------------------------------------------------------------------ TLS


def test_tls_with_a_ca_file_on_both_transports(tiny_model_dir, cache_dir, tmp_path, capsys):
    cert, key = self_signed_cert(tmp_path)
    s = start(tiny_model_dir, cache_dir, tls=(cert, key))
    try:
        port = s.http.rsplit(":", 1)[1]
        texts = []
        for http, tgt in ((False, s.grpc_target), (True, f"127.0.0.1:{port}")):
            flags = ["--target", tgt, "--ca-file", cert] + (["--http"] if http else [])  # --ca-file implies --tls
            assert main(["generate", "The river", *flags, "--seed", "2", "--max-new-tokens", "4"]) == 0
            texts.append(capsys.readouterr().out)
            # without the CA the server's certificate is not trusted: a connection error, not a hang
            assert main(["info", "--target", tgt, "--tls", "--timeout", "10"] + (["--http"] if http else [])) == 4
            assert capsys.readouterr().err.startswith("error: connection:")
        assert texts[0] == texts[1] and texts[0].strip()
    finally:
        s.shutdown()


def test_grpc_calls_are_spread_round_robin_over_every_resolved_server(server, tiny_model_dir, cache_dir):
    """What a Kubernetes headless Service gives a client (deploy/README.md, "Scaling out"): one target that
    resolves to several servers; the client's channel must use all of them, not pin the first."""
    other = start(tiny_model_dir, cache_dir, api_key=KEY)
    try:
        servers = (server, other)
        before = [_grpc_requests(s) for s in servers]
        with Client("ipv4:" + ",".join(s.grpc_target for s in servers), api_key=KEY) as c:
            for i in range(8):
                c.generate("The river", seed=i, max_new_tokens=2)
        counts = [_grpc_requests(s) - b for s, b in zip(servers, before)]
        # round_robin picks among connected servers: both serve, though the first call may find one ready
        assert sum(counts) == 8 and min(counts) >= 2, counts
    finally:
        other.shutdown()


def _grpc_requests(s) -> float:
    return metric_sum(s.http, "quantserve_requests_total", transport="grpc")
