"""One request's sampling parameters, validated once, where a request enters (docs/design.md, "Sampling: the
documented order").

Both transports build a :class:`SamplingParams` from what the client sent; an invalid value raises
:class:`SamplingParamsError` naming the field (HTTP 400 / gRPC INVALID_ARGUMENT) and nothing is ever clamped. Past
this boundary the sampler (server/sampling.py) trusts the values. The ranges are the APIs' own where one exists
(OpenAI's for logit_bias and the presence / frequency penalties) and otherwise where the sampler's fp32 arithmetic
stays finite: the logits are fp32, and a value that overflows them (a temperature of 1e-40 divides a logit of 1
into inf) would turn every probability of the row into NaN.

The standard library only: no torch here, so the limits can be read without loading the sampler.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, replace

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
MAX_TRACE = 50
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows
LOGIT_BIAS_LIMIT = 100.0  # |bias|, as OpenAI's API allows
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI's API allows
SEED_LIMIT = 2**63  # seeds are int64 on the device; non-negative so "seed + 1" style derivations never wrap
FLOAT32_MAX = (2 - 2**-23) * 2**127  # float32's largest finite value (the logits are fp32)
# temperature: 0 (greedy) or in [TEMPERATURE_MIN, FLOAT32_MAX]. Below 1e-6 a draw is greedy to within the fp32
# rounding of the logits (their spacing, ~1e-6 at |logit| ~ 10, becomes a whole nat), and below ~1e-37 a logit of
# 10 divided by T overflows fp32 (inf, then NaN probabilities); above FLOAT32_MAX T itself is inf in fp32. With
# T >= 1e-6 the division stays finite for any processed logit below 3e32.
TEMPERATURE_MIN = 1e-6
# repetition_penalty (1 = off): p in [1/100, 100]. At the ends the penalty is already total (a seen token's logit
# divided or multiplied by 100), and logit / p and logit * p stay finite in fp32 for any logit below 3e36;
# a penalty of 2.1e-53 (0 in fp32) divided a logit into inf and the row's probabilities into NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names it so transports can report it (HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _real(name: str, value, lo: float, hi: float, rng: str) -> float:
    """``value`` as a Python float in [lo, hi], else SamplingParamsError naming ``name`` and the range ``rng``."""
    # bool is an int subclass, but True as a temperature is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(name, f"{name} must be a number {rng}, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (OverflowError, ValueError):  # huge ints do not fit a float
        raise SamplingParamsError(name, f"{name} must be a finite number {rng}, got {value!r}") from None
    if not (math.isfinite(f) and lo <= f <= hi):
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

    temperature: float = 1.0  # 0 = greedy, or in [1e-6, FLOAT32_MAX]
    top_k: int = 0  # >= 0; 0 = off
    top_p: float = 1.0  # in [0, 1]; 1 = off
    repetition_penalty: float = 1.0  # in [0.01, 100]; 1 = off
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
    # False: this request never drafts under the server's --speculate (its tokens are the same either way; this
    # only takes it out of speculation's cost and accounting)
    speculate: bool = True

    def __post_init__(self):
        # frozen dataclass: normalised values (Python float/int, tuple) are written with object.__setattr__.
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        # Logits are fp32: the ranges keep every step of the sampler finite (see TEMPERATURE_MIN and
        # REPETITION_PENALTY_RANGE).
        t_rng = f"0 (greedy) or in [{TEMPERATURE_MIN:g}, {FLOAT32_MAX:.4g}] (finite in float32 arithmetic)"
        t = _real("temperature", self.temperature, 0.0, FLOAT32_MAX, t_rng)
        if 0.0 < t < TEMPERATURE_MIN:
            raise SamplingParamsError("temperature", f"temperature must be {t_rng}, got {self.temperature!r}")
        put("temperature", t)
        put("top_k", _int("top_k", self.top_k, 0, None, ">= 0 (0 = off)"))
        put("top_p", _real("top_p", self.top_p, 0.0, 1.0, "in [0, 1]"))
        lo, hi = REPETITION_PENALTY_RANGE
        put("repetition_penalty", _real("repetition_penalty", self.repetition_penalty, lo, hi,
                                        f"in [{lo:g}, {hi:g}] (1 = off)"))
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
        for name in ("ignore_eos", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        put("stop", self._check_stop(self.stop))
        put("logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, "in [0, 20] or null", optional=True))
        put("trace", _int("trace", self.trace, 1, MAX_TRACE, "in [1, 50] or null", optional=True))
        put("min_p", _real("min_p", self.min_p, 0.0, 1.0, "in [0, 1] (0 = off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _real(name, getattr(self, name), -PENALTY_LIMIT, PENALTY_LIMIT, "in [-2, 2] (0 = off)"))
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
            out[int(tok)] = _real("logit_bias", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT,
                                  f"in [-100, 100] (token {int(tok)}'s bias)")
        return tuple(sorted(out.items()))

    @property
    def uses_history(self) -> bool:
        """Whether steps 2-3 need the request's token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with ``seed`` set (validated again); the engine uses it when the client gave none."""
        return replace(self, seed=seed)

