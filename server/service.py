"""What both transports share: limits, the one error mapping, auth, metrics and the per-request log line.

The gRPC and HTTP handlers are thin: they convert their wire format to (prompt, SamplingParams), call
:meth:`Service.run`, convert the events back, and hand any exception to :func:`classify`, which is the only
place that decides what an error becomes on the wire (status code, message). No torch here: the engine
runs on its own thread and hands back plain events (server/outputs.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from typing import AsyncIterator

from server import capacity
from server import outputs as out
from server.config import Limits
from server.engine import Engine
from server.metrics import Metrics
from server.outputs import EngineClosedError, Event, OverloadedError, RequestError
from server.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger("quantserve.service")
PLAN_TIMEOUT_S = 120.0  # the engine answers a plan between two steps; longer only when it has stopped
request_log = logging.getLogger("quantserve.requests")




def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # lone surrogates (JSON can carry them) count too


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(param: str, text: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which is not Unicode text: no tokenizer takes it."""
    m = _SURROGATE.search(text)
    if m:
        raise RequestError(param, f"{param} contains a lone UTF-16 surrogate (U+{ord(m.group()):04X} at "
                                  f"character {m.start()}), which is not valid Unicode text")


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class AuthError(PermissionError):
    """Missing or wrong API key. UNAUTHENTICATED / HTTP 401."""


class DeadlineError(TimeoutError):
    """The caller's deadline passed; the request was cancelled in the engine. DEADLINE_EXCEEDED / HTTP 504."""


@dataclass(frozen=True)
class ErrorKind:
    outcome: str  # metrics label and log outcome
    grpc_code: str  # grpc.StatusCode member name
    http_status: int
    message: str
    param: str | None = None


def classify(exc: BaseException, log_internal: bool = True) -> ErrorKind:
    """The one mapping from an exception to what a client is told. Unknown exceptions become an opaque
    INTERNAL / 500; their traceback goes to the log (once: by the transport that answers), never to the
    client."""
    if isinstance(exc, (SamplingParamsError, RequestError)):
        return ErrorKind("invalid", "INVALID_ARGUMENT", 400, str(exc), exc.param)
    if isinstance(exc, OverloadedError):
        return ErrorKind("overloaded", "RESOURCE_EXHAUSTED", 429, str(exc))
    if isinstance(exc, EngineClosedError):
        return ErrorKind("unavailable", "UNAVAILABLE", 503, str(exc))
    if isinstance(exc, AuthError):
        return ErrorKind("unauthenticated", "UNAUTHENTICATED", 401, str(exc))
    if isinstance(exc, DeadlineError):
        return ErrorKind("deadline", "DEADLINE_EXCEEDED", 504, str(exc))
    if log_internal:
        log.error("internal error", exc_info=exc)
    return ErrorKind("internal", "INTERNAL", 500, "internal error (details are in the server log)")


class Service:
    """One engine behind both transports."""

    def __init__(self, engine: Engine, limits: Limits = Limits(), api_key: str | None = None,
                 metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits.validate()
        self._api_key = api_key.encode() if api_key else None
        self.metrics = metrics or Metrics(engine)
        self.draining = False
        self._token_text: dict[int, str] = {}
        info = engine.info
        self.max_prompt_tokens = min(limits.max_prompt_tokens or info.context_length, info.context_length)
        # What a request that does not say gets: the sampling default, or this server's limit when lower.
        self.default_max_new_tokens = min(SamplingParams.max_new_tokens, limits.max_new_tokens)

    # ------------------------------------------------------------------------------------ checks

    def check_auth(self, authorization: str | None) -> None:
        """``authorization`` is the header / metadata value; "Bearer KEY" when a key is configured."""
        if self._api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self._api_key):
            raise AuthError("missing or invalid API key (send 'authorization: Bearer KEY')")

    def check_accepting(self) -> None:
        if self.draining or not self.engine.accepting:
            raise EngineClosedError("the server is draining and takes no new requests")

    def check_params(self, params: SamplingParams) -> None:
        capacity.check_max_new_tokens(params.max_new_tokens, self.limits.max_new_tokens)
        if len(params.stop) > self.limits.max_stop:
            raise RequestError("stop", f"at most {self.limits.max_stop} stop sequences, got {len(params.stop)}")

    def refusal(self, prompt_tokens: int, max_new_tokens: int) -> capacity.Refusal | None:
        """What a request of this shape is refused with before it could queue, checked in the order a real
        request meets the checks (draining, this server's limits, the engine's context and KV pool); None if
        it would be taken."""
        try:
            self.check_accepting()
            capacity.check_limits(prompt_tokens, max_new_tokens, self.limits.max_new_tokens, self.max_prompt_tokens)
            self.engine.check(prompt_tokens, max_new_tokens)
        except (RequestError, EngineClosedError) as e:
            k = classify(e)
            return capacity.Refusal(k.grpc_code, k.message, k.param)
        return None

    async def plan(self, shapes: list[capacity.Shape]) -> dict:
        """The capacity plan of ``shapes`` from the live engine (server/capacity.py), as the wire gives it;
        RequestError naming the field for an invalid plan request."""
        fut = self.engine.plan(shapes, self.refusal)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(fut), PLAN_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineClosedError("the engine did not answer the plan (it is shutting down)") from None
        i = self.engine.info
        return capacity.to_dict(result, i.weight_bytes, i.kv_bytes_per_token, i.attention, self.engine.layout.kv_dtype)

    # ------------------------------------------------------------------------------------ requests

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template (off the event loop)."""
        if not messages:
            raise RequestError("messages", "messages must not be empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise RequestError("messages", f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                               f"got {m.get('role')!r}")
        self._check_bytes("messages", "messages are", sum(_utf8_len(m["content"]) for m in messages))
        for m in messages:
            _check_text("messages", m["content"])
        return await asyncio.to_thread(self.engine.chat_prompt, messages)

    def _check_bytes(self, param: str, what: str, n: int) -> None:
        if n > self.limits.max_request_bytes:
            raise RequestError(param, f"{what} larger than {self.limits.max_request_bytes} bytes")

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (tokenized off the event loop) or checked ids, within the limits."""
        if isinstance(prompt, str):
            self._check_bytes("prompt", "prompt is", _utf8_len(prompt))
            _check_text("prompt", prompt)
            ids = await asyncio.to_thread(self.engine.tokenize, prompt) if prompt else []
        else:
            ids = self.engine.prompt_ids(prompt)  # integers in the vocabulary
        capacity.check_prompt_tokens(len(ids), self.max_prompt_tokens)
        return ids

    async def run(self, prompt: str | list[int], params: SamplingParams, transport: str,
                  request_id: str | None = None, n: int = 1) -> AsyncIterator[Event]:
        """The request's events (of its ``n`` samples, interleaved, each with its ``index``); raises the engine's
        errors (see :func:`classify`) before the first event. A final event cancelled by the server's shutdown is
        raised as EngineClosedError, a sample's error as the request's. Leaving the iteration early cancels the
        request in the engine (and frees its KV blocks)."""
        t0 = time.monotonic()
        outcome, first, last_tok_at, n_tokens, n_prompt, rid = "error", None, None, 0, 0, request_id
        try:
            self.check_accepting()
            self.check_params(params)
            ids = await self.prompt_ids(prompt)
            n_prompt = len(ids)
            async for ev in self.engine.generate(ids, params, request_id, n):
                rid = ev.request_id
                now = time.monotonic()
                if ev.token_ids:
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(now - t0)
                    elif last_tok_at is not None:
                        gap = (now - last_tok_at) / len(ev.token_ids)
                        for _ in ev.token_ids:
                            self.metrics.itl.observe(gap)
                    last_tok_at = now
                    n_tokens += len(ev.token_ids)
                    self.metrics.tokens.inc(len(ev.token_ids))
                if ev.finished:
                    outcome = ev.finish_reason or "error"
                    if ev.finish_reason == out.CANCELLED and ev.error:
                        outcome = "unavailable"
                        yield Event(ev.request_id, ev.seed, ev.text, ev.token_ids, ev.logprobs, ev.trace,
                                    index=ev.index)
                        raise EngineClosedError(f"the server stopped before the request finished ({ev.error})")
                    if ev.finish_reason == out.ERROR:
                        raise RuntimeError(f"engine error in request {ev.request_id}: {ev.error}")
                yield ev
        except Exception as e:
            outcome = classify(e, log_internal=False).outcome  # the transport logs it when it answers
            raise
        except BaseException:  # task cancelled (client gone, deadline) or the generator closed early
            outcome = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(transport=transport, outcome=outcome).inc()
            self.metrics.prompt_tokens.inc(n_prompt)
            self.metrics.duration.observe(time.monotonic() - t0)
            request_log.info(json.dumps({
                "request_id": rid, "transport": transport, "outcome": outcome, "prompt_tokens": n_prompt,
                "completion_tokens": n_tokens, "ttft_s": None if first is None else round(first - t0, 4),
                "duration_s": round(time.monotonic() - t0, 4),
            }))

    async def complete(self, prompt, params: SamplingParams, transport: str,
                       request_id: str | None = None) -> out.Completion:
        return out.collect([ev async for ev in self.run(prompt, params, transport, request_id)])

    async def complete_n(self, prompt, params: SamplingParams, transport: str, request_id: str | None = None,
                         n: int = 1) -> list[out.Completion]:
        """Every sample of a request, in index order."""
        events: dict[int, list[Event]] = {}  # filled as samples arrive: n itself is the engine's to check
        async for ev in self.run(prompt, params, transport, request_id, n):
            events.setdefault(ev.index, []).append(ev)
        return [out.collect(events[i]) for i in sorted(events)]

    async def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        ids = await self.prompt_ids(text)
        return ids, [self.token_text(i) for i in ids]

    async def decode(self, ids: list[int]) -> str:
        """The text of token ids (an echoed prompt given as ids), decoded off the event loop."""
        return await asyncio.to_thread(self.engine.decode, ids)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (cached; for logprobs and traces)."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.engine.token_text(token_id)
        return s

    def info(self) -> dict:
        i = self.engine.info
        return {
            "model": i.model, "scheme": i.scheme, "dtype": i.dtype, "device": i.device, "attention": i.attention,
            "context_length": i.context_length, "vocab_size": i.vocab_size,
            "kv_bytes_per_token": i.kv_bytes_per_token, "glue_ops": i.glue_ops, "embeddings": i.embeddings,
            "kernels": list(i.kernels), "speculation": i.speculation,
            "memory": asdict(self.engine.totals()),
            "max_new_tokens_limit": self.limits.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens,
        }
