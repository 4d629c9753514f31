"""Per-request sampling parameters and the batched sampler (docs/design.md, "Sampling: the documented order").

For every request and every generated token the sampler applies, on fp32 logits (before it, the engine sets the
EOS logits to -inf while a request has fewer than ``min_tokens`` tokens):

1. logit bias (``logit_bias``, OpenAI's): each listed token id's bias, in [-100, 100], is added to its raw logit
   (-100 all but bans a token, +100 all but forces it);
2. repetition penalty (if != 1), HF semantics: every token id seen in the request's prompt or generated tokens
   gets ``logit / p`` when ``logit > 0`` and ``logit * p`` otherwise;
3. presence and frequency penalties (OpenAI's definitions, over the generated tokens only):
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``, count = times the id was generated;
   then the structured-output mask (``response_format``, server/grammar.py): tokens the grammar forbids get -inf;
4. temperature: ``logits / T``; ``T == 0`` is greedy (argmax of the logits after 1-3) and skips 5-8;
5. min-p: keep the tokens whose probability after temperature is >= min_p x the most probable token's
   (min_p = 0: off; the most probable token always survives). Before top-k and top-p, as vLLM does;
   transformers' MinPLogitsWarper runs after them, which differs only when top-p cuts inside min-p's set;
6. top-k: keep the k highest logits (k = 0: off; tokens tied with the k-th are kept, as transformers does);
7. top-p: softmax over what min-p and top-k kept, sorted descending; keep the smallest prefix whose cumulative
   probability reaches p (the crossing token is kept), i.e. a token survives iff the mass strictly before it
   is < p. p = 1: off; p = 0: only the most probable token. The first token always survives;
8. renormalise the survivors and draw one token with the request's own random stream.

Every step is skipped for the whole batch when no row uses it (host flags on :class:`SamplingBatch`), so a request
that uses none of the controls pays for none of them.

Random stream. A draw must be reproducible from ``(seed, step)`` alone: the same request must produce the same
tokens whether it runs alone or batched with others, after preemption and recompute, on CPU or CUDA. The obvious
design, one ``torch.Generator`` per request and a Python loop over the batch, breaks all of that cheaply: it costs
B small kernel launches per step, its state depends on how many numbers were drawn before (so on vocab size,
retries and code paths), it must be saved and restored with the request, and CPU and CUDA generators give
different streams. Instead the uniforms are a pure function, a counter-based hash::

    u[b, v] = U(murmur3_32(seed_b, step_b, v; salt A), murmur3_32(seed_b, step_b, v; salt B))

MurmurHash3_x86_32 of the 20-byte message (seed lo, seed hi, step lo, step hi, v) as little-endian 32-bit
words, once per salt; the two 32-bit hashes give 52 random bits and ``u = (x + 0.5) / 2**52``, strictly inside
(0, 1). The token is the Gumbel-max draw ``argmax_v(log p[b, v] - log(-log u[b, v]))``, which is distributed
exactly as Categorical(p). All of it is vectorised integer tensor arithmetic over (B, V): no per-row loop, no
generator state, no host synchronisation, and row b's result depends only on row b's logits, params, seed and
step (batch-invariant). Token-level batch invariance still needs batch-invariant logits from the model.

The 32-bit multiplies run on int64 tensors. A 32x32-bit product can overflow int64 (undefined behaviour in the
C++ kernels), so constants are split into 16-bit halves: every partial product stays below 2**48 and the result
is masked back to 32 bits.

Reference implementations (``ref_*`` and :func:`reference_filter`) are plain per-row code used by the tests to
check the fast batched path (:func:`filtered_probs`, used by :func:`sample`).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from server.batch import stage

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
MAX_TRACE = 50
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows
LOGIT_BIAS_LIMIT = 100.0  # |bias|, as OpenAI's API allows
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI's API allows
SEED_LIMIT = 2**63  # seeds are int64 on the device; non-negative so "seed + 1" style derivations never wrap


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names it so transports can report it (HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _real(name: str, value, lo: float, hi: float | None, lo_open: bool, rng: str) -> float:
    # bool is an int subclass, but True as a temperature is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(name, f"{name} must be a number {rng}, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (OverflowError, ValueError):  # huge ints do not fit a float
        raise SamplingParamsError(name, f"{name} must be a finite number {rng}, got {value!r}") from None
    ok = math.isfinite(f) and (f > lo if lo_open else f >= lo) and (hi is None or f <= hi)
    if not ok:
        raise SamplingParamsError(name, f"{name} must be {rng}, got {value!r}")
    return f


def _int(name: str, value, lo: int, hi: int | None, rng: str, optional: bool = False):
    if optional and value is None:
        return None
    # Require a real integer: 5.0 or True are rejected rather than silently converted.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(name, f"{name} must be an integer {rng}, got {type(value).__name__} {value!r}")
    i = int(value)
    if i < lo or (hi is not None and i > hi):
        raise SamplingParamsError(name, f"{name} must be {rng}, got {i}")
    return i


MAX_SCHEMA_BYTES = 64 * 1024  # a response_format's JSON text


def normalize_response_format(response_format) -> str | None:
    """The canonical JSON text of a response format (a mapping or its JSON text), None for ``{"type": "text"}``;
    SamplingParamsError naming ``response_format`` for anything else. Whether a schema compiles is checked at
    submission (server/grammar.py, ``Grammars.compile``)."""
    def bad(why: str) -> SamplingParamsError:
        return SamplingParamsError("response_format", f"response_format {why}")

    if response_format is None:
        return None
    if isinstance(response_format, str):
        if len(response_format.encode()) > MAX_SCHEMA_BYTES:
            raise bad(f"must be at most {MAX_SCHEMA_BYTES} bytes of JSON")
        try:
            response_format = json.loads(response_format)
        except ValueError as e:
            raise bad(f"is not valid JSON: {e}") from None
    if not isinstance(response_format, dict):
        raise bad(f"must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        out = {"type": "json_object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        extra = set(response_format) - {"type", "json_schema"}
        if extra:
            raise bad(f"has unknown field(s) {', '.join(sorted(extra))}")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad('json_schema needs {"schema": {...}} (an object)')
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise bad(f"json_schema has unknown field(s) {', '.join(sorted(unknown))}")
        out = {"type": "json_schema", "json_schema": {"schema": spec["schema"]}}
    else:
        raise bad('type must be "text", "json_object" or "json_schema" (with only the fields OpenAI defines), '
                  f"got {json.dumps(response_format)[:200]}")
    text = json.dumps(out, separators=(",", ":"))  # key order kept: a schema's property order is the output's
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise bad(f"must be at most {MAX_SCHEMA_BYTES} bytes of JSON")
    return text


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, validated once at construction (never clamped)."""

    temperature: float = 1.0  # >= 0, finite; 0 = greedy
    top_k: int = 0  # >= 0; 0 = off
    top_p: float = 1.0  # in [0, 1]; 1 = off
    repetition_penalty: float = 1.0  # > 0, finite; 1 = off
    seed: int | None = None  # 0 <= seed < 2**63; None = the engine picks one (with_seed) and reports it
    max_new_tokens: int = 128  # >= 1
    min_tokens: int = 0  # 0..max_new_tokens; the engine suppresses EOS before that
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # at most 16 non-empty strings of at most 256 characters
    logprobs: int | None = None  # None = off; 0..20 alternatives besides the chosen token
    trace: int | None = None  # None = off; 1..50 top candidates per stage per step
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    # token id -> bias in [-100, 100], at most 300 entries; given as a mapping (JSON's string keys accepted),
    # kept as (id, bias) pairs sorted by id so the params stay hashable
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None = off; 0..20: each prompt token's logprob under the model (teacher-forced, from the prefill) and this many
    # alternatives; with it max_new_tokens may be 0 (score the prompt, generate nothing)
    prompt_logprobs: int | None = None
    # None = free text; else a response format's canonical JSON text (normalize_response_format): JSON mode or a
    # JSON schema, enforced by server/grammar.py
    response_format: str | None = None

    def __post_init__(self):
        # frozen dataclass: normalised values (Python float/int, tuple) are written with object.__setattr__.
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        # Logits are fp32: a value past float32's range would become inf there (-inf / inf is NaN).
        put("temperature", _real("temperature", self.temperature, 0.0, FLOAT32_MAX, False,
                                 f"finite, >= 0 and <= {FLOAT32_MAX:.4g} (float32)"))
        put("top_k", _int("top_k", self.top_k, 0, None, ">= 0 (0 = off)"))
        put("top_p", _real("top_p", self.top_p, 0.0, 1.0, False, "in [0, 1]"))
        put(
            "repetition_penalty",
            _real("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX, True,
                  f"finite, > 0 and <= {FLOAT32_MAX:.4g} (float32)"),
        )
        put("seed", _int("seed", self.seed, 0, SEED_LIMIT - 1, "in [0, 2**63)", optional=True))
        put("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, "in [0, 20] or null",
                                    optional=True))
        scoring = self.prompt_logprobs is not None
        put("max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 0 if scoring else 1, None,
                                   ">= 0 (with prompt_logprobs)" if scoring else ">= 1 (0 only with prompt_logprobs)"))
        put("min_tokens", _int("min_tokens", self.min_tokens, 0, None, ">= 0"))
        if self.min_tokens > self.max_new_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}",
            )
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        put("stop", self._check_stop(self.stop))
        put("logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, "in [0, 20] or null", optional=True))
        put("trace", _int("trace", self.trace, 1, MAX_TRACE, "in [1, 50] or null", optional=True))
        put("min_p", _real("min_p", self.min_p, 0.0, 1.0, False, "in [0, 1] (0 = off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _real(name, getattr(self, name), -PENALTY_LIMIT, PENALTY_LIMIT, False, "in [-2, 2] (0 = off)"))
        put("logit_bias", self._check_logit_bias(self.logit_bias))
        put("response_format", normalize_response_format(self.response_format))
        if self.response_format is not None and self.min_tokens:
            # EOS held off while the grammar allows nothing else would leave no token to draw
            raise SamplingParamsError("min_tokens", "min_tokens cannot be combined with response_format")

    @staticmethod
    def _check_stop(stop) -> tuple[str, ...]:
        # A bare string is rejected: iterating it would silently turn "\n\n" into per-character stops.
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamsError("stop", f"stop must be a list of strings, got {type(stop).__name__}")
        if len(stop) > MAX_STOP:
            raise SamplingParamsError("stop", f"stop must have at most {MAX_STOP} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
                raise SamplingParamsError(
                    "stop", f"stop entries must be non-empty strings of at most {MAX_STOP_LEN} characters, got {s!r}"
                )
        return tuple(stop)

    @staticmethod
    def _check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
        """A mapping of token id (an int, or a string of one as JSON object keys are) to a bias, or (id, bias)
        pairs; the token ids' upper bound is the model's vocabulary, checked by the engine."""
        if bias is None:
            return ()
        if isinstance(bias, dict):
            items = list(bias.items())
        elif isinstance(bias, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
            items = [tuple(e) for e in bias]
        else:
            raise SamplingParamsError("logit_bias", "logit_bias must be an object mapping token ids to biases, "
                                                    f"got {type(bias).__name__}")
        if len(items) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, "
                                                    f"got {len(items)}")
        out = {}
        for key, value in items:
            tok = key
            if isinstance(key, str) and re.fullmatch(r"[0-9]{1,18}", key):  # JSON's keys: ASCII digits only
                tok = int(key)
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), "
                                                        f"got {key!r}")
            if int(tok) in out:
                raise SamplingParamsError("logit_bias", f"logit_bias names token {int(tok)} twice")
            out[int(tok)] = _real("logit_bias", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, False,
                                  f"in [-100, 100] (token {int(tok)}'s bias)")
        return tuple(sorted(out.items()))

    @property
    def uses_history(self) -> bool:
        """Whether steps 2-3 need the request's token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_seed(self, seed: int) -> "SamplingParams":
        """A copy with ``seed`` set (validated again); the engine uses it when the client gave none."""
        return replace(self, seed=seed)


@dataclass
class SamplingBatch:
    """The per-step, per-row sampling tensors of the running batch (built once per step by :meth:`build`)."""

    temperature: Tensor  # (B,) fp32; 0 = greedy
    top_k: Tensor  # (B,) int64; 0 = off
    top_p: Tensor  # (B,) fp32; 1 = off
    repetition_penalty: Tensor  # (B,) fp32; 1 = off
    seeds: Tensor  # (B,) int64
    steps: Tensor  # (B,) int64: the request's generated-token index for this draw
    history: Tensor | None  # (B, L) int64 prompt + generated ids padded with -1; None when no row has a penalty
    logprobs_n: int = 0  # max over rows of logprobs
    trace_n: int = 0  # max over rows of trace
    # Host-side facts computed from the params, so sample() branches without reading device tensors (no sync).
    # Defaults are the safe "anything may be on" values for hand-built batches.
    any_filter: bool = True  # some sampled row has top_k > 0, top_p < 1 or min_p > 0
    all_greedy: bool = False  # every row has T == 0 (no random draw needed)
    want_logprob: bool = True  # some row asked for logprobs (else a greedy batch skips the log-softmax)
    min_p: Tensor | None = None  # (B,) fp32; None when no row has min_p > 0
    # presence and frequency penalties, (B,) fp32 each, and where each row's generated ids start in ``history``
    # (B,) int64; None when no row has either penalty
    presence: Tensor | None = None
    frequency: Tensor | None = None
    generated_from: Tensor | None = None
    # logit_bias as (B, E) token ids padded with -1 and (B, E) fp32 biases; None when no row has one
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    # the structured-output mask, (B, ceil(V / 32)) int32 (server/grammar.py fills it; rows without a grammar all
    # ones); None when no row has one
    allowed: Tensor | None = None

    @classmethod
    def build(cls, params, seeds, steps, histories, device=None, prompt_lens=None) -> "SamplingBatch":
        """``histories``: each row's prompt + generated ids (needed when a row has a penalty); ``prompt_lens``: how
        many of them are the prompt's (needed when a row has a presence or frequency penalty)."""
        n = len(params)
        if len(seeds) != n or len(steps) != n or (histories is not None and len(histories) != n):
            raise ValueError("params, seeds, steps and histories must have one entry per row")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < SEED_LIMIT:
                raise ValueError(f"seed must be an integer in [0, 2**63), got {s!r}")
        if any(int(t) < 0 for t in steps):
            raise ValueError("steps must be >= 0")
        history = None
        if any(p.uses_history for p in params):
            if histories is None:
                raise ValueError("histories are required when a row has a penalty")
            width = max(1, max(len(h) for h in histories))
            flat_h = [t for h in histories for t in (*h, *[-1] * (width - len(h)))]  # -1 pads: ignored by the penalty
            history = stage(flat_h, torch.int64, device).view(n, width)  # (B, L)
        counted = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        if counted and (prompt_lens is None or len(prompt_lens) != n):
            raise ValueError("prompt_lens (one per row) are required when a row has a presence or frequency penalty")
        sampled = [p for p in params if p.temperature != 0.0]
        # Two staged copies per step (fp32 and int64 columns), never a synchronising one.
        f = stage([p.temperature for p in params] + [p.top_p for p in params]
                  + [p.repetition_penalty for p in params] + [p.min_p for p in params]
                  + [p.presence_penalty for p in params] + [p.frequency_penalty for p in params],
                  torch.float32, device).view(6, n)
        i = stage([p.top_k for p in params] + [int(s) for s in seeds] + [int(t) for t in steps]
                  + [int(x) for x in (prompt_lens if counted else [0] * n)], torch.int64, device).view(4, n)
        bias_ids = bias_values = None
        if any(p.logit_bias for p in params):
            width = max(len(p.logit_bias) for p in params)
            pad = [(-1, 0.0)] * width
            pairs = [e for p in params for e in (*p.logit_bias, *pad[len(p.logit_bias):])]
            bias_ids = stage([t for t, _ in pairs], torch.int64, device).view(n, width)  # (B, E)
            bias_values = stage([b for _, b in pairs], torch.float32, device).view(n, width)  # (B, E)
        return cls(
            temperature=f[0], top_k=i[0], top_p=f[1], repetition_penalty=f[2], seeds=i[1], steps=i[2],
            history=history,
            logprobs_n=max([p.logprobs or 0 for p in params], default=0),
            trace_n=max([p.trace or 0 for p in params], default=0),
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
            all_greedy=not sampled,
            want_logprob=any(p.logprobs is not None for p in params),
            min_p=f[3] if any(p.min_p > 0.0 for p in sampled) else None,
            presence=f[4] if counted else None, frequency=f[5] if counted else None,
            generated_from=i[3] if counted else None,
            bias_ids=bias_ids, bias_values=bias_values,
        )


TRACE_STAGES = ("penalties", "temperature", "min_p", "top_k", "top_p")  # after steps 1-3, 4, 5, 6, 7
TRACE_STATS = ("kept_min_p", "kept_top_k", "kept_top_p", "mass_min_p", "mass_top_k", "mass_top_p", "entropy")


@dataclass
class SampleOutput:
    tokens: Tensor  # (B,) int64
    # (B,) fp32: log-prob of the chosen token under log_softmax(raw logits), like vLLM's default; None for a
    # greedy batch in which no row asked for logprobs or a trace
    logprob: Tensor | None
    top_logprobs: tuple[Tensor, Tensor] | None  # ids (B, N) int64, logprobs (B, N) fp32 of the raw distribution
    # TRACE_STAGES -> (ids (B, N), probs (B, N)), every stage listing the same ids (the temperature stage's top N)
    trace: dict[str, tuple[Tensor, Tensor]] | None
    # Exact over the whole vocabulary (the top-N above is not), with a trace only; (B, 7) float64 columns
    # (TRACE_STATS): tokens min-p kept, tokens top-k kept as well, tokens top-p kept as well (the support of the
    # draw), and the temperature stage's mass of each of those three sets, then the entropy (nats) of the
    # distribution the token was drawn from. Greedy rows: 1, 1, 1, 1, 1, 1, 0.
    trace_stats: Tensor | None = None


# ---------------------------------------------------------------------------------------------- random stream

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593  # MurmurHash3_x86_32 block constants
_SALTS = (0x9E3779B9, 0x7F4A7C15)  # hash seeds of the two independent 32-bit streams
_MSG_BYTES = 20  # seed lo/hi, step lo/hi, vocab id: five 32-bit words


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): split c in 16-bit halves so no int64 product overflows."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of this product survive mod 2**32
    return (lo + hi) & _M32


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _mix_block(k: Tensor) -> Tensor:
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: Tensor, k: Tensor) -> Tensor:
    h = _rotl32(h ^ _mix_block(k), 13)
    return (h * 5 + 0xE6546B64) & _M32  # h * 5 < 2**35: no overflow


def _mul32_(x: Tensor, c: int, tmp: Tensor) -> Tensor:
    """In-place :func:`_mul32` on a (B, V) tensor; ``tmp`` is scratch of the same shape."""
    torch.mul(x, c >> 16, out=tmp).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_M32)


def random_u32(seeds: Tensor, steps: Tensor, vocab_size: int, salt: int) -> Tensor:
    """MurmurHash3_x86_32(seed lo, seed hi, step lo, step hi, v; hash seed ``salt``) for every (row, v): (B, V)."""
    # The four per-row words are absorbed on (B,) tensors and the vocab word's block mix on (V,), once each;
    # the (B, V) remainder runs in place because fresh (B, V) temporaries per op cost several times the
    # arithmetic on CPU. Same operations as _absorb(h, v), then murmur3's length xor and fmix32 finaliser.
    h = torch.full_like(seeds, salt)  # (B,)
    for word in (seeds & _M32, (seeds >> 32) & _M32, steps & _M32, (steps >> 32) & _M32):
        h = _absorb(h, word)  # (B,)
    kv = _mix_block(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device))  # (V,)
    x = h[:, None] ^ kv[None, :]  # (B, V)
    tmp = torch.empty_like(x)  # (B, V) scratch
    torch.bitwise_right_shift(x, 19, out=tmp)
    x.bitwise_left_shift_(13).bitwise_and_(_M32).bitwise_or_(tmp)  # rotl32(x, 13)
    x.mul_(5).add_(0xE6546B64).bitwise_and_(_M32).bitwise_xor_(_MSG_BYTES)  # last block done; xor length
    for mult, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13)):  # fmix32
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        _mul32_(x, mult, tmp)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))  # (B, V)


def random_uniform(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """u[b, v] in (0, 1), float64 with 52 random bits, a pure function of (seed_b, step_b, v)."""
    a = random_u32(seeds, steps, vocab_size, _SALTS[0])  # (B, V)
    b = random_u32(seeds, steps, vocab_size, _SALTS[1])  # (B, V)
    x = a.bitwise_left_shift_(20).bitwise_or_(b.bitwise_right_shift_(12))  # (B, V) 52 bits, exact in float64
    # + 0.5 keeps u away from 0 and 1 (2**52 - 0.5 is exactly representable), so -log(-log u) is finite.
    return x.to(torch.float64).add_(0.5).mul_(2.0**-52)  # (B, V)


# ---------------------------------------------------------------------------------------------- fast path


def apply_logit_bias(logits: Tensor, ids: Tensor | None, values: Tensor | None) -> Tensor:
    """Step 1, batched: ``values`` (B, E) added at ``ids`` (B, E) of each row (-1 pads go to a dropped column)."""
    if ids is None:
        return logits
    B, V = logits.shape
    cols = torch.where((ids < 0) | (ids >= V), V, ids)  # (B, E)
    bias = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device).scatter_(1, cols, values)  # (B, V+1)
    return logits + bias[:, :V]  # (B, V) a new tensor: the caller's logits stay the raw ones


def apply_penalty(logits: Tensor, penalty: Tensor, history: Tensor | None) -> Tensor:
    """Step 2, batched: HF repetition penalty on every id in each row's history (-1 pads ignored)."""
    if history is None:
        return logits
    B, V = logits.shape
    # ids outside [0, V) (pads, or an embedding larger than the head) go to a spare column that is dropped.
    ids = torch.where((history < 0) | (history >= V), V, history)  # (B, L)
    seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)  # (B, V+1)
    seen.scatter_(1, ids, True)
    p = penalty[:, None]  # (B, 1)
    penalised = torch.where(logits > 0, logits / p, logits * p)  # (B, V)
    return torch.where(seen[:, :V], penalised, logits)  # (B, V)


def apply_presence_frequency(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Step 3, batched: OpenAI's presence and frequency penalties over each row's generated ids."""
    if batch.frequency is None:
        return logits
    B, V = logits.shape
    h = batch.history  # (B, L) prompt + generated ids
    pos = torch.arange(h.shape[1], device=h.device)[None, :]  # (1, L)
    generated = (pos >= batch.generated_from[:, None]) & (h >= 0) & (h < V)  # (B, L)
    cols = torch.where(generated, h, V)  # (B, L) the prompt's ids and pads to the dropped column
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)  # (B, V+1)
    counts.scatter_add_(1, cols, torch.ones_like(cols, dtype=logits.dtype))
    counts = counts[:, :V]  # (B, V)
    return logits - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0).to(logits.dtype)


def unpack_bitmask(mask: Tensor, vocab: int) -> Tensor:
    """(B, W) int32 bitmask -> (B, V) bool: bit j of word w allows token 32 w + j."""
    bits = torch.arange(32, dtype=torch.int32, device=mask.device)  # (32,)
    return ((mask[:, :, None] >> bits) & 1).bool().view(mask.shape[0], -1)[:, :vocab]  # (B, V)


def ref_unpack(mask_row, vocab: int) -> list[bool]:
    """:func:`unpack_bitmask` of one row, plainly."""
    return [bool((int(mask_row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)]


def processed_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 1-3 on fp32 logits (B, V), then the structured-output mask; a new tensor whenever a step changes
    anything."""
    x = apply_logit_bias(logits.float(), batch.bias_ids, batch.bias_values)  # (B, V)
    x = apply_penalty(x, batch.repetition_penalty, batch.history)  # (B, V)
    x = apply_presence_frequency(x, batch)  # (B, V)
    if batch.allowed is not None:
        x = x.masked_fill(~unpack_bitmask(batch.allowed, x.shape[1]), -math.inf)  # (B, V)
    return x


def _filter(logits: Tensor, batch: SamplingBatch, want_trace: bool):
    """Steps 1-8 but the draw, whole batch: (probs (B, V), greedy tokens (B,), trace stages, trace stats)."""
    x = processed_logits(logits, batch)  # (B, V)
    processed = x
    B, V = x.shape
    greedy = batch.temperature == 0  # (B,)
    greedy_tok = x.argmax(-1)  # (B,) of the processed logits; first index among ties, like the stable sort
    onehot = torch.nn.functional.one_hot(greedy_tok, V).to(torch.float32)  # (B, V)
    # Greedy rows divide by 1 only to stay finite; their result is replaced by the one-hot below.
    t = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # (B,)
    x = x / t[:, None]  # (B, V)
    if not (batch.any_filter or want_trace):
        probs = torch.where(greedy[:, None], onehot, torch.softmax(x, -1))  # (B, V)
        return probs, greedy_tok, None, None

    # One stable descending sort serves min-p, top-k, top-p and the trace (every stage keeps this order).
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)  # (B, V) each
    pt = torch.softmax(vals, -1) if (want_trace or batch.min_p is not None) else None  # (B, V) temperature stage
    # tokens at -inf (the JSON mask, EOS held off) are in no stage's kept set: the counts are the draw's support
    keep_m = vals > -math.inf  # (B, V)
    if batch.min_p is not None:
        keep_m &= pt >= batch.min_p[:, None] * pt[:, :1]  # (B, V) p >= min_p * p_max: the first always passes
    k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=V), V)  # (B,) k = 0 -> keep all
    kth = vals.gather(1, (k - 1)[:, None])  # (B, 1)
    keep_k = keep_m & (vals >= kth)  # (B, V) ties with the k-th value are kept, as transformers does
    pk = torch.softmax(vals.masked_fill(~keep_k, -math.inf), -1)  # (B, V) the min-p and top-k stage, sorted
    cum = pk.cumsum(-1)  # (B, V)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1)  # (B, V) mass strictly before
    p = batch.top_p[:, None]  # (B, 1)
    # p == 1 is "off" explicitly: fp32 cumsum may reach 1.0 early and would otherwise drop tiny tails.
    drop = (before >= p) & (p < 1)  # (B, V)
    drop[:, 0] = False  # the most probable token always survives (p = 0 keeps exactly it)
    keep_sorted = keep_k & ~drop  # (B, V)
    keep = torch.zeros_like(keep_sorted).scatter_(1, idx, keep_sorted)  # (B, V) back to vocab order
    probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)  # (B, V) step 8's renormalisation
    probs = torch.where(greedy[:, None], onehot, probs)  # (B, V)
    stages = stats = None
    if want_trace:
        n = min(batch.trace_n, V)
        first = torch.zeros(B, n, dtype=torch.float32, device=x.device)  # (B, N) greedy: all mass on sorted[0]
        first[:, 0] = 1.0
        g = greedy[:, None]  # (B, 1)
        top = idx[:, :n]  # (B, N)
        dists = {"temperature": pt, "min_p": torch.softmax(vals.masked_fill(~keep_m, -math.inf), -1),  # sorted
                 "top_k": pk, "top_p": torch.softmax(vals.masked_fill(~keep_sorted, -math.inf), -1)}
        stages = {"penalties": (top, torch.softmax(processed, -1).gather(1, top))}  # before temperature: any row
        stages |= {name: (top, torch.where(g, first, dists[name][:, :n])) for name in TRACE_STAGES[1:]}  # (B, N)
        kept = [keep_m, keep_k, keep_sorted]
        stats = torch.stack([m.sum(-1).double() for m in kept] + [(pt * m).sum(-1).double() for m in kept]
                            + [torch.special.entr(probs).sum(-1).double()], -1)  # (B, 7) TRACE_STATS
        greedy_stats = torch.tensor([1.0] * 6 + [0.0], dtype=torch.float64, device=x.device)  # (7,)
        stats = torch.where(g, greedy_stats, stats)  # (B, 7)
    return probs, greedy_tok, stages, stats


def filtered_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The (B, V) distribution that :func:`sample` draws from (steps 1-5); one-hot for greedy rows."""
    return _filter(logits, batch, want_trace=False)[0]


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    """Draw one token per row of ``logits`` (B, V) following the documented order.

    1. logit bias added to the raw fp32 logits;
    2. repetition penalty (rows with penalty 1 are unchanged);
    3. presence and frequency penalties over the generated ids;
    4. temperature (T = 0: greedy argmax of the logits after 1-3; steps 5-8 skipped);
    5. min-p (p >= min_p x p_max after temperature; the most probable token survives);
    6. top-k (ties with the k-th logit kept);
    7. top-p over what min-p and top-k kept (crossing token kept; at least one token survives);
    8. renormalise and draw with Gumbel-max on the counter-based uniforms of (seed, step, v).

    Also returns the chosen token's log-prob under the raw distribution, the raw top-N log-probs when any row
    asked for logprobs, and each stage's top-N when any row asked for a trace. No host synchronisation.
    A greedy batch that asked for none of these is the argmax of steps 1-3 alone, with ``logprob`` None: at batch
    1 the softmaxes and one-hot of the general path cost ~5% of a decode step of the default model.
    """
    assert logits.dim() == 2 and logits.shape[0] == batch.seeds.shape[0], "logits must be (B, V)"
    if batch.all_greedy and not batch.want_logprob and batch.trace_n == 0:
        x = processed_logits(logits, batch)  # (B, V)
        return SampleOutput(tokens=x.argmax(-1), logprob=None, top_logprobs=None, trace=None)
    raw = torch.log_softmax(logits.float(), -1)  # (B, V) the model's own distribution, for logprobs
    probs, greedy_tok, stages, stats = _filter(logits, batch, want_trace=batch.trace_n > 0)  # (B, V), (B,)
    if batch.all_greedy:
        tokens = greedy_tok
    else:
        u = random_uniform(batch.seeds, batch.steps, probs.shape[1])  # (B, V) float64
        gumbel = u.log_().neg_().log_().neg_()  # (B, V) -log(-log u): standard Gumbel, finite as 0 < u < 1
        drawn = gumbel.add_(probs.double().log()).argmax(-1)  # (B,) log 0 = -inf: removed tokens never win
        tokens = torch.where(batch.temperature == 0, greedy_tok, drawn)  # (B,)
    logprob = raw.gather(1, tokens[:, None])[:, 0]  # (B,)
    top = None
    if batch.logprobs_n > 0:
        top_lp, top_ids = raw.topk(min(batch.logprobs_n, raw.shape[1]), dim=-1)  # (B, N) each
        top = (top_ids, top_lp)
    return SampleOutput(tokens=tokens, logprob=logprob, top_logprobs=top, trace=stages, trace_stats=stats)


# ---------------------------------------------------------------------------------------------- reference


def ref_logit_bias(row: Tensor, bias) -> Tensor:
    """Step 1 for one (V,) row: each (id, bias) pair added to its logit."""
    out = row.clone()
    for t, b in bias:
        if 0 <= t < out.shape[0]:
            out[t] = out[t] + b
    return out


def ref_penalty(row: Tensor, history, penalty: float) -> Tensor:
    """Step 2 for one (V,) row: each distinct id seen once, divided if positive else multiplied."""
    out = row.clone()
    for t in set(int(i) for i in history):
        if 0 <= t < out.shape[0]:
            # fp32 tensor arithmetic (not Python doubles), so results round exactly as transformers' do
            out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def ref_presence_frequency(row: Tensor, generated, presence: float, frequency: float) -> Tensor:
    """Step 3 for one (V,) row, as OpenAI documents it: ``mu[j] - c[j] * frequency - (c[j] > 0) * presence``."""
    out = row.clone()
    counts: dict[int, int] = {}
    for t in generated:
        counts[int(t)] = counts.get(int(t), 0) + 1
    for t, c in counts.items():
        if 0 <= t < out.shape[0]:
            out[t] = out[t] - c * frequency - presence
    return out


def ref_temperature(row: Tensor, temperature: float) -> Tensor:
    return row / temperature  # (V,)


def ref_top_k(row: Tensor, k: int) -> Tensor:
    if k == 0 or k >= row.shape[0]:
        return row
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return row.masked_fill(row < kth, -math.inf)  # (V,)


def ref_top_p(row: Tensor, p: float) -> Tensor:
    if p >= 1.0:
        return row
    probs = torch.softmax(row, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    keep, total = [], 0.0
    for i in order:  # grow the prefix until it reaches p; the crossing token is kept
        keep.append(i)
        total += probs[i]
        if total >= p:
            break
    mask = torch.ones_like(row, dtype=torch.bool)
    mask[keep] = False
    return row.masked_fill(mask, -math.inf)  # (V,)


def ref_min_p(row: Tensor, min_p: float) -> Tensor:
    """Step 5 for one (V,) row of tempered logits: drop what is less probable than min_p x the most probable."""
    if min_p == 0.0:
        return row
    probs = torch.softmax(row, -1)  # (V,)
    return row.masked_fill(probs < min_p * probs.max(), -math.inf)  # (V,)


def reference_filter(logits_row: Tensor, params: SamplingParams, history=None, prompt_len: int = 0,
                     allowed_row=None) -> Tensor:
    """The (V,) distribution that steps 1-8 sample from, computed plainly for one request. ``history``: its prompt
    and generated ids; ``prompt_len``: how many of them are the prompt's; ``allowed_row``: its grammar's bitmask
    row ((ceil(V / 32),) int32), if it has one."""
    x = ref_logit_bias(logits_row.float(), params.logit_bias)
    history = list(history or [])
    if params.repetition_penalty != 1.0:
        x = ref_penalty(x, history, params.repetition_penalty)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        x = ref_presence_frequency(x, history[prompt_len:], params.presence_penalty, params.frequency_penalty)
    if allowed_row is not None:
        ok = [bool((int(allowed_row[t // 32]) >> (t % 32)) & 1) for t in range(x.shape[0])]
        x = x.masked_fill(~torch.tensor(ok), -math.inf)
    if params.temperature == 0.0:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1.0
        return out
    x = ref_temperature(x, params.temperature)
    x = ref_top_p(ref_top_k(ref_min_p(x, params.min_p), params.top_k), params.top_p)
    return torch.softmax(x, -1)
