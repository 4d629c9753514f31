"""Typed results of the client: frozen dataclasses with no transport types in them.

Both transports (gRPC, HTTP) fill the same classes, so code above the transports (the CLI, the sweep) never
looks at protos or JSON. A field a transport cannot give is ``None`` (documented per field), never a made-up
zero (an HTTP completion's logprob alternatives, for example, are keyed by text and carry no ids).

The standard library only: the server imports :class:`Sampling`'s field list from here (the one source of the
sampling controls), and the client must not pull in protobuf or grpc for HTTP.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from types import MappingProxyType, UnionType
from typing import Any, Mapping, Sequence

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; ``None`` (unset) means the server's default and is not sent.

    The one list of sampling controls, in the proto's order (SamplingParameters): the client's keyword
    arguments, the client CLI's flags and, imported by the server, the fields its gRPC and HTTP transports read
    are derived from these fields (SAMPLING_FIELDS, SAMPLING_TYPES below). A new control is a field here, in
    the proto and in the engine's server.sampling_params.SamplingParams; tests/test_protos.py holds the three equal.

    Server defaults differ by endpoint for one field: max_new_tokens is 128 over gRPC and HTTP chat, but
    16 over HTTP /v1/completions (the OpenAI default); both are capped by the server's limit. Pass it
    explicitly to compare transports."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    trace: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # 0..20: each prompt token's logprob and this many alternatives
    # OpenAI's response_format as JSON text: '{"type": "json_object"}' or '{"type": "json_schema", "json_schema":
    # {"schema": {...}}}' (make_sampling also takes the mapping)
    response_format: str | None = None
    speculate: bool | None = None  # False: this request never drafts (server default: it does, under --speculate)

    def given(self) -> dict[str, Any]:
        """The fields that are set, by proto name (``stop`` only when non-empty)."""
        values = {f: getattr(self, f) for f in SAMPLING_FIELDS}
        return {f: v for f, v in values.items() if (v if SAMPLING_TYPES[f] is tuple else v is not None)}


def _value_type(hint: Any) -> type:
    """float for ``float | None``, tuple for ``tuple[str, ...]``, dict for ``dict[int, float] | None``."""
    if typing.get_origin(hint) in (typing.Union, UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
# name -> the type of a given value: float, int, bool, str (JSON text: response_format), tuple (a repeated field:
# stop) or dict (a map: logit_bias)
SAMPLING_TYPES: Mapping[str, type] = MappingProxyType(
    {f: _value_type(t) for f, t in typing.get_type_hints(Sampling).items() if f in SAMPLING_FIELDS})


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant, tool or developer
    content: str


@dataclass(frozen=True)
class Candidate:
    """One trace candidate: ``prob`` is its probability at that stage (renormalised over the survivors)."""

    token_id: int
    token: str
    prob: float


@dataclass(frozen=True)
class Alternative:
    """One of the ``logprobs`` most probable tokens at a step. ``token_id`` is None over HTTP."""

    token_id: int | None
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob under the model's raw distribution. ``token_id`` is None over HTTP when the
    response does not say it (completions' legacy format has texts only)."""

    token_id: int | None
    token: str
    logprob: float
    top: tuple[Alternative, ...] = ()


TRACE_STAGES = ("penalties", "temperature", "min_p", "top_k", "top_p")  # the sampling order's stages
TRACE_CONTROLS = ("min_p", "top_k", "top_p")  # the stages that remove tokens (kept_*, mass_*)


@dataclass(frozen=True)
class TraceStep:
    """One generated step. The candidate lists hold the top ``trace`` tokens after each stage of the sampling order
    (every list the same tokens: the temperature stage's top N); the counts, masses and entropy are exact over the
    whole vocabulary, so they say what each control removed."""

    after_penalties: tuple[Candidate, ...]  # after logit_bias, the penalties and the JSON mask (T = 1)
    after_temperature: tuple[Candidate, ...]
    after_min_p: tuple[Candidate, ...]
    after_top_k: tuple[Candidate, ...]
    after_top_p: tuple[Candidate, ...]  # what the token was drawn from
    kept_min_p: int  # tokens that survived min-p (every token not masked out when min-p is off)
    kept_top_k: int  # tokens that survived min-p and top-k
    kept_top_p: int  # tokens that survived min-p, top-k and top-p: the support of the draw
    mass_min_p: float  # probability after temperature of the tokens min-p kept
    mass_top_k: float  # ... of the tokens top-k kept as well
    mass_top_p: float  # ... of the tokens top-p kept as well
    entropy: float  # nats, of the distribution the token was drawn from (0 when greedy)
    # the token the server's speculation drafted for this step, and its text; None: none drafted. The draft was
    # kept iff it is the token drawn (a rejected one is what the draw replaced).
    draft_token_id: int | None = None
    draft_token: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache (OpenAI's prompt_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class EngineMemory:
    """The engine's totals (when the request finished, or when ``info`` was asked)."""

    weight_bytes: int
    kv_capacity_bytes: int
    kv_used_bytes: int  # blocks reserved by running requests
    kv_block_size: int  # tokens per KV block
    running: int
    queued: int
    kv_cached_bytes: int = 0  # prefix-cache blocks no running request holds (evicted when space is needed)
    prefix_cache: bool = False  # whether the server shares prompt prefixes between requests
    prefix_hit_tokens: int = 0  # prompt tokens mapped from the cache since the server started
    prefix_queried_tokens: int = 0  # prompt tokens of every admitted request since the server started
    prefix_evictions: int = 0  # cached blocks evicted for other requests' blocks
    preemptions: int = 0  # requests' samples preempted for KV blocks since the server started
    recomputed_tokens: int = 0  # positions whose K/V was computed again after preemptions
    speculated_tokens: int = 0  # tokens drafted and verified (speculative decoding) since the server started
    accepted_tokens: int = 0  # of those, the tokens kept
    draft_weight_bytes: int = 0  # the draft model's weights (--speculate draft)
    draft_kv_capacity_bytes: int = 0  # its KV pool (a share of the KV budget)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.speculated_tokens if self.speculated_tokens else 0.0


@dataclass(frozen=True)
class MemoryAccounting:
    """What one request cost in memory (the proto's MemoryAccounting)."""

    kv_bytes_per_token: int
    kv_blocks_reserved: int
    kv_bytes_reserved: int
    kv_bytes_used: int
    activation_peak_bytes: int
    attention: str
    engine: EngineMemory | None
    # Of kv_bytes_reserved: blocks mapped from the prefix cache or held by another request too (shared), and the
    # rest (own); own + shared = reserved.
    kv_bytes_shared: int = 0
    kv_bytes_own: int = 0
    prompt_tokens_cached: int = 0
    kv_dtype: str = ""  # the dtype its K/V was held in
    preemptions: int = 0  # times it was preempted (its blocks released, taken back later by recomputing)
    recomputed_tokens: int = 0  # positions whose K/V it computed again after those preemptions
    speculated_tokens: int = 0  # tokens it drafted (speculative decoding), each verified with the others of a step
    accepted_tokens: int = 0  # of those, the tokens its draws accepted
    kv_bytes_speculative: int = 0  # the most KV its drafts held at once beyond its tokens'
    kv_bytes_draft: int = 0  # the most of a draft model's KV cache it held (--speculate draft)


@dataclass(frozen=True)
class Result:
    """One finished request."""

    request_id: str
    text: str
    token_ids: tuple[int, ...] | None  # None only from a server that does not return them
    finish_reason: str  # "length", "stop", "cancelled" or "error" (same words on both transports)
    stop: str | None  # the stop string that matched, "<eos>", or None
    seed: int  # give it back to reproduce the request exactly
    usage: Usage
    memory: MemoryAccounting | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per generated token when logprobs was set
    trace: tuple[TraceStep, ...] = ()  # one per generated token when trace was set
    ttft_s: float | None = None  # server-side time to first token (from arrival)
    duration_s: float | None = None  # server-side duration
    transport: str = "grpc"
    # A request of n > 1 samples: every sample in index order (each with its own seed and memory), the first
    # being this Result's own fields; () for n = 1.
    samples: tuple["Result", ...] = ()
    # with prompt_logprobs: prompt tokens 1.. (the first has none), each under the model (teacher-forced)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def token_keys(self) -> tuple:
        """The generated tokens as comparable keys: ids when the transport gives them, else the tokens' texts
        from ``logprobs`` (request logprobs=0 over HTTP). Empty when neither is available."""
        if self.token_ids is not None:
            return self.token_ids
        return tuple(lp.token for lp in self.logprobs)


@dataclass(frozen=True)
class StreamChunk:
    """What arrived since the previous chunk. ``result`` (the whole request) is set on the last chunk only."""

    text: str
    token_ids: tuple[int, ...] | None  # None only from a server that does not return them
    logprobs: tuple[TokenLogprob, ...] = ()
    trace: tuple[TraceStep, ...] = ()
    seed: int | None = None
    result: Result | None = None
    index: int = 0  # which sample (a request of n > 1: chunks of the samples interleave; each ends with a result)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on a sample's first chunk, with prompt_logprobs


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What is served (gRPC ModelInfo, HTTP GET /v1/info: the same fields)."""

    model: str
    scheme: str
    context_length: int
    dtype: str | None = None
    device: str | None = None
    attention: str | None = None
    vocab_size: int | None = None
    kv_bytes_per_token: int | None = None
    glue_ops: str | None = None
    embeddings: str | None = None
    kernels: tuple[str, ...] = ()  # per projection computation: the path at each row count, as measured
    speculation: str | None = None  # off, ngram, or the draft model: "draft <model> (<scheme>)"
    max_new_tokens_limit: int | None = None
    max_prompt_tokens: int | None = None
    memory: EngineMemory | None = None


@dataclass
class _Joined:
    """Accumulates stream chunks into one Result (both transports' streams end through it)."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    has_ids: bool = True
    logprobs: list[TokenLogprob] = field(default_factory=list)
    trace: list[TraceStep] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.token_ids is None:
            self.has_ids = False
        else:
            self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.trace.extend(chunk.trace)

    def result(self, **final: Any) -> Result:
        return Result(text="".join(self.text), token_ids=tuple(self.ids) if self.has_ids else None,
                      logprobs=tuple(self.logprobs), trace=tuple(self.trace),
                      prompt_logprobs=tuple(self.prompt_logprobs), **final)


def to_dict(obj: Any) -> Any:
    """A result (or any of these dataclasses, or a sequence of them) as JSON-ready plain data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, Usage):
            d["total_tokens"] = obj.total_tokens
        return d
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    return obj


def trace_from_dict(d: Mapping[str, Any]) -> TraceStep:
    """A TraceStep from its JSON form (the HTTP body's and :func:`to_dict`'s, which are the same)."""
    def cands(xs: Sequence[Mapping[str, Any]]) -> tuple[Candidate, ...]:
        return tuple(Candidate(int(c["token_id"]), str(c["token"]), float(c["prob"])) for c in xs)

    return TraceStep(**{f"after_{s}": cands(d[f"after_{s}"]) for s in TRACE_STAGES},
                     **{f"kept_{c}": int(d[f"kept_{c}"]) for c in TRACE_CONTROLS},
                     **{f"mass_{c}": float(d[f"mass_{c}"]) for c in TRACE_CONTROLS}, entropy=float(d["entropy"]),
                     draft_token_id=d.get("draft_token_id"), draft_token=d.get("draft_token"))


def engine_from_dict(d: Mapping[str, Any] | None) -> EngineMemory | None:
    if not d:
        return None
    return EngineMemory(**{f.name: (bool if f.name == "prefix_cache" else int)(d.get(f.name, 0))
                           for f in dataclasses.fields(EngineMemory)})


def memory_from_dict(d: Mapping[str, Any] | None) -> MemoryAccounting | None:
    """MemoryAccounting from the HTTP ``memory`` object (which also carries prompt/generated token counts)."""
    if not d:
        return None
    ints = ("kv_bytes_per_token", "kv_blocks_reserved", "kv_bytes_reserved", "kv_bytes_used",
            "activation_peak_bytes", "kv_bytes_shared", "kv_bytes_own", "prompt_tokens_cached", "preemptions",
            "recomputed_tokens", "speculated_tokens", "accepted_tokens", "kv_bytes_speculative", "kv_bytes_draft")
    return MemoryAccounting(**{k: int(d.get(k, 0)) for k in ints}, attention=str(d.get("attention", "")),
                            engine=engine_from_dict(d.get("engine")), kv_dtype=str(d.get("kv_dtype", "")))


@dataclass(frozen=True)
class RequestShape:
    """A kind of request for :meth:`Client.plan`: ``count`` of them, sent one after another."""

    prompt_tokens: int
    max_new_tokens: int
    count: int = 1
    n: int = 1  # samples per request (they share the prompt's blocks on the server)
    expected_new_tokens: int = 0  # new tokens a request is expected to produce (0: max_new_tokens)


@dataclass(frozen=True)
class Refusal:
    """Why planned requests would be refused: the code and message a real request gets."""

    code: str  # invalid_argument, resource_exhausted or unavailable (ClientError's codes)
    message: str
    param: str | None = None


@dataclass(frozen=True)
class ShapePlan:
    shape: RequestShape
    kv_blocks: int  # per request
    kv_bytes_reserved: int  # per request: what MemoryAccounting.kv_bytes_reserved will report
    activation_peak_bytes: int  # its prefill's estimated peak when it prefills alone
    fit_now: int  # how many such requests could run at once now ...
    fit_now_limited_by: str  # ... limited by kv_blocks or max_batch (refused: none, see refusal)
    fit_empty: int  # ... and in an idle engine
    fit_empty_limited_by: str
    admitted: int  # what happens to the ``count`` requests sent now
    queued: int
    refused: int
    refusal: Refusal | None = None
    kv_blocks_shared: int = 0  # n > 1: the prompt's blocks every sample of a request holds (once in kv_blocks)
    kv_blocks_admission: int = 0  # per request: the blocks it takes when admitted
    kv_blocks_expected: int = 0  # per request at the expected output length
    fit_expected: int = 0  # how many an idle server runs at once at the expected length ...
    fit_expected_limited_by: str = ""  # ... limited by kv_blocks or max_batch


@dataclass(frozen=True)
class Plan:
    """The server's capacity preflight (``Plan`` / ``POST /v1/plan``), from the engine's own accounting."""

    shapes: tuple[ShapePlan, ...]
    engine: EngineMemory | None
    kv_bytes_per_token: int
    kv_capacity_blocks: int
    kv_free_blocks: int
    max_batch: int
    max_queue: int
    max_prefill_tokens: int
    attention: str
    kv_admission: str = ""  # "on-demand" or "reserve"
    kv_dtype: str = ""  # what the KV cache holds: "bfloat16", "int8", ...


def parse_shape(text: str) -> RequestShape:
    """``PROMPTxMAX_NEW[xCOUNT[xN]][~EXPECTED]`` (``512x256x8``; ``1024x128x4x8``: 4 requests of 8 samples;
    ``200x2048x8~300``: 8 requests expected to stop near 300 new tokens) as a RequestShape; ValueError saying the
    form otherwise."""
    body, tilde, expected = text.strip().lower().partition("~")
    parts = body.split("x")
    if len(parts) not in (2, 3, 4) or not all(p.strip().isdigit() for p in parts) or \
            (tilde and not expected.strip().isdigit()):
        raise ValueError(f"a request shape is PROMPTxMAX_NEW[xCOUNT[xN]][~EXPECTED] in whole numbers, e.g. 512x256x8 "
                         f"or 200x2048x8~300; got {text!r}")
    shape = RequestShape(*(int(p) for p in parts))
    return dataclasses.replace(shape, expected_new_tokens=int(expected)) if expected else shape


def plan_from_dict(d: Mapping[str, Any]) -> Plan:
    """A Plan from the HTTP body, or from the gRPC message as a dict (whose int64 fields are strings)."""

    def ints(src: Mapping[str, Any], cls: type, skip: tuple[str, ...] = ()) -> dict:
        return {f.name: int(src.get(f.name, 0)) for f in dataclasses.fields(cls)
                if f.type in ("int", int) and f.name not in skip}

    def shape_plan(p: Mapping[str, Any]) -> ShapePlan:
        r = p.get("refusal")
        refusal = Refusal(str(r["code"]).lower(), str(r["message"]), r.get("param") or None) if r else None
        shape = {**ints(p["shape"], RequestShape), "n": int(p["shape"].get("n", 1))}  # absent: an older server
        return ShapePlan(shape=RequestShape(**shape), refusal=refusal,
                         fit_now_limited_by=str(p["fit_now_limited_by"]),
                         fit_empty_limited_by=str(p["fit_empty_limited_by"]),
                         fit_expected_limited_by=str(p.get("fit_expected_limited_by", "")), **ints(p, ShapePlan))

    return Plan(shapes=tuple(shape_plan(p) for p in d["shapes"]), engine=engine_from_dict(d.get("engine")),
                attention=str(d.get("attention", "")), kv_admission=str(d.get("kv_admission", "")),
                kv_dtype=str(d.get("kv_dtype", "")), **ints(d, Plan))


@dataclass(frozen=True)
class Options:
    """How to reach the server. ``target`` is "host:port" (or, with ``http``, also a full http(s):// URL);
    ``timeout`` is seconds per call (None: no deadline); ``ca_file`` a PEM bundle for TLS (None: the system's
    roots)."""

    target: str
    http: bool = False
    tls: bool = False
    ca_file: str | None = None
    api_key: str | None = None
    timeout: float | None = 60.0

    @property
    def transport(self) -> str:
        return "http" if self.http else "grpc"


@dataclass(frozen=True)
class Request:
    """One generation request: exactly one of ``prompt`` (text), ``prompt_ids`` or ``messages``."""

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    sampling: Sampling = Sampling()
    request_id: str | None = None
    n: int = 1  # samples of the prompt; sample i draws with seed + i (the server's rule)
