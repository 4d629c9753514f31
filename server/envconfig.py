"""`quant serve` configured from environment variables: the one place a container reads its settings.

    python -m server.envconfig            exec `quant serve` with the flags the environment gives
    python -m server.envconfig --print    print that command (JSON) and exit: what the container would run
    python -m server.envconfig --help     list the variables, with their meanings and defaults

The variables are derived from the serve settings table (server/settings.py): QUANTSERVE_ and the flag's name,
e.g. QUANTSERVE_MAX_BATCH for --max-batch. The API key itself is not one (QUANTSERVE_API_KEY_FILE names a file
holding it: the key never enters the environment or the argv). Every variable is optional except
QUANTSERVE_ARTIFACT; unset means `quant serve`'s own default, except the bind address, which is 0.0.0.0 here (a
container's port is reached from outside it).

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

from server.settings import ENV_PREFIX, SETTINGS, described


@dataclass(frozen=True)
class Var:
    name: str
    flag: str | None  # None: the positional artifact argument
    check: Callable[[str], object]  # raises ValueError with what a valid value looks like
    default: str | None  # the container's value when unset (None: leave it to quant serve)
    help: str
    switch: bool = False  # a yes/no setting: --name or --no-name, no value


VARS = tuple(Var(s.var, s.flag, s.parse_env, s.env_default, described(s, s.env_default or s.default), s.type is bool)
             for s in SETTINGS if s.var is not None)
OTHER_KNOWN = {"QUANTSERVE_CACHE": "cache dir of converted models (read by quant itself)"}  # not a serve flag


USAGE = "python -m server.envconfig [--print | --help]"


class EnvError(ValueError):
    pass


def serve_argv(env: Mapping[str, str]) -> list[str]:
    """The `quant serve` arguments (after "serve") that ``env`` asks for."""
    if "QUANTSERVE_API_KEY" in env:  # not a setting on purpose: say why, not just "unknown"
        raise EnvError("QUANTSERVE_API_KEY is not read: mount the key as a file and set QUANTSERVE_API_KEY_FILE")
    known = {v.name for v in VARS} | set(OTHER_KNOWN)
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise EnvError(f"{unknown[0]} is not a quantserve setting (known: {', '.join(sorted(known))})")
    positional, flags = [], []
    for var in VARS:
        value = env.get(var.name, var.default)
        if value is None:
            continue
        try:
            parsed = var.check(value)
        except ValueError as e:
            raise EnvError(f"{var.name} must be {e}") from None
        if var.flag is None:
            positional.append(value)
        elif var.switch:  # --name or --no-name
            flags.append(var.flag if parsed else "--no-" + var.flag[2:])
        else:
            flags += [var.flag, value]
    if not positional:
        raise EnvError("QUANTSERVE_ARTIFACT must be set (the artifact dir, e.g. /artifacts/model)")
    if ("QUANTSERVE_TLS_CERT" in env) != ("QUANTSERVE_TLS_KEY" in env):
        raise EnvError("QUANTSERVE_TLS_CERT and QUANTSERVE_TLS_KEY go together")
    return positional + flags


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(f"usage: {USAGE}\n\n{__doc__.splitlines()[0]}\n")
        for name, meaning in (*((v.name, v.help) for v in VARS), *OTHER_KNOWN.items()):
            print(f"  {name:<30} {meaning}")
        return 0
    if argv not in ([], ["--print"]):
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    try:
        args = serve_argv(os.environ if env is None else env)
    except EnvError as e:
        print(f"quantserve: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "server.cli", *args]  # `quant serve` itself
    if argv == ["--print"]:
        print(json.dumps(cmd[1:]))
        return 0
    sys.stdout.flush()
    os.execv(sys.executable, cmd)  # quant serve becomes PID 1's process: SIGTERM reaches it directly


if __name__ == "__main__":
    sys.exit(main())
