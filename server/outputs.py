"""What the engine hands its callers: per-request events, the memory accounting, and the request errors.

Plain frozen dataclasses with no torch types, so transports convert them to proto / JSON without touching the
engine. Every request's stream is a sequence of :class:`Event` objects; the last one has ``finished=True``,
a ``finish_reason`` and the request's :class:`Accounting`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# finish_reason values
LENGTH = "length"  # max_new_tokens reached
STOP = "stop"  # EOS or a stop string (Event.stop says which)
CANCELLED = "cancelled"  # the caller cancelled, or the engine shut down before it finished
ERROR = "error"  # the engine failed while running it (Event.error holds the message)


class RequestError(ValueError):
    """A request that can never run as given (empty prompt, too long for the context, larger than the KV
    pool): rejected before any work. ``param`` names the offending field. INVALID_ARGUMENT / HTTP 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class OverloadedError(RuntimeError):
    """The waiting queue is full right now; retrying later can succeed. RESOURCE_EXHAUSTED / HTTP 429."""


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and takes no new requests. UNAVAILABLE / HTTP 503."""


@dataclass(frozen=True)
class EngineTotals:
    weight_bytes: int  # bytes of every weight tensor as loaded (quantized tensors at their own size)
    kv_capacity_bytes: int  # the preallocated pool
    kv_used_bytes: int  # blocks reserved by running requests, in bytes
    kv_block_size: int
    running: int
    queued: int  # accepted, waiting for KV blocks or a batch slot
    kv_cached_bytes: int = 0  # prefix-cache blocks no running request holds: kept for hits, evicted when needed
    prefix_cache: bool = False  # whether prompt prefixes are shared (server/kv_pool.py)
    prefix_hit_tokens: int = 0  # prompt tokens mapped from the cache, since the engine started
    prefix_queried_tokens: int = 0  # prompt tokens of every admitted request, since the engine started
    prefix_evictions: int = 0  # cached blocks evicted for another request's fresh blocks
    preemptions: int = 0  # requests' samples preempted for KV blocks (on-demand admission), since the engine started
    recomputed_tokens: int = 0  # positions whose K/V was computed again after preemptions, since the engine started
    speculated_tokens: int = 0  # tokens drafted and verified (server/speculate.py), since the engine started
    accepted_tokens: int = 0  # of those, the tokens kept
    draft_weight_bytes: int = 0  # the draft model's weights (--speculate draft, server/draft.py)
    draft_kv_capacity_bytes: int = 0  # its KV pool (a share of the KV budget)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.speculated_tokens if self.speculated_tokens else 0.0


@dataclass(frozen=True)
class Accounting:
    """One request's memory accounting (docs/design.md, "Per-request memory accounting")."""

    prompt_tokens: int
    generated_tokens: int
    kv_bytes_per_token: int  # 2 * layers * kv_heads * head_dim * bytes(dtype)
    kv_blocks_reserved: int  # the most KV blocks it held at once (--kv-admission reserve: its whole reservation)
    kv_bytes_reserved: int  # kv_blocks_reserved * block_size * kv_bytes_per_token
    kv_bytes_used: int  # (tokens whose K/V was written) * kv_bytes_per_token
    activation_peak_bytes: int  # estimated peak of this request's prefill steps (quant.shape.memory)
    attention: str  # the attention implementation the estimate assumed (the engine's)
    engine: EngineTotals
    # Of kv_bytes_reserved: the blocks it mapped from the prefix cache, or that another live request also held while
    # it held them (shared), and the rest (own): own + shared = reserved. A shared block is counted once in the
    # engine's kv_used_bytes however many requests hold it.
    kv_bytes_shared: int = 0
    kv_bytes_own: int = 0
    # Prompt tokens it did not prefill: mapped from the prefix cache or, for a sample after its request's first,
    # from the first sample's blocks.
    prompt_tokens_cached: int = 0
    kv_dtype: str = ""  # the dtype its K/V was held in (kv_bytes_per_token's)
    preemptions: int = 0  # times it was preempted (its blocks released, taken back later by recomputing)
    recomputed_tokens: int = 0  # positions whose K/V it computed again after those preemptions
    speculated_tokens: int = 0  # tokens it drafted (server/speculate.py): each verified in a step with its others
    accepted_tokens: int = 0  # of those, the tokens its draws accepted
    kv_bytes_speculative: int = 0  # the most KV its drafts held at once beyond its tokens' (returned once verified)
    kv_bytes_draft: int = 0  # the most of the draft model's KV cache it held (server/draft.py)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # under the model's raw distribution (log_softmax of the logits), >= -9999.0 (LOGPROB_FLOOR)
    top: tuple[tuple[int, float], ...]  # the N most probable (id, logprob), N = params.logprobs


@dataclass(frozen=True)
class TraceStep:
    """Candidates of one generated step after each stage of the documented order (server/sampling.py), most
    probable first (N = params.trace); every stage lists the same N tokens, the temperature stage's top N."""

    penalties: tuple[tuple[int, float], ...]  # after logit_bias, the penalties and the JSON mask (T = 1)
    temperature: tuple[tuple[int, float], ...]
    min_p: tuple[tuple[int, float], ...]
    top_k: tuple[tuple[int, float], ...]
    top_p: tuple[tuple[int, float], ...]  # what the token was drawn from
    # Exact over the whole vocabulary, unlike the top-N lists: what each control removed.
    kept_min_p: int  # tokens that survived min-p (every token not at -inf when min-p is off)
    kept_top_k: int  # tokens that survived min-p and top-k
    kept_top_p: int  # tokens that survived min-p, top-k and top-p: the support of the draw
    mass_min_p: float  # probability after temperature of the tokens min-p kept
    mass_top_k: float  # ... of the tokens top-k kept as well
    mass_top_p: float  # ... of the tokens top-p kept as well
    entropy: float  # nats, of the distribution the token was drawn from (0 when greedy)
    draft: int | None = None  # the token speculation drafted for this position (None: none); kept iff it was drawn


@dataclass(frozen=True)
class Event:
    request_id: str
    seed: int
    text: str = ""  # new text since the previous event (never half a UTF-8 character, never part of a stop)
    token_ids: tuple[int, ...] = ()  # tokens generated since the previous event
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token in token_ids when params.logprobs is set
    trace: tuple[TraceStep, ...] = ()  # one per token in token_ids when params.trace is set
    finished: bool = False
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that matched, or "<eos>" for an EOS token
    accounting: Accounting | None = None  # on the final event
    error: str | None = None
    ttft_s: float | None = None  # on the final event: time from submit to the first token
    duration_s: float | None = None  # on the final event: time from submit to the end
    index: int = 0  # which sample of the request (a request of n samples: 0 .. n-1, each with its own final event)
    # with params.prompt_logprobs, on the sample's first event: prompt tokens 1.. (token 0 has no logprob)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole request's result, assembled from its events (see :func:`collect`)."""

    request_id: str
    seed: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop: str | None
    logprobs: tuple[TokenLogprob, ...]
    trace: tuple[TraceStep, ...]
    accounting: Accounting | None
    error: str | None
    ttft_s: float | None
    duration_s: float | None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. when params.prompt_logprobs was set


def collect(events) -> Completion:
    """Join a finished request's events into one :class:`Completion`."""
    text, ids, lps, trace, prompt = [], [], [], [], []
    last = None
    for ev in events:
        prompt.extend(ev.prompt_logprobs)
        text.append(ev.text)
        ids.extend(ev.token_ids)
        lps.extend(ev.logprobs)
        trace.extend(ev.trace)
        last = ev
    if last is None or not last.finished:
        raise ValueError("the event stream ended without a final event")
    return Completion(
        request_id=last.request_id, seed=last.seed, text="".join(text), token_ids=tuple(ids),
        finish_reason=last.finish_reason, stop=last.stop, logprobs=tuple(lps), trace=tuple(trace),
        accounting=last.accounting, error=last.error, ttft_s=last.ttft_s, duration_s=last.duration_s,
        prompt_logprobs=tuple(prompt),
    )
