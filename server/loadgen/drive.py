"""Drivers of a live ``quant serve`` on loopback: the server in a process of its own (so resident memory is the
server's alone), concurrent streaming clients with cancellation (``load_round``), each seed served alone
(``reference_texts``), SIGTERM while clients stream (``drain_under_load``), and /metrics read as an operator reads it.
Real clients (grpc stubs, httpx); no torch. bench/reliability.py runs them at a benchmark's scale and
tests/test_reliability.py at a test's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("The city of", "Once upon a time", "In the beginning", "The river flows", "A quiet morning")


# ------------------------------------------------------------------------------------------- the server


class ServerProcess:
    """``quant serve`` on free loopback ports in its own process."""

    def __init__(self, artifact: str | None, *args: str, env: dict | None = None, timeout: float = 300,
                 root: Path = ROOT):
        """``root``: the checkout whose server runs (a bench baseline's worktree, or this one)."""
        cmd = [sys.executable, "-m", "quant.cli", "serve", *([artifact] if artifact else []),
               "--grpc-port", "0", "--http-port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=root,
                                     env={**os.environ, **(env or {}), "PYTHONPATH": str(root)})
        self.log: deque[str] = deque(maxlen=500)  # the latest stderr lines, for error messages
        self._ready = threading.Event()
        # One thread drains stderr for the server's whole life: a full pipe would block its logging.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or not hasattr(self, "grpc_port"):
            self.kill()
            raise RuntimeError(f"quant serve did not report its ports within {timeout} s:\n"
                               + "".join(list(self.log)[-20:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"grpc on [\d.]+:(\d+), http on [\d.]+:(\d+)", line)
            if m and not self._ready.is_set():
                self.grpc_port, self.http_port = int(m.group(1)), int(m.group(2))
                self._ready.set()
        if not self._ready.is_set():
            self._ready.set()  # exited before serving: the waiter sees no ports

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def rss_bytes(self) -> int:
        return rss_bytes(self.proc.pid)

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------------------------------------- load


@dataclass
class RoundResult:
    completed: int = 0
    cancelled: int = 0
    failures: list[str] = field(default_factory=list)  # anything that is neither a correct end nor our cancel
    tokens: int = 0
    wall_s: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)  # seed -> text of the requests that completed


def _request(seed: int, max_new_tokens: int) -> tuple[str, dict]:
    """The prompt and sampling of client ``seed``: a fixed function of the seed, so every round and the
    sequential reference ask exactly the same thing."""
    prompt = PROMPTS[seed % len(PROMPTS)]
    return prompt, {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": seed, "max_new_tokens": max_new_tokens,
                    "ignore_eos": True}


def grpc_request(seed: int, max_new_tokens: int) -> pb.GenerateRequest:
    prompt, s = _request(seed, max_new_tokens)
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParameters(**s))


def http_body(seed: int, max_new_tokens: int, stream: bool) -> dict:
    prompt, s = _request(seed, max_new_tokens)
    body = {"prompt": prompt, "max_tokens": s.pop("max_new_tokens"), **s}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _sse(r: httpx.Response):
    """The JSON events of a server-sent event stream, up to [DONE]."""
    async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def _grpc_client(stub, seed: int, max_new: int, cancel: bool, res: RoundResult, timeout: float) -> None:
    call = stub.GenerateStream(grpc_request(seed, max_new), timeout=timeout)
    text, n, chunks, final = [], 0, 0, None
    try:
        async for m in call:
            text.append(m.text)
            n += len(m.token_ids)
            chunks += 1
            if m.HasField("final"):
                final = m.final
            if cancel and chunks == 2:
                call.cancel()
                res.cancelled += 1
                return
    except grpc.aio.AioRpcError as e:
        res.failures.append(f"grpc seed {seed}: {e.code().name} {e.details()}")
        return
    _finish(res, seed, "".join(text), n, final.finish_reason if final else None, max_new, "grpc")


async def _http_client(http: httpx.AsyncClient, seed: int, max_new: int, cancel: bool, res: RoundResult) -> None:
    text, n, chunks, reason = [], 0, 0, None
    async with http.stream("POST", "/v1/completions", json=http_body(seed, max_new, stream=True)) as r:
        if r.status_code != 200:
            res.failures.append(f"http seed {seed}: {r.status_code} {(await r.aread())[:200]!r}")
            return
        async for d in _sse(r):
            if "error" in d:
                res.failures.append(f"http seed {seed}: error event {d['error']}")
                return
            for c in d.get("choices", []):
                text.append(c["text"])
                reason = c.get("finish_reason") or reason
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            chunks += 1
            if cancel and chunks == 2:
                res.cancelled += 1
                return  # leaving the block closes the connection mid-stream
    _finish(res, seed, "".join(text), n, reason, max_new, "http")


def _finish(res: RoundResult, seed: int, text: str, n: int, reason: str | None, max_new: int, transport: str):
    if reason != "length" or n != max_new:
        res.failures.append(f"{transport} seed {seed}: finish {reason!r} after {n} tokens, want length/{max_new}")
        return
    res.completed += 1
    res.tokens += n
    res.texts[seed] = text


async def load_round(grpc_target: str, http_base: str, clients: int, max_new_tokens: int,
                     cancel_every: int | None = 5,
                     timeout: float = 300.0) -> RoundResult:
    """``clients`` concurrent streams; even seeds over gRPC, odd over HTTP; seeds divisible by
    ``cancel_every`` cancel after their second chunk (20% at 5; None: nobody)."""
    res = RoundResult()
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(grpc_target) as ch, \
            httpx.AsyncClient(base_url=http_base, timeout=timeout,
                              limits=httpx.Limits(max_connections=clients)) as http:
        stub = pb_grpc.InferenceStub(ch)
        tasks = []
        for seed in range(clients):
            cancel = cancel_every is not None and seed % cancel_every == 0
            tasks.append(_grpc_client(stub, seed, max_new_tokens, cancel, res, timeout) if seed % 2 == 0
                         else _http_client(http, seed, max_new_tokens, cancel, res))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    res.wall_s = time.perf_counter() - t0
    return res


def reference_texts(http_base: str, seeds, max_new_tokens: int, timeout: float = 120.0) -> dict[int, str]:
    """Each seed's text served alone (unary, one at a time): what the loaded rounds must reproduce."""
    out = {}
    with httpx.Client(base_url=http_base, timeout=timeout) as c:
        for seed in seeds:
            r = c.post("/v1/completions", json=http_body(seed, max_new_tokens, stream=False))
            r.raise_for_status()
            out[seed] = r.json()["choices"][0]["text"]
    return out


def metric_sum(http_base: str, sample: str, **labels: str) -> float:
    """The sum of the /metrics samples named ``sample`` whose labels include ``labels`` (what an operator
    sees; 0 before a labelled counter's first increment). An error when the server exports no such metric,
    so a renamed one cannot pass for an idle server."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(http_base + "/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text)
                if sample == f.name or sample.startswith(f.name + "_")]  # counters: NAME_total samples
    if not families:
        raise RuntimeError(f"no {sample} in /metrics")
    return sum(sm.value for f in families for sm in f.samples
               if sm.name == sample and labels.items() <= sm.labels.items())


def kv_in_use(http_base: str) -> float:
    return metric_sum(http_base, "quantserve_kv_pool_used_bytes")


def wait_idle(http_base: str, timeout: float = 30.0) -> float:
    end = time.monotonic() + timeout
    while (used := kv_in_use(http_base)) > 0 and time.monotonic() < end:
        time.sleep(0.05)
    return used


# ------------------------------------------------------------------------------------------------ drain


@dataclass
class DrainResult:
    completed: int = 0
    unavailable: int = 0  # ended by the drain with UNAVAILABLE / 503 (an error event once streaming)
    failures: list[str] = field(default_factory=list)
    refused_after_sigterm: bool = False
    exit_code: int | None = None
    exit_s: float = 0.0  # SIGTERM to process exit


async def _drain_client(transport: str, stub, http, seed: int, max_new: int, streaming, res: DrainResult) -> None:
    """One client of the drain; ``streaming()`` is called at its first chunk."""
    if transport == "grpc":
        first, final = True, None
        try:
            async for m in stub.GenerateStream(grpc_request(seed, max_new)):
                if first:
                    streaming()
                    first = False
                if m.HasField("final"):
                    final = m.final
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                res.unavailable += 1
            else:
                res.failures.append(f"grpc {seed}: {e.code().name} {e.details()}")
            return
        ok = final is not None and final.finish_reason == "length" and final.usage.completion_tokens == max_new
        res.completed += ok
        if not ok:
            res.failures.append(f"grpc {seed}: ended without error and without completing ({final})")
        return
    async with http.stream("POST", "/v1/completions", json=http_body(seed, max_new, stream=True)) as r:
        if r.status_code == 503:
            res.unavailable += 1
            return
        first, n_tokens = True, 0
        async for d in _sse(r):
            if first:
                streaming()
                first = False
            if "error" in d:
                if d["error"].get("code") == 503:
                    res.unavailable += 1
                else:
                    res.failures.append(f"http {seed}: error event {d['error']}")
                return
            if d.get("usage"):
                n_tokens = d["usage"]["completion_tokens"]
        res.completed += n_tokens == max_new
        if n_tokens != max_new:
            res.failures.append(f"http {seed}: stream ended after {n_tokens} tokens without an error")


async def drain_under_load(srv: ServerProcess, clients: int, short_tokens: int, long_tokens: int,
                           timeout: float = 120.0) -> DrainResult:
    """``clients`` streams (alternating transports; alternating short requests that can finish within the
    grace period and long ones that cannot), SIGTERM once every stream has its first chunk."""
    res = DrainResult()
    started, streaming = asyncio.Event(), set()

    def streaming_now(seed: int):
        streaming.add(seed)
        if len(streaming) == clients:
            started.set()

    async with grpc.aio.insecure_channel(srv.grpc_target) as ch, \
            httpx.AsyncClient(base_url=srv.http, timeout=timeout,
                              limits=httpx.Limits(max_connections=clients + 2)) as http:
        stub = pb_grpc.InferenceStub(ch)
        tasks = [asyncio.create_task(_drain_client("grpc" if i % 2 == 0 else "http", stub, http, i,
                                                   short_tokens if (i // 2) % 2 == 0 else long_tokens,
                                                   lambda i=i: streaming_now(i), res)) for i in range(clients)]
        await asyncio.wait_for(started.wait(), timeout)
        t0 = time.perf_counter()
        srv.sigterm()
        await asyncio.sleep(0.3)
        # A request arriving after SIGTERM is refused (503 while the server drains; refused once it is gone).
        try:
            r = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            res.refused_after_sigterm = r.status_code == 503
        except httpx.TransportError:
            res.refused_after_sigterm = True
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
            res.failures.append("a client was left hanging")
        for t in done:
            if t.exception() is not None:
                res.failures.append(f"client raised {t.exception()!r}")
        res.exit_code = await asyncio.to_thread(srv.wait, timeout)
        res.exit_s = time.perf_counter() - t0
    return res
