"""OpenAI's API as this server speaks it: the request bodies (parsed by pydantic in strict mode: no "5" for 5; a
field this server does not know is refused by name), their translation into the engine's sampling parameters, and
the responses (unary bodies and SSE chunks, logprobs, usage) with our extensions beside OpenAI's fields: every
sampling control OpenAI does not have under its own name (top_k, min_p, repetition_penalty, min_tokens, ignore_eos
as vLLM spells them, trace), and seed and memory in every response. The route table is server/http_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from quantserve.client.types import (  # the one list of sampling controls (stdlib only)
    SAMPLING_FIELDS,
    SAMPLING_TYPES,
)

from server.capacity import Shape
from server.outputs import Accounting, RequestError
from server.sampling import TRACE_STAGES, TRACE_STATS
from server.sampling_params import MAX_LOGPROBS, SamplingParams
from server.service import CHAT_ROLES, Service, classify


class _OpenAIBody(BaseModel):
    """What OpenAI's completions and chat bodies share, spelt their way. A field this server does not know is
    refused by name (400), as OpenAI's API does, so that no control a client relies on is dropped silently; the
    fields below that change nothing here (``user``, ``metadata``, ``store``, ``service_tier``) are taken and
    ignored, as documented in the README."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    response_format: dict | None = None  # OpenAI's object (the engine's params keep its JSON text)
    user: str | None = None  # these four change nothing here
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None


# Sampling controls (quantserve.client.types.Sampling, the one list) that the OpenAI body spells its own way, per
# endpoint: max_new_tokens is max_tokens / max_completion_tokens, logprobs differs between the endpoints, stop is a
# string or a list, response_format is an object. Every other control rides in the body under its own name and
# type: OpenAI's temperature, top_p and seed, and our extensions (top_k, repetition_penalty, ...).
_OPENAI_SPELT = ("max_new_tokens", "logprobs", "stop", "response_format")


_SAME_NAME = tuple(f for f in SAMPLING_FIELDS if f not in _OPENAI_SPELT)


_Body = create_model("_Body", __base__=_OpenAIBody, **{f: (SAMPLING_TYPES[f] | None, None) for f in _SAME_NAME})


MAX_PROMPTS = 64  # prompts in one completions body (OpenAI's batch of prompts); each is a request of its own


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type] - the one list, server.service.CHAT_ROLES
    content: str | list[dict[str, Any]]


class ChatBody(_Body):
    messages: list[Message] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class ShapeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    prompt_tokens: int
    max_new_tokens: int
    count: int = 1
    n: int = 1  # samples per request
    expected_new_tokens: int = 0  # new tokens a request is expected to produce (0: max_new_tokens)


class PlanBody(BaseModel):
    """``requests``: a list of shapes; or one shape as ``prompt_tokens``, ``max_new_tokens``, ``concurrency``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    requests: list[ShapeBody] | None = None
    prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    concurrency: int | None = None

    def shapes(self) -> list[Shape]:
        one = {"prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
               "concurrency": self.concurrency}
        if self.requests is not None:
            given = [k for k, v in one.items() if v is not None]
            if given:
                raise RequestError(given[0], f"give requests or {given[0]}, not both")
            return [Shape(r.prompt_tokens, r.max_new_tokens, r.count, r.n, r.expected_new_tokens)
                    for r in self.requests]
        one["concurrency"] = 1 if self.concurrency is None else self.concurrency
        for name, v in one.items():
            if v is None:
                raise RequestError(name, f"{name} is required (or give requests, a list of request shapes)")
            if v < 1:
                raise RequestError(name, f"{name} must be an integer >= 1, got {v}")
        return [Shape(self.prompt_tokens, self.max_new_tokens, one["concurrency"])]


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    text: str


async def _unless_disconnected(request: Request, work):
    """Await ``work``; if the client goes away first, cancel it (the engine frees the request's KV blocks, as
    for a stream whose client left) and return None."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
    except asyncio.CancelledError:  # cancelled ourselves (a batch's other prompt failed): the work goes too
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise


def _unsupported(body: _Body) -> None:
    """Parameters we do not implement are refused by name rather than silently ignored (``n`` is checked by the
    engine, against --max-batch and the KV pool)."""
    if isinstance(body, CompletionBody):
        if body.best_of not in (None, 1):
            raise RequestError("best_of", "best_of must be 1")
        if body.suffix:
            raise RequestError("suffix", "suffix is not supported")


def params_from_body(body: _Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's params of a body. ``echo`` (completions) scores the prompt: its tokens get logprobs with as many
    alternatives as ``logprobs`` asks (and a body's own ``prompt_logprobs``, if larger); with ``max_tokens`` 0 the
    prompt is scored and nothing generated (lm-evaluation-harness 0.4.13 asks for 1 token and drops its logprob)."""
    _unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    kw = {f: getattr(body, f) for f in _SAME_NAME} | {"max_new_tokens": max_tokens, "logprobs": logprobs,
                                                      "response_format": body.response_format}
    in_range = logprobs is None or (isinstance(logprobs, int) and 0 <= logprobs <= MAX_LOGPROBS)
    if getattr(body, "echo", False) and (logprobs is not None or max_tokens == 0) and in_range:
        # (logprobs out of range: left to SamplingParams, whose error names logprobs, the field the body set)
        kw["prompt_logprobs"] = max(logprobs or 0, body.prompt_logprobs or 0)
    return SamplingParams(stop=tuple(stop), **{k: v for k, v in kw.items() if v is not None})


def _accounting(a: Accounting | None) -> dict | None:
    return a.to_dict() if a else None


def _usage(a: Accounting | None, generated: int | None = None) -> dict:
    """OpenAI's usage: the prompt once, the tokens of every sample (``generated``, default the request's own), and
    the prompt tokens taken from the prefix cache."""
    p = a.prompt_tokens if a else 0
    c = generated if generated is not None else a.generated_tokens if a else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": a.prompt_tokens_cached if a else 0}}


def _trace(svc: Service, steps) -> list[dict]:
    def cands(pairs):
        return [{"token_id": i, "token": svc.token_text(i), "prob": p} for i, p in pairs]

    return [{f"after_{k}": cands(getattr(t, k)) for k in TRACE_STAGES} | {k: getattr(t, k) for k in TRACE_STATS}
            | {"draft_token_id": t.draft, "draft_token": None if t.draft is None else svc.token_text(t.draft)}
            for t in steps]


def _completion_logprobs(svc: Service, lps, offset0: int = 0, echo: "_Echo | None" = None) -> dict:
    """The legacy completions logprobs object; with ``echo``, the prompt's tokens first (the first one's logprob and
    alternatives null, as OpenAI gives them)."""
    prompt = [] if echo is None else echo.ids
    tokens = [svc.token_text(i) for i in prompt] + [svc.token_text(lp.token_id) for lp in lps]
    offsets, pos = [], offset0
    for j, t in enumerate(tokens):
        if j == len(prompt) and echo is not None:  # the generated text starts after the echoed prompt's own text
            pos = offset0 + len(echo.text)
        offsets.append(pos)
        pos += len(t)
    scored = [] if echo is None else [None, *echo.logprobs][:len(prompt)]
    return {"tokens": tokens,
            "token_logprobs": [lp and lp.logprob for lp in scored] + [lp.logprob for lp in lps],
            "top_logprobs": [lp and {svc.token_text(i): v for i, v in lp.top} for lp in scored]
            + [{svc.token_text(i): v for i, v in lp.top} for lp in lps], "text_offset": offsets}


def _prompt_logprobs(svc: Service, lps) -> list:
    """A body's ``prompt_logprobs``: per prompt token, null for the first, then its logprob and alternatives."""
    def entry(i, v):
        return {"token_id": i, "token": svc.token_text(i), "logprob": v}

    return [None] + [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                     for lp in lps]


class _Echo:
    """A completions request's echoed prompt: its text and token ids, and its tokens' logprobs once scored."""

    def __init__(self, text: str, ids: list[int]):
        self.text, self.ids, self.logprobs = text, ids, ()


def _chat_logprobs(svc: Service, lps) -> dict:
    def entry(i, v):
        t = svc.token_text(i)
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "surrogatepass"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in lps]}


def _prompts(prompt) -> list:
    """A completions body's prompts: a string, a list of token ids, or a list of either (OpenAI's batch)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    return list(prompt)


def _text_content(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise RequestError("messages", "only text content parts are supported")
        parts.append(p["text"])
    return "".join(parts)


def _reason(r: str | None) -> str | None:
    return {"length": "length", "stop": "stop", "cancelled": "abort", "error": "error"}.get(r or "", r)


class Responder:
    """The OpenAI endpoints' work once a body is parsed: a request (or a batch of prompts) run through the service,
    its events shaped as OpenAI's unary body or SSE chunks, with our extensions (seed, memory, trace) beside them."""

    def __init__(self, svc: Service):
        self.svc = svc
        self.model_name = svc.engine.info.model

    async def completions(self, body: CompletionBody, request: Request):
        prompts = _prompts(body.prompt)
        # OpenAI's default for completions is 16 tokens (this server's limit when lower).
        max_tokens = body.max_tokens if body.max_tokens is not None else min(16, self.svc.limits.max_new_tokens)
        params = params_from_body(body, max_tokens, body.logprobs)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        want_plp = body.prompt_logprobs is not None
        if len(prompts) == 1:
            prompt, echo = await self.echoed(prompts[0]) if body.echo else (prompts[0], None)
            return await self.respond(request, prompt, params, body.stream, False, include_usage, body.n, echo,
                                      want_plp)
        if body.stream:
            raise RequestError("prompt", "a streamed completion takes one prompt (send several without stream)")
        # Several prompts (lm-evaluation-harness batches its requests so): a request each, run together; choice
        # i * n + j is prompt i's sample j, as OpenAI numbers them. Every prompt is checked before any runs; a
        # failure after that (the queue full, say) cancels the others.
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        runs = []
        for p in prompts:
            ids = await self.svc.prompt_ids(p)
            runs.append((await self.echoed(p, ids)) if body.echo else (ids, None))
        tasks = [asyncio.ensure_future(self.unary(request, prompt, params, False, body.n, echo, f"{rid}-{i}",
                                                  want_plp)) for i, (prompt, echo) in enumerate(runs)]
        try:
            bodies = await asyncio.gather(*tasks)
        finally:  # a failure (or the client gone) cancels the prompts still running: the engine frees their blocks
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if any(b is None for b in bodies):
            return Response(status_code=499)
        choices = [{**c, "index": i * body.n + c["index"]} for i, b in enumerate(bodies) for c in b["choices"]]
        usage = {k: sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        usage["prompt_tokens_details"] = {
            "cached_tokens": sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)}
        first = bodies[0]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage, "seed": first["seed"], "memory": first["memory"],
                "stop": first["stop"], "ttft_s": first["ttft_s"],
                "duration_s": max(b["duration_s"] for b in bodies)}

    async def chat(self, body: ChatBody, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = self.svc.default_max_new_tokens
        params = params_from_body(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        messages = [{"role": m.role, "content": _text_content(m.content)} for m in body.messages]
        prompt = await self.svc.chat_prompt(messages)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await self.respond(request, prompt, params, body.stream, True, include_usage, body.n,
                                  want_plp=body.prompt_logprobs is not None)

    async def respond(self, request: Request, prompt, params: SamplingParams, stream: bool, chat: bool,
                      include_usage: bool, n: int, echo: _Echo | None = None, want_plp: bool = False):
        """One completion or chat request of ``n`` samples (OpenAI's ``choices[i]``; sample i draws with seed
        + i); a sample's own seed and memory ride in its choice when n > 1, the first's at the top level. With
        ``echo`` each choice's text (and logprobs) starts with the prompt's; ``want_plp``: the body asked for
        ``prompt_logprobs`` by name (each choice then carries them)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            body = await self.unary(request, prompt, params, chat, n, echo, rid, want_plp)
            if body is None:
                return Response(status_code=499)  # nobody is listening; the engine has dropped the request
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, **body}
        return await self.streamed(request, prompt, params, chat, include_usage, n, echo, rid, created, obj, want_plp)

    async def unary(self, request: Request, prompt, params: SamplingParams, chat: bool, n: int, echo: _Echo | None,
                    rid: str, want_plp: bool) -> dict | None:
        """A request's response body but its id, object, created and model; None if the client went away."""
        cs = await _unless_disconnected(request, self.svc.complete_n(prompt, params, "http", rid, n))
        if cs is None:
            return None
        choices = []
        for i, c in enumerate(cs):
            if echo is not None:
                echo.logprobs = c.prompt_logprobs
            lp = None
            if params.logprobs is not None:
                lp = (_chat_logprobs(self.svc, c.logprobs) if chat
                      else _completion_logprobs(self.svc, c.logprobs, 0, echo))
            choice = {"index": i, "finish_reason": _reason(c.finish_reason), "logprobs": lp,
                      "token_ids": list(c.token_ids)}
            text = c.text if echo is None else echo.text + c.text
            choice.update({"message": {"role": "assistant", "content": c.text}} if chat else {"text": text})
            if want_plp:
                choice["prompt_logprobs"] = _prompt_logprobs(self.svc, c.prompt_logprobs)
            if n > 1:
                choice.update(seed=c.seed, memory=_accounting(c.accounting), stop=c.stop)
                if params.trace:
                    choice["trace"] = _trace(self.svc, c.trace)
            choices.append(choice)
        c = cs[0]
        body = {"choices": choices,
                "usage": _usage(c.accounting, sum(x.accounting.generated_tokens for x in cs if x.accounting)),
                "seed": c.seed, "memory": _accounting(c.accounting),
                "stop": c.stop, "ttft_s": c.ttft_s, "duration_s": max(x.duration_s or 0.0 for x in cs)}
        if params.trace:
            body["trace"] = _trace(self.svc, c.trace)
        return body

    async def streamed(self, request: Request, prompt, params: SamplingParams, chat: bool, include_usage: bool,
                       n: int, echo: _Echo | None, rid: str, created: int, obj: str, want_plp: bool):
        events = self.svc.run(prompt, params, "http", rid, n)
        first = await anext(events)  # errors before the first event become a proper status code

        async def sse():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            ev, started, text_pos, left = first, set(), [0] * n, n
            generated, usage_of = 0, None
            try:
                while True:
                    i = ev.index
                    choice: dict = {"index": i, "finish_reason": _reason(ev.finish_reason) if ev.finished else None,
                                    "token_ids": list(ev.token_ids)}
                    if chat:
                        choice["delta"] = ({"content": ev.text} if i in started
                                           else {"role": "assistant", "content": ev.text})
                        if params.logprobs is not None:
                            choice["logprobs"] = _chat_logprobs(self.svc, ev.logprobs)
                        if want_plp and ev.prompt_logprobs:
                            choice["prompt_logprobs"] = _prompt_logprobs(self.svc, ev.prompt_logprobs)
                    else:
                        head = echo if echo is not None and i not in started else None  # a sample's first chunk
                        if head is not None:
                            head.logprobs = ev.prompt_logprobs
                        choice["text"] = ev.text if head is None else head.text + ev.text
                        choice["logprobs"] = (_completion_logprobs(self.svc, ev.logprobs, text_pos[i], head)
                                              if params.logprobs is not None else None)
                        if want_plp and ev.prompt_logprobs:
                            choice["prompt_logprobs"] = _prompt_logprobs(self.svc, ev.prompt_logprobs)
                    text_pos[i] += len(choice.get("text", ev.text))
                    started.add(i)
                    chunk = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                             "choices": [choice], "seed": ev.seed}
                    if params.trace and ev.trace:
                        chunk["trace"] = _trace(self.svc, ev.trace)
                    if ev.finished:
                        chunk.update(memory=_accounting(ev.accounting), stop=ev.stop, ttft_s=ev.ttft_s,
                                     duration_s=ev.duration_s)
                        left -= 1
                        generated += ev.accounting.generated_tokens if ev.accounting else 0
                        if i == 0:
                            usage_of = ev.accounting
                    # as the unary path's JSONResponse: a non-finite number is an error, never NaN on the wire
                    yield f"data: {json.dumps(chunk, allow_nan=False)}\n\n"
                    if left == 0:
                        if include_usage:
                            yield "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                                         "model": self.model_name, "choices": [],
                                                         "usage": _usage(usage_of, generated)}) + "\n\n"
                        break
                    ev = await anext(events)
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
                k = classify(e)
                err = {"message": k.message, "param": k.param, "code": k.http_status}
                yield f"data: {json.dumps({'error': err})}\n\n"
            finally:
                await events.aclose()  # a client that went away cancels the request in the engine

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def echoed(self, prompt, ids: list[int] | None = None) -> tuple:
        """(the prompt as ids, its _Echo): the ids are needed for its tokens' texts, so it is tokenized here, once."""
        ids = await self.svc.prompt_ids(prompt) if ids is None else ids
        return ids, _Echo(prompt if isinstance(prompt, str) else await self.svc.decode(ids), ids)
