"""Reliability of the service edge: fuzz, load with cancellation, drain under load. Loopback only, bounded.

    python bench/reliability.py [ARTIFACT] [--fuzz 1000] [--clients 64] [--rounds 5] [--max-new-tokens 64]
                                [--out bench/out/reliability.json]
    python bench/reliability.py [ARTIFACT] --invariance [--clients 24] [--max-new-tokens 24]

Runs ``quant serve`` in a subprocess (so resident memory is the server's own) and drives it with real
clients (grpc stubs, httpx):

1. fuzz: hypothesis generates malformed or extreme requests, half per transport (wrong types, NaN, negative,
   huge, empty, unicode edge cases, oversized prompts, garbage bytes). Every answer must be 400 /
   INVALID_ARGUMENT or a well-formed completion; the server must stay healthy.
2. load: ``--clients`` concurrent streaming clients (half gRPC, half HTTP), every fifth cancelled after its
   second chunk, ``--rounds`` rounds. All others must finish with exactly ``--max-new-tokens`` tokens; how many
   texts differ from the same seed served alone is reported (bfloat16 is not batch-invariant); after each
   round the KV pool is back at zero; RSS per round.
3. drain: SIGTERM while the clients stream; each must complete or end with UNAVAILABLE / 503, none hangs,
   requests after SIGTERM are refused, exit code 0.

4. (--invariance, on its own) batch invariance: one round with nobody cancelling, served in float32 and in
   bfloat16; how many texts differ from the same seed served alone.

The drivers are server/loadgen's; tests/test_reliability.py runs them at a test's scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import httpx

from server.loadgen.drive import (
    ROOT,
    ServerProcess,
    drain_under_load,
    load_round,
    reference_texts,
    wait_idle,
)
from server.loadgen.fuzz import fuzz_grpc, fuzz_http

# ------------------------------------------------------------------------------------- batch invariance


def batch_invariance(artifact: str | None, dtype: str, clients: int, max_new_tokens: int, threads: int) -> dict:
    """How many texts served in one concurrent batch of ``clients`` differ from the same seed served alone,
    in ``dtype`` (one load round with nobody cancelling; the first differing character of each)."""
    srv = ServerProcess(artifact, "--dtype", dtype, "--memory-budget", "256MiB", "--threads", str(threads))
    try:
        ref = reference_texts(srv.http, range(clients), max_new_tokens)
        r = asyncio.run(load_round(srv.grpc_target, srv.http, clients, max_new_tokens, cancel_every=None))
    finally:
        srv.kill()
    first_diff = sorted(next((k for k, (x, y) in enumerate(zip(t, ref[s])) if x != y), min(len(t), len(ref[s])))
                        for s, t in r.texts.items() if t != ref[s])
    return {"dtype": dtype, "clients": clients, "max_new_tokens": max_new_tokens, "completed": r.completed,
            "failures": r.failures[:5], "differ": len(first_diff), "first_differing_char": first_diff}


# -------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", nargs="?", default=None, help="artifact dir (default: the embedded default model)")
    ap.add_argument("--fuzz", type=int, default=1000, help="fuzz requests in all, half per transport")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per load request; also the server's limit")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "reliability.json"))
    ap.add_argument("--invariance", action="store_true",
                    help="only: texts in a batch vs alone, float32 and bfloat16 (--clients, --max-new-tokens)")
    a = ap.parse_args(argv)
    if a.invariance:
        rows = [batch_invariance(a.artifact, dt, a.clients, a.max_new_tokens, a.threads)
                for dt in ("float32", "bfloat16")]
        for row in rows:
            print("invariance", row, flush=True)
        out = Path(a.out).with_name("invariance.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2))
        return 0 if all(not r["failures"] for r in rows) else 1

    def serve_args(limit_new: int, budget: str = "256MiB") -> tuple[str, ...]:
        return ("--threads", str(a.threads), "--memory-budget", budget, "--max-new-tokens", str(limit_new),
                "--max-prompt-tokens", "512", "--max-request-bytes", "65536")

    report: dict = {"artifact": a.artifact or "embedded default (bf16)", "clients": a.clients,
                    "max_new_tokens": a.max_new_tokens, "threads": a.threads}
    srv = ServerProcess(a.artifact, *serve_args(a.max_new_tokens))
    try:
        t0 = time.perf_counter()
        outcomes = Counter()
        outcomes.update(fuzz_http(srv.http, a.fuzz // 2, limit_new_tokens=a.max_new_tokens))
        outcomes.update(fuzz_grpc(srv.grpc_target, a.fuzz - a.fuzz // 2, limit_new_tokens=a.max_new_tokens))
        healthy = httpx.get(srv.http + "/health", timeout=10).status_code == 200
        report["fuzz"] = {"requests": sum(outcomes.values()), "outcomes": dict(outcomes), "healthy_after": healthy,
                          "kv_used_after": wait_idle(srv.http), "wall_s": round(time.perf_counter() - t0, 1)}
        print("fuzz", report["fuzz"], flush=True)

        ref = reference_texts(srv.http, range(a.clients), a.max_new_tokens)
        rounds = []
        for i in range(a.rounds):
            r = asyncio.run(load_round(srv.grpc_target, srv.http, a.clients, a.max_new_tokens))
            mismatched = [s for s, t in r.texts.items() if t != ref[s]]
            row = {"round": i + 1, "completed": r.completed, "cancelled": r.cancelled, "failures": r.failures[:5],
                   "mismatched_text": mismatched, "tok_per_s": round(r.tokens / r.wall_s, 1),
                   "wall_s": round(r.wall_s, 2), "kv_used_after": wait_idle(srv.http)}
            time.sleep(0.5)  # the engine trims its heap when it goes idle, just after the pool empties
            row["rss_bytes"] = srv.rss_bytes()
            rounds.append(row)
            print("load", row, flush=True)
        growth = [(b["rss_bytes"] - a_["rss_bytes"]) / a_["rss_bytes"] for a_, b in zip(rounds, rounds[1:])]
        report["load"] = {"rounds": rounds, "rss_growth_between_rounds": [round(g, 4) for g in growth]}
    finally:
        srv.kill()

    srv = ServerProcess(a.artifact, *serve_args(512, "1GiB"), "--grace", "2")
    try:
        d = asyncio.run(drain_under_load(srv, a.clients, short_tokens=8, long_tokens=400))
        report["drain"] = asdict(d)
        print("drain", report["drain"], flush=True)
    finally:
        srv.kill()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print("wrote", a.out)
    # Texts differing from the request served alone are reported, not failed: in bfloat16 the batch's shape
    # changes the kernels' reduction order, and a near-tie token can flip (in float32 they are identical,
    # which tests/test_reliability.py holds).
    ok = (report["fuzz"]["healthy_after"] and not any(r["failures"] for r in rounds)
          and not d.failures and d.exit_code == 0 and all(g < 0.05 for g in growth[1:]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
