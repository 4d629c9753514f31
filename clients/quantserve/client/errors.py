"""One error type for both transports: :class:`ClientError` with a transport-independent ``code``.

gRPC status codes and HTTP status codes (and the client libraries' own connection / timeout exceptions) map
to the same small set of codes, so the CLI prints one line and picks one exit code whichever transport ran.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any

from quantserve.client.types import SAMPLING_FIELDS

INVALID_ARGUMENT = "invalid_argument"  # a parameter is invalid; ``param`` names it when the server does
UNAVAILABLE = "unavailable"  # the server is draining (or stopped mid-request)
DEADLINE_EXCEEDED = "deadline_exceeded"  # the client's timeout passed (the server cancels the request)
UNAUTHENTICATED = "unauthenticated"  # missing or wrong API key
RESOURCE_EXHAUSTED = "resource_exhausted"  # the server's queue is full; retry later
INTERNAL = "internal"  # the server failed (details only in its log), or answered something unexpected
CONNECTION = "connection"  # no server there: refused, unreachable, DNS, TLS handshake

# CLI exit codes, one per error code (0 = success, 1 = a local problem such as an unreadable file,
# 2 = bad command line, as argparse does).
EXIT_CODES = MappingProxyType({INVALID_ARGUMENT: 3, CONNECTION: 4, UNAVAILABLE: 5, DEADLINE_EXCEEDED: 6,
                               UNAUTHENTICATED: 7, RESOURCE_EXHAUSTED: 8, INTERNAL: 9})
EXIT_LOCAL = 1

# Names the server reports in its messages / ``error.param``, all in the proto's spelling.
_PARAMS = frozenset(SAMPLING_FIELDS) | {"prompt", "prompt_ids", "messages", "request_id", "text"}
# HTTP's OpenAI spellings -> the proto's, so both transports report the same name.
_HTTP_PARAM = MappingProxyType({"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                                "top_logprobs": "logprobs"})
_HTTP_STATUS = MappingProxyType({400: INVALID_ARGUMENT, 401: UNAUTHENTICATED, 429: RESOURCE_EXHAUSTED,
                                 503: UNAVAILABLE, 504: DEADLINE_EXCEEDED, 500: INTERNAL})
# grpc.StatusCode names -> codes. UNAVAILABLE is split further by _grpc_unavailable (draining vs no server).
_GRPC_STATUS = MappingProxyType({
    "INVALID_ARGUMENT": INVALID_ARGUMENT, "UNAVAILABLE": UNAVAILABLE, "DEADLINE_EXCEEDED": DEADLINE_EXCEEDED,
    "UNAUTHENTICATED": UNAUTHENTICATED, "RESOURCE_EXHAUSTED": RESOURCE_EXHAUSTED, "INTERNAL": INTERNAL,
    "OUT_OF_RANGE": INVALID_ARGUMENT, "FAILED_PRECONDITION": INVALID_ARGUMENT, "PERMISSION_DENIED": UNAUTHENTICATED,
})
# Substrings of grpc's own UNAVAILABLE details when nothing answered (the server's own UNAVAILABLE messages,
# "the server is draining ...", contain none of them).
_NO_SERVER = ("failed to connect", "connection refused", "dns resolution", "name resolution", "connect failed",
              "handshake", "ssl", "tls", "socket closed", "connection reset", "unreachable", "empty address")


class ClientError(Exception):
    """A failed call. ``code`` is one of the module's constants; ``param`` the offending parameter (proto
    spelling) when the server names one; ``status`` the raw transport status (gRPC code name or HTTP status)."""

    def __init__(self, code: str, message: str, param: str | None = None, status: Any = None):
        super().__init__(message)
        self.code, self.message, self.param, self.status = code, message, param, status

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"ClientError({self.code!r}, {self.message!r}, param={self.param!r}, status={self.status!r})"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.code, EXIT_CODES[INTERNAL])


def param_from_message(message: str) -> str | None:
    """The parameter an INVALID_ARGUMENT message names, for servers that do not send it as trailing metadata:
    every server message about a parameter starts with its name ("top_p must be in [0, 1], got 2.0",
    "messages[0].role must be ..."); anything else gives None."""
    m = re.match(r"([a-z_]+)\b", message)
    return m.group(1) if m and m.group(1) in _PARAMS else None


def from_grpc(err: Any) -> ClientError:
    """A grpc.RpcError (sync or aio) as a ClientError."""
    try:
        name, details = err.code().name, err.details() or ""
    except Exception:  # noqa: BLE001 - an RpcError without a status (should not happen) is still reported
        return ClientError(INTERNAL, f"gRPC error: {err}")
    code = _GRPC_STATUS.get(name, INTERNAL)
    if (name == "UNAVAILABLE" and not details.startswith("the server")
            and any(s in details.lower() for s in _NO_SERVER)):
        code = CONNECTION
    if name == "DEADLINE_EXCEEDED" and not details.strip():
        details = "the call's deadline passed"
    param = None
    if code == INVALID_ARGUMENT:
        try:  # the server names the parameter in trailing metadata; older servers only in the message
            trailing = dict(err.trailing_metadata() or ())
        except Exception:  # noqa: BLE001 - an aio error raised before the call finished has none
            trailing = {}
        param = trailing.get("quantserve-param") or param_from_message(details)
    return ClientError(code, details or name.lower(), param, name)


def from_http(status: int, body: Any) -> ClientError:
    """An HTTP error status and its (decoded JSON, or text) body as a ClientError."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or f"HTTP {status}")
        param = err.get("param")
    else:
        message = (body if isinstance(body, str) and body.strip() else f"HTTP {status}").strip()
        message, param = (message[:300], None)
    code = _HTTP_STATUS.get(status)
    if code is None:  # not a quantserve answer (404 from another server, a proxy's 502, ...)
        code, message = INTERNAL, f"HTTP {status}: {message}"
    if code == INVALID_ARGUMENT:
        param = _HTTP_PARAM.get(param, param) if isinstance(param, str) else param_from_message(message)
    else:
        param = None
    return ClientError(code, message, param, status)


def from_http_exception(exc: BaseException) -> ClientError:
    """httpx's transport exceptions (no answer at all) as a ClientError."""
    import httpx  # local: errors.py stays importable without httpx for gRPC-only users

    if isinstance(exc, httpx.ConnectTimeout):
        return ClientError(CONNECTION, f"timed out connecting to the server ({exc})")
    if isinstance(exc, httpx.TimeoutException):
        return ClientError(DEADLINE_EXCEEDED, "the call's timeout passed before the server answered")
    if isinstance(exc, (httpx.ConnectError, httpx.UnsupportedProtocol)):
        return ClientError(CONNECTION, f"cannot connect to the server: {exc}")
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):  # read / write failed, connection dropped
        return ClientError(CONNECTION, f"the connection to the server failed: {type(exc).__name__}: {exc}")
    return ClientError(INTERNAL, f"HTTP transport error: {type(exc).__name__}: {exc}")
