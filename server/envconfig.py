"""`quant serve` configured from environment variables: the one place a container reads its settings.

    python -m server.envconfig            exec `quant serve` with the flags the environment gives
    python -m server.envconfig --print    print that command (JSON) and exit: what the container would run

Every variable is optional except QUANTSERVE_ARTIFACT; unset means `quant serve`'s own default, except the
bind address, which is 0.0.0.0 here (a container's port is reached from outside it):

    QUANTSERVE_ARTIFACT            artifact dir (e.g. /artifacts/model, on a volume)
    QUANTSERVE_HOST                bind address (default 0.0.0.0)
    QUANTSERVE_GRPC_PORT           gRPC port (default 50051; -1: off)
    QUANTSERVE_HTTP_PORT           HTTP port (default 8000; -1: off)
    QUANTSERVE_MEMORY_BUDGET       KV pool: bytes ("2GiB") or a fraction of free memory ("0.3")
    QUANTSERVE_MAX_QUEUE           accepted requests waiting for KV blocks or a batch slot
    QUANTSERVE_MAX_BATCH           requests running at once
    QUANTSERVE_MAX_PREFILL_TOKENS  prompt tokens per engine step
    QUANTSERVE_MAX_NEW_TOKENS      limit on a request's max_new_tokens
    QUANTSERVE_MAX_PROMPT_TOKENS   limit on prompt tokens
    QUANTSERVE_MAX_REQUEST_BYTES   limit on a request's size
    QUANTSERVE_DTYPE               bfloat16, float16 or float32
    QUANTSERVE_DEVICE              cpu, cuda, cuda:1, ...
    QUANTSERVE_THREADS             CPU threads for the engine
    QUANTSERVE_GRACE_SECONDS       drain: seconds in-flight requests get after SIGTERM
    QUANTSERVE_TLS_CERT            PEM certificate file (with QUANTSERVE_TLS_KEY)
    QUANTSERVE_TLS_KEY             PEM key file
    QUANTSERVE_API_KEY_FILE        file holding the API key (a mounted secret; the key never enters the argv)
    QUANTSERVE_LOG_LEVEL           DEBUG, INFO, WARNING, ...
    QUANTSERVE_CACHE               cache dir of converted models (read by quant itself)

Read when the entrypoint runs, never at import time. A malformed value, or a QUANTSERVE_* variable that is
not in this list (a typo would otherwise be ignored silently), is refused with one line naming it, exit 2,
before anything loads.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

PREFIX = "QUANTSERVE_"


@dataclass(frozen=True)
class Var:
    name: str
    flag: str | None  # None: the positional artifact argument
    check: Callable[[str], object]  # raises ValueError with what a valid value looks like
    default: str | None = None


def _int(lo: int | None = None) -> Callable[[str], object]:
    def check(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"an integer, got {v!r}") from None
        if lo is not None and n < lo:
            raise ValueError(f"an integer >= {lo}, got {n}")
        return n

    return check


def _float_ge0(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"a number of seconds, got {v!r}") from None
    if not x >= 0:  # also refuses nan
        raise ValueError(f"a number of seconds >= 0, got {v!r}")
    return x


def _one_of(*choices: str) -> Callable[[str], object]:
    def check(v: str) -> str:
        if v not in choices:
            raise ValueError(f"one of {', '.join(choices)}, got {v!r}")
        return v

    return check


def _text(v: str) -> str:
    if not v.strip():
        raise ValueError("a non-empty value")
    return v


def _port(v: str) -> int:
    n = _int(-1)(v)
    if n > 65535:
        raise ValueError(f"a port in [-1, 65535], got {n}")
    return n


VARS = (
    Var("QUANTSERVE_ARTIFACT", None, _text),
    Var("QUANTSERVE_HOST", "--host", _text, default="0.0.0.0"),
    Var("QUANTSERVE_GRPC_PORT", "--grpc-port", _port),
    Var("QUANTSERVE_HTTP_PORT", "--http-port", _port),
    Var("QUANTSERVE_MEMORY_BUDGET", "--memory-budget", _text),
    Var("QUANTSERVE_MAX_QUEUE", "--max-queue", _int(1)),
    Var("QUANTSERVE_MAX_BATCH", "--max-batch", _int(1)),
    Var("QUANTSERVE_MAX_PREFILL_TOKENS", "--max-prefill-tokens", _int(1)),
    Var("QUANTSERVE_MAX_NEW_TOKENS", "--max-new-tokens", _int(1)),
    Var("QUANTSERVE_MAX_PROMPT_TOKENS", "--max-prompt-tokens", _int(1)),
    Var("QUANTSERVE_MAX_REQUEST_BYTES", "--max-request-bytes", _int(1)),
    Var("QUANTSERVE_DTYPE", "--dtype", _one_of("bfloat16", "float16", "float32")),
    Var("QUANTSERVE_DEVICE", "--device", _text),
    Var("QUANTSERVE_THREADS", "--threads", _int(1)),
    Var("QUANTSERVE_GRACE_SECONDS", "--grace", _float_ge0),
    Var("QUANTSERVE_TLS_CERT", "--tls-cert", _text),
    Var("QUANTSERVE_TLS_KEY", "--tls-key", _text),
    Var("QUANTSERVE_API_KEY_FILE", "--api-key-file", _text),
    Var("QUANTSERVE_LOG_LEVEL", "--log-level", _one_of("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
)
OTHER_KNOWN = ("QUANTSERVE_CACHE",)  # read by quant itself, not a serve flag


class EnvError(ValueError):
    pass


def serve_argv(env: Mapping[str, str]) -> list[str]:
    """The `quant serve` arguments (after "serve") that ``env`` asks for."""
    if "QUANTSERVE_API_KEY" in env:  # not a setting on purpose: say why, not just "unknown"
        raise EnvError("QUANTSERVE_API_KEY is not read: mount the key as a file and set QUANTSERVE_API_KEY_FILE")
    known = {v.name for v in VARS} | set(OTHER_KNOWN)
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known)
    if unknown:
        raise EnvError(f"{unknown[0]} is not a quantserve setting (known: {', '.join(sorted(known))})")
    positional, flags = [], []
    for var in VARS:
        value = env.get(var.name, var.default)
        if value is None:
            continue
        try:
            var.check(value)
        except ValueError as e:
            raise EnvError(f"{var.name} must be {e}") from None
        if var.flag is None:
            positional.append(value)
        else:
            flags += [var.flag, value]
    if not positional:
        raise EnvError("QUANTSERVE_ARTIFACT must be set (the artifact dir, e.g. /artifacts/model)")
    if ("QUANTSERVE_TLS_CERT" in env) != ("QUANTSERVE_TLS_KEY" in env):
        raise EnvError("QUANTSERVE_TLS_CERT and QUANTSERVE_TLS_KEY go together")
    return positional + flags


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--print"]):
        print("usage: python -m server.envconfig [--print]", file=sys.stderr)
        return 2
    try:
        args = serve_argv(os.environ if env is None else env)
    except EnvError as e:
        print(f"quantserve: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "quant.cli", "serve", *args]
    if argv == ["--print"]:
        print(json.dumps(cmd[1:]))
        return 0
    sys.stdout.flush()
    os.execv(sys.executable, cmd)  # quant serve becomes PID 1's process: SIGTERM reaches it directly


if __name__ == "__main__":
    sys.exit(main())
