"""The Python client: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio), over gRPC or HTTP.

    from quantserve.client import Client
    with Client("127.0.0.1:50051") as c:                      # Client("127.0.0.1:8000", http=True) for HTTP
        r = c.generate("The river", temperature=0.8, top_p=0.9, seed=1, max_new_tokens=32, trace=5)
        print(r.text, r.seed, r.memory.kv_bytes_reserved, r.trace[0].entropy)
        for chunk in c.stream("The river", max_new_tokens=32):
            print(chunk.text, end="")                          # chunk.result is set on the last chunk

Sampling parameters are keyword arguments, the fields of :class:`quantserve.client.types.Sampling` (named as in the
proto: temperature, top_k, top_p, seed, ...); one left out is not sent, so the server's default applies.
Every failure is a :class:`quantserve.client.errors.ClientError`.
"""

from __future__ import annotations

import json
import numbers
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence, Union

from quantserve.client.errors import INVALID_ARGUMENT, ClientError
from quantserve.client.types import (SAMPLING_FIELDS, SAMPLING_TYPES, Message, ModelInfo, Options, Plan, Request,
                                     RequestShape, Result, Sampling, StreamChunk, Tokens)

GRPC_PORT, HTTP_PORT = 50051, 8000
Prompt = Union[str, Sequence[int]]
MessageLike = Union[Message, Mapping[str, str], Sequence[str]]

# what make_sampling accepts for each type of field (quantserve.client.types.SAMPLING_TYPES), as its errors say it
_KINDS = {float: "a number", int: "an integer", bool: "a bool", tuple: "a string or a list of strings",
          dict: "a mapping of token ids (integers) to numbers", str: "JSON text or a mapping"}


def default_target(http: bool) -> str:
    return f"127.0.0.1:{HTTP_PORT if http else GRPC_PORT}"


def make_sampling(**kw: Any) -> Sampling:
    """Sampling from keyword arguments, type-checked here (a bool is not a number, 5.0 is not an integer);
    values are checked by the server, whose messages name the parameter."""
    unknown = sorted(set(kw) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_FIELDS)}")
    out: dict[str, Any] = {}
    for name, v in kw.items():
        if v is None:
            continue
        kind = SAMPLING_TYPES[name]
        if kind is float:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
            v = float(v) if ok else v
        elif kind is int:
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
            v = int(v) if ok else v
        elif kind is bool:
            ok = isinstance(v, bool)
        elif kind is str:  # JSON text (response_format): a mapping is written as JSON
            if isinstance(v, Mapping):
                try:
                    v = json.dumps(v)
                except (TypeError, ValueError):
                    pass
            ok = isinstance(v, str)
        elif kind is dict:  # a map (logit_bias): token id -> number
            ok = isinstance(v, Mapping) and all(
                isinstance(k, numbers.Integral) and not isinstance(k, bool) and isinstance(b, numbers.Real)
                and not isinstance(b, bool) for k, b in v.items())
            v = {int(k): float(b) for k, b in v.items()} if ok else v
        else:  # a repeated string (stop): one string or a sequence of strings
            v = (v,) if isinstance(v, str) else v
            ok = isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)
            v = tuple(v) if ok else v
        if not ok:
            raise ClientError(INVALID_ARGUMENT, f"{name} must be {_KINDS[kind]}, got {type(v).__name__} {v!r}", name)
        out[name] = v
    return Sampling(**out)


def prompt_request(prompt: Prompt, sampling: Sampling, request_id: str | None = None, n: int = 1) -> Request:
    if isinstance(prompt, str):
        return Request(prompt=prompt, sampling=sampling, request_id=request_id, n=n)
    ids = tuple(prompt)
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise ClientError(INVALID_ARGUMENT, "prompt must be a string or a sequence of token ids (integers)",
                          "prompt_ids")
    return Request(prompt_ids=tuple(int(i) for i in ids), sampling=sampling, request_id=request_id, n=n)


def chat_request(messages: Iterable[MessageLike], sampling: Sampling, request_id: str | None = None,
                 n: int = 1) -> Request:
    """Messages as Message objects, {"role", "content"} mappings or (role, content) pairs."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Message):
            out.append(m)
        elif isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
            out.append(Message(m["role"], m["content"]))
        elif isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(x, str) for x in m):
            out.append(Message(m[0], m[1]))
        else:
            raise ClientError(INVALID_ARGUMENT, f"messages[{i}] must be a Message, a {{role, content}} mapping or "
                                                f"a (role, content) pair of strings, got {m!r}", "messages")
    return Request(messages=tuple(out), sampling=sampling, request_id=request_id, n=n)


def make_options(target: str | None, http: bool, tls: bool, ca_file: str | None, api_key: str | None,
                 timeout: float | None) -> Options:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    return Options(target=target or default_target(http), http=http, tls=tls or bool(ca_file), ca_file=ca_file,
                   api_key=api_key, timeout=timeout)


ShapeLike = Union[RequestShape, Sequence[int]]


def plan_shapes(shapes: Iterable[ShapeLike] | None, prompt_tokens: int | None, max_new_tokens: int | None,
                concurrency: int) -> tuple[RequestShape, ...]:
    """The shapes of a plan call; their values are the server's to check (its errors name the field)."""
    if shapes is None:
        if prompt_tokens is None or max_new_tokens is None:
            raise ClientError(INVALID_ARGUMENT, "plan needs shapes, or prompt_tokens and max_new_tokens",
                              "prompt_tokens" if prompt_tokens is None else "max_new_tokens")
        return (RequestShape(prompt_tokens, max_new_tokens, concurrency),)
    if prompt_tokens is not None or max_new_tokens is not None:
        raise ClientError(INVALID_ARGUMENT, "give shapes, or prompt_tokens and max_new_tokens, not both", "shapes")
    return tuple(s if isinstance(s, RequestShape) else RequestShape(*s) for s in shapes)


class Client:
    """A blocking client over gRPC (default) or HTTP (``http=True``). Thread-safe: one client can serve many
    threads (the CLI's sweep does). Use it as a context manager, or call :meth:`close`."""

    def __init__(self, target: str | None = None, *, http: bool = False, tls: bool = False,
                 ca_file: str | None = None, api_key: str | None = None, timeout: float | None = 60.0):
        self.options = make_options(target, http, tls, ca_file, api_key, timeout)
        if http:
            from quantserve.client.transport_http import HttpTransport

            self._t: Any = HttpTransport(self.options)
        else:
            from quantserve.client.transport_grpc import GrpcTransport

            self._t = GrpcTransport(self.options)

    @property
    def transport(self) -> str:
        return self.options.transport

    def generate(self, prompt: Prompt, *, request_id: str | None = None, n: int = 1, **sampling: Any) -> Result:
        """The whole completion of a text prompt (or of token ids). ``n`` > 1: that many samples, the prompt
        prefilled once on the server; ``Result.samples`` holds them (sample i drew with seed + i)."""
        return self._t.generate(prompt_request(prompt, make_sampling(**sampling), request_id, n))

    def stream(self, prompt: Prompt, *, request_id: str | None = None, n: int = 1,
               **sampling: Any) -> Iterator[StreamChunk]:
        """Chunks as they are generated; a sample's last one carries ``result`` (``n`` > 1: the samples' chunks
        interleave, each with its ``index``). Stopping early cancels the request."""
        return self._t.stream(prompt_request(prompt, make_sampling(**sampling), request_id, n))

    def chat(self, messages: Iterable[MessageLike], *, request_id: str | None = None, n: int = 1,
             **sampling: Any) -> Result:
        """The assistant's reply to a conversation (the server applies the model's chat template); ``n`` as in
        :meth:`generate`."""
        return self._t.generate(chat_request(messages, make_sampling(**sampling), request_id, n))

    def chat_stream(self, messages: Iterable[MessageLike], *, request_id: str | None = None, n: int = 1,
                    **sampling: Any) -> Iterator[StreamChunk]:
        return self._t.stream(chat_request(messages, make_sampling(**sampling), request_id, n))

    def tokenize(self, text: str) -> Tokens:
        """The server tokenizer's ids and token texts."""
        return self._t.tokenize(text)

    def info(self) -> ModelInfo:
        return self._t.info()

    def plan(self, shapes: Iterable[ShapeLike] | None = None, *, prompt_tokens: int | None = None,
             max_new_tokens: int | None = None, concurrency: int = 1) -> Plan:
        """The server's capacity preflight: for each shape, KV reserved per request, how many fit now and when
        idle, the prefill activation peak, and how many of ``count`` sent now would be admitted, queued or
        refused (and why). Shapes are RequestShape or (prompt_tokens, max_new_tokens[, count]); or give one
        as ``prompt_tokens``, ``max_new_tokens`` and ``concurrency``."""
        return self._t.plan(plan_shapes(shapes, prompt_tokens, max_new_tokens, concurrency))

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """The asyncio client: the same methods as :class:`Client`, awaited (``stream`` / ``chat_stream`` are
    async iterators). Create it inside the event loop that uses it; ``async with`` closes it."""

    def __init__(self, target: str | None = None, *, http: bool = False, tls: bool = False,
                 ca_file: str | None = None, api_key: str | None = None, timeout: float | None = 60.0):
        self.options = make_options(target, http, tls, ca_file, api_key, timeout)
        if http:
            from quantserve.client.transport_http import AsyncHttpTransport

            self._t: Any = AsyncHttpTransport(self.options)
        else:
            from quantserve.client.transport_grpc import AsyncGrpcTransport

            self._t = AsyncGrpcTransport(self.options)

    @property
    def transport(self) -> str:
        return self.options.transport

    async def generate(self, prompt: Prompt, *, request_id: str | None = None, n: int = 1,
                       **sampling: Any) -> Result:
        return await self._t.generate(prompt_request(prompt, make_sampling(**sampling), request_id, n))

    def stream(self, prompt: Prompt, *, request_id: str | None = None, n: int = 1,
               **sampling: Any) -> AsyncIterator[StreamChunk]:
        return self._t.stream(prompt_request(prompt, make_sampling(**sampling), request_id, n))

    async def chat(self, messages: Iterable[MessageLike], *, request_id: str | None = None, n: int = 1,
                   **sampling: Any) -> Result:
        return await self._t.generate(chat_request(messages, make_sampling(**sampling), request_id, n))

    def chat_stream(self, messages: Iterable[MessageLike], *, request_id: str | None = None, n: int = 1,
                    **sampling: Any) -> AsyncIterator[StreamChunk]:
        return self._t.stream(chat_request(messages, make_sampling(**sampling), request_id, n))

    async def tokenize(self, text: str) -> Tokens:
        return await self._t.tokenize(text)

    async def info(self) -> ModelInfo:
        return await self._t.info()

    async def plan(self, shapes: Iterable[ShapeLike] | None = None, *, prompt_tokens: int | None = None,
                   max_new_tokens: int | None = None, concurrency: int = 1) -> Plan:
        return await self._t.plan(plan_shapes(shapes, prompt_tokens, max_new_tokens, concurrency))

    async def close(self) -> None:
        await self._t.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
