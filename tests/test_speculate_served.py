"""End-to-end: speculative decoding through a real server (tiny model, ``--speculate ngram``, both transports) on
loopback: responses report their drafts, ``speculate: false`` opts a request out, ``quant-client trace`` marks each
drafted step accepted or rejected, and ``/metrics`` gives the acceptance rate."""

from __future__ import annotations

import json

import live_server
import pytest
from quantserve.client import Client
from quantserve.client.cli import main

from server.loadgen.drive import metric_sum
from server.speculate import DraftCosts

pytestmark = pytest.mark.e2e

TRANSPORTS = ("grpc", "http")
PROMPT = "one two three four five six seven eight " * 4  # its n-grams predict its own continuation
FRESH = "a fox, seven owls and the lighthouse keeper met at noon by the harbour wall"  # none: a draft model drafts

_pool_back_to_zero = live_server.pool_back_to_zero


@pytest.fixture(scope="module")
def server(tiny_model_dir, cache_dir):
    """Drafts cost nothing here (whatever this machine measured), so every request drafts all its text allows."""
    s = live_server.start(tiny_model_dir, cache_dir, speculate="ngram")
    s.engine.scheduler.speculate(DraftCosts(), s.engine.config.speculate_tokens)
    yield s
    s.shutdown()
    assert s.rc == 0


def _client(server, transport: str) -> Client:
    return Client(server.http if transport == "http" else server.grpc_target, http=transport == "http")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_responses_report_their_drafts_and_an_opted_out_request_drafts_none(server, transport):
    with _client(server, transport) as c:
        on = c.generate(PROMPT, temperature=0.0, max_new_tokens=24)
        off = c.generate(PROMPT, temperature=0.0, max_new_tokens=24, speculate=False)
    assert on.memory.speculated_tokens > 0 and 0 <= on.memory.accepted_tokens <= on.memory.speculated_tokens
    assert on.memory.kv_bytes_speculative > 0
    assert off.memory.speculated_tokens == 0 and off.memory.kv_bytes_speculative == 0
    assert on.token_ids == off.token_ids  # float32: speculation keeps the tokens


def test_the_trace_marks_drafted_steps_on_both_transports(server, capsys, tmp_path):
    docs = {}
    for t in TRANSPORTS:
        path = tmp_path / f"{t}.json"
        flags = ["--target", server.http if t == "http" else server.grpc_target] + (["--http"] if t == "http" else [])
        rc = main(["trace", *flags, PROMPT, "--trace-n", "2", "--temperature", "0", "--max-new-tokens", "24",
                   "--json", str(path)])
        out = capsys.readouterr().out
        assert rc == 0 and "drafted " in out
        docs[t] = json.loads(path.read_text())
    g, h = docs["grpc"], docs["http"]
    assert g["token_ids"] == h["token_ids"]
    assert [s["draft_token_id"] for s in g["trace"]] == [s["draft_token_id"] for s in h["trace"]]
    drafted = [(s["draft_token_id"], tok) for s, tok in zip(g["trace"], g["token_ids"]) if s["draft_token_id"]
               is not None]
    assert drafted and all(isinstance(s["draft_token"], str) for s in g["trace"] if s["draft_token_id"] is not None)
    accepted = sum(d == tok for d, tok in drafted)
    with Client(server.grpc_target) as c:  # the same request again: its accounting counts what the trace shows
        r = c.generate(PROMPT, temperature=0.0, max_new_tokens=24)
    assert list(r.token_ids) == g["token_ids"] and r.memory.accepted_tokens == accepted


def test_metrics_give_the_acceptance_rate(server):
    with Client(server.grpc_target) as c:
        c.generate(PROMPT, temperature=0.0, max_new_tokens=16)
    drafted = metric_sum(server.http, "quantserve_speculated_tokens")
    accepted = metric_sum(server.http, "quantserve_accepted_tokens")
    rate = metric_sum(server.http, "quantserve_speculation_acceptance_rate")
    assert drafted > 0 and rate == pytest.approx(accepted / drafted)


@pytest.fixture(scope="module")
def draft_server(tiny_model_dir, cache_dir):
    """``--speculate draft`` with the tiny model drafting for itself (every draft accepted), drafts free."""
    s = live_server.start(tiny_model_dir, cache_dir, speculate="draft", draft=str(tiny_model_dir),
                          draft_dtype="float32")
    s.engine.scheduler.speculate(DraftCosts(), s.engine.config.speculate_tokens, s.engine.draft,
                                 DraftCosts((1,), (0.0,)))
    yield s
    s.shutdown()
    assert s.rc == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_draft_model_is_named_and_its_memory_reported_on_both_transports(draft_server, transport, capsys):
    with Client(draft_server.http if transport == "http" else draft_server.grpc_target, http=transport == "http") as c:
        r = c.generate(FRESH, temperature=0.0, max_new_tokens=24)
        plain = c.generate(FRESH, temperature=0.0, max_new_tokens=24, speculate=False)
        info = c.info()
    assert r.token_ids == plain.token_ids and plain.memory.kv_bytes_draft == 0
    s = draft_server.engine.scheduler
    assert r.memory.speculated_tokens > 0 and 0 < s.model_accepted_tokens == s.model_speculated_tokens  # itself
    assert r.memory.kv_bytes_draft % draft_server.engine.draft.layout.bytes_per_block == 0 < r.memory.kv_bytes_draft
    assert info.speculation == f"draft {draft_server.engine.draft.name} (none)"
    assert info.memory.draft_weight_bytes == draft_server.engine.draft.weight_bytes > 0
    assert info.memory.draft_kv_capacity_bytes == draft_server.engine.draft.pool.capacity_bytes
    flags = ["--target", draft_server.http, "--http"] if transport == "http" else ["--target", draft_server.grpc_target]
    assert main(["info", *flags]) == 0
    out = capsys.readouterr().out
    assert "draft model" in out and "speculative decoding" in out
    draft_server.assert_idle()
    assert draft_server.engine.draft.pool.used_blocks == 0
