"""The serve settings: one table, from which `quant serve`'s flags, the container's ``QUANTSERVE_*`` variables and
the defaults of the settings dataclasses are derived. Each name, type, default and help string is written here
once.

A row is one setting. Its flag is ``--name`` (underscores as dashes; ``artifact`` is a positional argument),
its environment variable ``QUANTSERVE_NAME`` (``env`` names another suffix, or None for no variable), and
``config`` says which dataclass holds it: ``"serve"`` (server.serve.ServeConfig), ``"engine"``
(server.config.EngineConfig) or ``"limits"`` (server.config.Limits), as the field ``field`` (default: the
name); None is a setting of the command line only. A dataclass declares such a field as
``name: T = setting("name")``, which takes the default from here. Adding a setting: a row here, and that field.

What a configured value may be is checked by the dataclass's own ``validate()`` (its messages name the flag);
``check`` only parses an environment value for the entrypoint (server/envconfig.py), before anything loads.
Imports nothing heavy: the entrypoint and ``quant serve --help`` read it before torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

ENV_PREFIX = "QUANTSERVE_"
CONFIGS = ("serve", "engine", "limits")

# ------------------------------------------------------------------------- parsing an environment value
# Each raises ValueError saying what a valid value looks like ("QUANTSERVE_X must be " + that).


def at_least(lo: int) -> Callable[[str], int]:
    def check(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"an integer, got {v!r}") from None
        if n < lo:
            raise ValueError(f"an integer >= {lo}, got {n}")
        return n

    return check


def port(v: str) -> int:
    n = at_least(-1)(v)
    if n > 65535:
        raise ValueError(f"a port in [-1, 65535], got {n}")
    return n


def seconds(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"a number of seconds, got {v!r}") from None
    if not x >= 0:  # also refuses nan
        raise ValueError(f"a number of seconds >= 0, got {v!r}")
    return x


def fraction(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"a number in [0, 1), got {v!r}") from None
    if not 0 <= x < 1:
        raise ValueError(f"a number in [0, 1), got {v!r}")
    return x


def one_of(*choices: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in choices:
            raise ValueError(f"one of {', '.join(choices)}, got {v!r}")
        return v

    return check


def boolean(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"1, true, yes, on, 0, false, no or off, got {v!r}")


def text(v: str) -> str:
    if not v.strip():
        raise ValueError("a non-empty value")
    return v


# ------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # what the flag parses: int, float, str, or bool (--name / --no-name)
    default: Any  # the flag's default, and the dataclass field's
    help: str
    config: str | None  # "serve", "engine", "limits"; None: the command line only
    field: str = ""  # the dataclass field ("": the name)
    env: str | None = ""  # the variable is ENV_PREFIX + this ("": the name upper-cased); None: no variable
    env_default: str | None = None  # the container's value when its variable is unset (None: the flag's default)
    check: Callable[[str], object] | None = None  # parses the variable (None: from choices and type)
    choices: tuple[str, ...] | None = None  # the flag's (and the variable's) only values
    off: int | None = None  # the flag value that stands for None in the config
    exclusive: str | None = None  # flags sharing this name are mutually exclusive
    positional: bool = False  # an optional positional argument instead of a flag

    @property
    def flag(self) -> str | None:
        """``--name``; None for a positional argument."""
        return None if self.positional else "--" + self.name.replace("_", "-")

    @property
    def var(self) -> str | None:
        return None if self.env is None else ENV_PREFIX + (self.env or self.name.upper())

    @property
    def attr(self) -> str:
        """The dataclass field."""
        return self.field or self.name

    def parse_env(self, value: str) -> object:
        if self.check is not None:
            return self.check(value)
        if self.choices is not None:
            return one_of(*self.choices)(value)
        if self.type is bool:
            return boolean(value)
        return at_least(1)(value) if self.type is int else text(value)

    def to_config(self, value: Any) -> Any:
        """The flag's value as the dataclass field takes it."""
        return None if self.off is not None and value == self.off else value


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("artifact", str, None, "artifact dir, model dir or GGUF (default: the embedded model)", "serve",
      positional=True),
    S("host", str, "127.0.0.1", "address to bind (0.0.0.0 for every interface)", "serve",
      env_default="0.0.0.0"),  # a container's port is reached from outside it
    S("grpc_port", int, 50051, "gRPC port (-1: no gRPC; 0: any free port)", "serve", check=port, off=-1),
    S("http_port", int, 8000, "HTTP port (-1: no HTTP; 0: any free port)", "serve", check=port, off=-1),
    S("memory_budget", str, "1GiB", "KV pool: bytes (2GiB) or a fraction (0.3) of the memory free once the model is "
      "loaded, which must leave one step's activations", "engine"),
    S("max_queue", int, 256, "accepted requests waiting for KV blocks or a batch slot; beyond it: overloaded",
      "engine"),
    S("max_batch", int, 64, "requests running at once", "engine"),
    S("max_prefill_tokens", int, 256, "prompt tokens per engine step (chunked prefill)", "engine"),
    S("prefix_cache", bool, True, "share the KV blocks of prompt prefixes between requests: a request maps the full "
      "blocks an earlier one wrote and prefills only the rest; unreferenced cached blocks are evicted least recently "
      "used when space is needed", "engine"),
    S("kv_admission", str, "on-demand", "how a request takes KV blocks: on-demand (its prompt's when admitted, one "
      "more as its tokens need it; when the pool runs dry the newest request is preempted and later recomputes what "
      "it had, its output unchanged) or reserve (prompt + max_new_tokens at admission, never preempted)", "engine",
      choices=("on-demand", "reserve")),
    S("kv_watermark", float, 0.01, "on-demand admission leaves this fraction of the KV pool's blocks free for the "
      "running requests' next tokens", "engine", check=fraction),
    S("kv_dtype", str, "auto", "what the KV cache holds: auto (the activations' dtype, --dtype), int8 or fp8 (e4m3) "
      "codes with a float16 scale per token per KV head (0.52x bf16's bytes), int4 (keys per channel over 32-token "
      "blocks, values per token; each sequence's last incomplete block held in int8: 0.30x bf16's bytes plus 32 "
      "int8 tokens per running sequence), or the activations' dtype by name; attention dequantizes as it reads; "
      "quantized caches on the CPU only for now", "engine",
      choices=("auto", "bfloat16", "float16", "float32", "int8", "fp8", "int4")),
    S("speculate", str, "auto", "speculative decoding: ngram (each request drafts the tokens that followed the last "
      "earlier occurrence of its final tokens in its prompt or output), draft (a draft model, --draft, proposes "
      "them, drawing each with the target's own controls and random numbers), verified in one forward pass with "
      "every sampling control applied at each position: the same distribution, and for a seed the same tokens, as "
      "without; drafts are verified only where they pay on this device, measured at start; off; or auto: draft "
      "when --draft is given, else ngram on the CPU except with --kv-dtype int4, off elsewhere (not yet verified "
      "on a GPU)", "engine", choices=("auto", "off", "ngram", "draft")),
    S("draft", str, None, "the draft model of --speculate draft: an artifact or model dir (or hub id) with the "
      "served model's tokenizer, for instance a w4a16 artifact of the same model; served in --draft-dtype, its KV "
      "cache taking a share of the KV budget that holds as many tokens as the target's", "engine"),
    S("draft_dtype", str, "auto", "the draft model's activations and KV cache: auto (--dtype, but bfloat16 for a "
      "float32 target: a draft's precision changes only how often its drafts are kept, never the output, and "
      "bfloat16 holds its KV cache in half the bytes), bfloat16, float16 or float32", "engine",
      choices=("auto", "bfloat16", "float16", "float32")),
    S("speculate_tokens", int, 8, "most tokens a request drafts in one step (fewer as its acceptance rate asks)",
      "engine", check=at_least(1)),
    S("max_new_tokens", int, 4096, "limit on a request's max_new_tokens", "limits"),
    S("max_prompt_tokens", int, None, "limit on prompt tokens (default: the model's context length)", "limits"),
    S("max_request_bytes", int, 4 * 2**20, "limit on a request's size (one message / body)", "limits"),
    S("dtype", str, "bfloat16", "activations, KV cache and unquantized weights", "engine",
      choices=("bfloat16", "float16", "float32")),
    S("device", str, "cpu", "cpu, cuda, cuda:1, ...", "engine"),
    S("embeddings", str, "auto", "the token embedding and LM head: float, or int8 per row (bfloat16, or float32 "
      "where the C++ rows op is built); auto: int8 for a quantized artifact served in bfloat16, else float",
      "engine", choices=("auto", "float", "int8")),
    S("int4_activations", str, "float", "what int4 (w4a16) projections multiply: float, the activations as they are; "
      "or int8, each input row quantized in blocks of 32 columns (llama.cpp's Q8 trade: an exact byte product, "
      "1.2-1.5x a projection's one-row speed on an AVX2 CPU and more with speculation's few rows, for +0.11%% "
      "perplexity on the default model's w4a16; bench/RESULTS.md); int8 needs an AVX2 CPU without AVX-512",
      "engine", choices=("float", "int8")),
    S("kernels", str, "measure", "how each projection's kernel is chosen per row count: measure (the fastest on "
      "this device, timed once per CPU or GPU model and shape, cached; on a GPU also the one-row kernels' launch) "
      "or static (built-in rules)", "engine",
      choices=("measure", "static")),
    S("threads", int, None, "CPU threads for the engine (default: torch's)", "engine"),
    S("grace", float, 30.0, "drain: seconds in-flight requests get after SIGTERM", "serve", field="grace_s",
      env="GRACE_SECONDS", check=seconds),
    S("tls_cert", str, None, "PEM certificate file (with --tls-key)", "serve"),
    S("tls_key", str, None, "PEM key file (with --tls-cert)", "serve"),
    S("api_key", str, None, "require 'authorization: Bearer KEY' on both transports", "serve",
      env=None, exclusive="key"),  # an environment variable would show the key to anyone who can inspect it
    S("api_key_file", str, None, "the API key, read from this file (a mounted secret; keeps the key out of the "
      "argv)", None, exclusive="key"),
    S("log_level", str, "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL", None,
      check=one_of("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
)
del S
BY_NAME: MappingProxyType[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})


def setting(name: str) -> Any:
    """The dataclass field of setting ``name``: its default from the table, the row's name in its metadata."""
    return dataclasses.field(default=BY_NAME[name].default, metadata={"setting": name})


def described(s: Setting, default: Any) -> str:
    """The help, with the default said when there is one."""
    return s.help if default is None else f"{s.help} (default: {default})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as an argument of ``parser`` (the artifact positional, the others flags)."""
    groups: dict[str, Any] = {}
    for s in SETTINGS:
        if s.exclusive and s.exclusive not in groups:
            groups[s.exclusive] = parser.add_mutually_exclusive_group()
        to = groups[s.exclusive] if s.exclusive else parser
        kw: dict[str, Any] = {"default": s.default, "help": described(s, s.default)}
        if s.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] = s.help  # BooleanOptionalAction says the default itself
        elif s.type is not str:
            kw["type"] = s.type
        if s.choices is not None:
            kw["choices"] = list(s.choices)
        if s.flag is None:
            to.add_argument(s.name, nargs="?", **kw)
        else:
            to.add_argument(s.flag, **kw)


def config_values(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``config``'s dataclass that parsed flags give."""
    return {s.attr: s.to_config(getattr(args, s.name)) for s in SETTINGS if s.config == config}
