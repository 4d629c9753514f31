"""The HTTP transport: the server's OpenAI-compatible API through httpx, sync and asyncio.

Text prompts and token ids go to /v1/completions, conversations to /v1/chat/completions; streams are
server-sent events with ``stream_options.include_usage`` (the usage arrives in its own chunk after the one
with ``finish_reason``, ``memory``, ``stop`` and the timings). The server's extensions to the OpenAI body give
token ids (``choices[].token_ids``), ``seed``, ``memory``, ``trace`` and ``ttft_s`` / ``duration_s``; tokenize is
POST /tokenize and info GET /v1/info. What the OpenAI format cannot carry stays None: the ids of logprob
alternatives in /v1/completions (keyed by text there). A request_id is not sent (the API has no such field;
the server names the request itself and the result carries that id).
"""

from __future__ import annotations

import dataclasses
import json
import ssl
import time
from types import MappingProxyType
from typing import Any, AsyncIterator, Iterator

import httpx

from quantserve.client.errors import (DEADLINE_EXCEEDED, INTERNAL, INVALID_ARGUMENT, ClientError, from_http,
                                     from_http_exception)
from quantserve.client.types import (Alternative, ModelInfo, Options, Plan, Request, RequestShape, Result, StreamChunk,
                                     TokenLogprob, Tokens, Usage, _Joined, engine_from_dict, memory_from_dict,
                                     plan_from_dict, trace_from_dict)

_REASON = MappingProxyType({"abort": "cancelled"})  # the HTTP API says "abort" for the engine's "cancelled"
# proto name -> OpenAI body field (the other fields keep their names)
_RENAME = MappingProxyType({"max_new_tokens": "max_tokens"})

# ------------------------------------------------------------------------------------------ conversion


def base_url(opts: Options) -> str:
    if opts.target.startswith(("http://", "https://")):
        return opts.target.rstrip("/")
    return f"{'https' if opts.tls else 'http'}://{opts.target}"


def path_and_body(req: Request, stream: bool) -> tuple[str, dict[str, Any]]:
    """The endpoint and JSON body of a request (unset sampling fields are left out: the server's default)."""
    chat = req.messages is not None
    body: dict[str, Any] = {}
    for name, value in req.sampling.given().items():
        if name == "logprobs" and chat:
            body.update(logprobs=True, top_logprobs=value)
        elif name == "response_format":  # OpenAI's object in the body
            try:
                body[name] = json.loads(value)
            except ValueError as e:
                raise ClientError(INVALID_ARGUMENT, f"response_format is not valid JSON: {e}", name) from None
        else:
            body[_RENAME.get(name, name)] = list(value) if name == "stop" else value
    if chat:
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
    else:
        body["prompt"] = list(req.prompt_ids) if req.prompt_ids is not None else (req.prompt or "")
    if req.n != 1:
        body["n"] = req.n
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _logprobs(lp: Any) -> tuple[TokenLogprob, ...]:
    if not lp:
        return ()
    if "content" in lp:  # chat: a list of {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
        return tuple(TokenLogprob(None, e["token"], float(e["logprob"]),
                                  tuple(Alternative(None, a["token"], float(a["logprob"]))
                                        for a in e.get("top_logprobs") or ())) for e in lp["content"] or ())
    # completions: parallel lists; top_logprobs maps token text -> logprob (tokens with equal text collapse)
    return tuple(TokenLogprob(None, t, float(v), tuple(Alternative(None, a, float(b)) for a, b in (top or {}).items()))
                 for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp.get("top_logprobs") or
                                      [None] * len(lp["tokens"])))


def _prompt_logprobs(entries: Any) -> tuple[TokenLogprob, ...]:
    """A choice's ``prompt_logprobs`` (null for the first prompt token, then id, text, logprob, alternatives)."""
    return tuple(TokenLogprob(int(e["token_id"]), e["token"], float(e["logprob"]),
                              tuple(Alternative(int(a["token_id"]), a["token"], float(a["logprob"]))
                                    for a in e.get("top_logprobs") or ())) for e in entries or () if e is not None)


def _text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def _usage(u: Any, memory: Any) -> Usage:
    if isinstance(u, dict):
        details = u.get("prompt_tokens_details") or {}
        return Usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)),
                     int(details.get("cached_tokens", 0)))
    m = memory or {}  # the memory object carries the same counts
    return Usage(int(m.get("prompt_tokens", 0)), int(m.get("generated_tokens", 0)),
                 int(m.get("prompt_tokens_cached", 0)))


def _final(body: dict, choice: dict, usage: Any) -> dict:
    reason = choice.get("finish_reason") or ""
    return dict(request_id=str(body.get("id", "")), finish_reason=_REASON.get(reason, reason),
                stop=body.get("stop"), seed=int(body.get("seed") or 0), usage=_usage(usage, body.get("memory")),
                memory=memory_from_dict(body.get("memory")), ttft_s=body.get("ttft_s"),
                duration_s=body.get("duration_s"), transport="http")


def result_from_body(body: dict) -> Result:
    try:
        choices = body["choices"]
        first = Result(text=_text(choices[0]), token_ids=_ids(choices[0]),
                       logprobs=_logprobs(choices[0].get("logprobs")),
                       trace=tuple(trace_from_dict(t) for t in body.get("trace") or ()),
                       prompt_logprobs=_prompt_logprobs(choices[0].get("prompt_logprobs")),
                       **_final(body, choices[0], body.get("usage")))
        if len(choices) == 1:
            return first
        # n > 1: each choice carries its own seed, stop and memory (its usage: the prompt once, its own tokens)
        samples = tuple(Result(text=_text(c), token_ids=_ids(c), logprobs=_logprobs(c.get("logprobs")),
                               trace=tuple(trace_from_dict(t) for t in c.get("trace") or ()),
                               prompt_logprobs=_prompt_logprobs(c.get("prompt_logprobs")),
                               **_final({**body, **{k: c.get(k) for k in ("seed", "stop", "memory")}}, c, None))
                        for c in sorted(choices, key=lambda c: c["index"]))
        return dataclasses.replace(first, samples=samples)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ClientError(INTERNAL, f"unexpected response from the server: {type(e).__name__}: {e}") from None


def _ids(choice: dict) -> tuple[int, ...] | None:
    ids = choice.get("token_ids")
    return None if ids is None else tuple(int(i) for i in ids)


def plan_body(shapes: tuple[RequestShape, ...]) -> dict:
    return {"requests": [{"prompt_tokens": s.prompt_tokens, "max_new_tokens": s.max_new_tokens, "count": s.count,
                          "n": s.n, "expected_new_tokens": s.expected_new_tokens} for s in shapes]}


def _plan(body: dict) -> Plan:
    try:
        return plan_from_dict(body)
    except (KeyError, TypeError, ValueError) as e:
        raise ClientError(INTERNAL, f"unexpected /v1/plan response: {type(e).__name__}: {e}") from None


def info_from_body(body: dict) -> ModelInfo:
    """GET /v1/info: the same fields as gRPC's ModelInfo."""
    try:
        return ModelInfo(model=str(body["model"]), scheme=str(body["scheme"]),
                         context_length=int(body["context_length"]), dtype=body.get("dtype"),
                         device=body.get("device"), attention=body.get("attention"),
                         vocab_size=body.get("vocab_size"), kv_bytes_per_token=body.get("kv_bytes_per_token"),
                         glue_ops=body.get("glue_ops"), embeddings=body.get("embeddings"),
                         kernels=tuple(body.get("kernels") or ()),
                         max_new_tokens_limit=body.get("max_new_tokens_limit"),
                         max_prompt_tokens=body.get("max_prompt_tokens"), speculation=body.get("speculation"),
                         memory=engine_from_dict(body.get("memory")))
    except (KeyError, TypeError, ValueError) as e:
        raise ClientError(INTERNAL, f"unexpected /v1/info response: {type(e).__name__}: {e}") from None


def tokens_from_body(body: dict) -> Tokens:
    try:
        return Tokens(tuple(int(i) for i in body["token_ids"]), tuple(str(t) for t in body["tokens"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ClientError(INTERNAL, f"unexpected /tokenize response: {type(e).__name__}: {e}") from None


class _Events:
    """Server-sent events -> StreamChunks. A sample's chunk with finish_reason is held back until the usage chunk
    (or [DONE]) arrives, then given out with its joined Result (a request of ``n`` samples: each one's, in index
    order; their usage from each sample's own memory, the request's usage counting the prompt once)."""

    def __init__(self, deadline: float | None, n: int = 1):
        self.deadline = deadline
        self.n = n
        self.joined: dict[int, _Joined] = {}
        self.last: dict[int, tuple[StreamChunk, dict, dict]] = {}  # index -> the finishing chunk, its body, choice
        self.done = False

    def feed(self, line: str) -> list[StreamChunk]:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ClientError(DEADLINE_EXCEEDED, "the call's timeout passed while the stream was running")
        if not line.startswith("data:"):
            return []
        data = line[5:].strip()
        if data == "[DONE]":
            return self.finish(None)
        try:
            body = json.loads(data)
        except ValueError:
            raise ClientError(INTERNAL, f"the server sent a malformed event: {data[:200]!r}") from None
        if "error" in body:  # an error after the headers went out: the status rides in the event
            err = body["error"] if isinstance(body["error"], dict) else {}
            raise from_http(int(err.get("code") or 500), body)
        if not body.get("choices"):
            return self.finish(body.get("usage"))
        choice = body["choices"][0]
        i = int(choice.get("index", 0))
        chunk = StreamChunk(text=_text(choice), token_ids=_ids(choice), logprobs=_logprobs(choice.get("logprobs")),
                            prompt_logprobs=_prompt_logprobs(choice.get("prompt_logprobs")),
                            trace=tuple(trace_from_dict(t) for t in body.get("trace") or ()), seed=body.get("seed"),
                            index=i)
        self.joined.setdefault(i, _Joined()).add(chunk)
        if choice.get("finish_reason") is not None:
            self.last[i] = (chunk, body, choice)
            return []
        return [chunk]

    def finish(self, usage: Any) -> list[StreamChunk]:
        if self.done:  # [DONE] after the usage chunk
            return []
        if len(self.last) < self.n:
            raise ClientError(INTERNAL, "the stream ended without a final chunk")
        self.done = True
        return [dataclasses.replace(c, result=self.joined[i].result(**_final(body, choice,
                                                                             usage if self.n == 1 else None)))
                for i, (c, body, choice) in sorted(self.last.items())]


def _decode(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _client_kw(opts: Options) -> dict[str, Any]:
    verify: Any = True
    if opts.tls and opts.ca_file:
        verify = ssl.create_default_context(cafile=opts.ca_file)
    headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    # httpx's timeout bounds each read, not the call; streams also check the call's deadline per event.
    return dict(base_url=base_url(opts), headers=headers, verify=verify, timeout=httpx.Timeout(opts.timeout))


class HttpTransport:
    """Blocking HTTP calls (httpx.Client is thread-safe; the sweep shares one)."""

    name = "http"

    def __init__(self, opts: Options):
        self._timeout = opts.timeout
        self._http = httpx.Client(**_client_kw(opts))

    def _post(self, path: str, body: dict) -> Any:
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        if r.status_code != 200:
            raise from_http(r.status_code, _decode(r))
        return r.json()

    def generate(self, req: Request) -> Result:
        return result_from_body(self._post(*path_and_body(req, stream=False)))

    def stream(self, req: Request) -> Iterator[StreamChunk]:
        path, body = path_and_body(req, stream=True)
        events = _Events(None if self._timeout is None else time.monotonic() + self._timeout, req.n)
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise from_http(r.status_code, _decode(r))
                for line in r.iter_lines():  # leaving early closes the response: the server cancels the request
                    yield from events.feed(line)
                    if events.done:
                        return
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        yield from events.finish(None)  # the body ended without [DONE]

    def _get(self, path: str) -> Any:
        try:
            r = self._http.get(path)
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        if r.status_code != 200:
            raise from_http(r.status_code, _decode(r))
        return r.json()

    def tokenize(self, text: str) -> Tokens:
        return tokens_from_body(self._post("/tokenize", {"text": text}))

    def info(self) -> ModelInfo:
        return info_from_body(self._get("/v1/info"))

    def plan(self, shapes: tuple[RequestShape, ...]) -> Plan:
        return _plan(self._post("/v1/plan", plan_body(shapes)))

    def close(self) -> None:
        self._http.close()


class AsyncHttpTransport:
    """The same calls over httpx.AsyncClient."""

    name = "http"

    def __init__(self, opts: Options):
        self._timeout = opts.timeout
        self._http = httpx.AsyncClient(**_client_kw(opts))

    async def _post(self, path: str, body: dict) -> Any:
        try:
            r = await self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        if r.status_code != 200:
            raise from_http(r.status_code, _decode(r))
        return r.json()

    async def generate(self, req: Request) -> Result:
        return result_from_body(await self._post(*path_and_body(req, stream=False)))

    async def stream(self, req: Request) -> AsyncIterator[StreamChunk]:
        path, body = path_and_body(req, stream=True)
        events = _Events(None if self._timeout is None else time.monotonic() + self._timeout, req.n)
        try:
            async with self._http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise from_http(r.status_code, _decode(r))
                async for line in r.aiter_lines():
                    for chunk in events.feed(line):
                        yield chunk
                    if events.done:
                        return
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        for chunk in events.finish(None):
            yield chunk

    async def _get(self, path: str) -> Any:
        try:
            r = await self._http.get(path)
        except httpx.HTTPError as e:
            raise from_http_exception(e) from None
        if r.status_code != 200:
            raise from_http(r.status_code, _decode(r))
        return r.json()

    async def tokenize(self, text: str) -> Tokens:
        return tokens_from_body(await self._post("/tokenize", {"text": text}))

    async def info(self) -> ModelInfo:
        return info_from_body(await self._get("/v1/info"))

    async def plan(self, shapes: tuple[RequestShape, ...]) -> Plan:
        return _plan(await self._post("/v1/plan", plan_body(shapes)))

    async def close(self) -> None:
        await self._http.aclose()
