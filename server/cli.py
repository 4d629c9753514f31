"""`quant serve`: the command line of the server (``python -m server.cli ARGS`` is ``quant serve ARGS``).

Its flags come from the settings table (server/settings.py). A bad flag or an input error (``QuantError``:
a damaged artifact, an unknown model) prints one line and exits 1; argparse usage errors exit 2. The `quant`
console script hands ``quant serve ...`` to :func:`main` here; the pipeline never imports the server otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server import settings

PROG = "quant serve"
DESCRIPTION = ("one engine behind gRPC and an OpenAI-compatible HTTP API, in one process; SIGTERM drains it. "
               "Every flag is also a QUANTSERVE_* variable of the container (python -m server.envconfig --help).")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    settings.add_arguments(p)
    return p


def config_from_args(args: argparse.Namespace, api_key: str | None):
    """The ServeConfig the parsed flags ask for (``api_key``: the key itself, read from --api-key-file or not)."""
    from server.config import EngineConfig, Limits
    from server.serve import ServeConfig

    return ServeConfig(**{**settings.config_values("serve", args), "api_key": api_key},
                       engine=EngineConfig(**settings.config_values("engine", args)),
                       limits=Limits(**settings.config_values("limits", args)))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    import logging

    from quant.errors import QuantError
    from quant.format.sources import default_cache_dir

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key
    if args.api_key_file is not None:
        try:
            api_key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            print(f"{prog}: error: cannot read --api-key-file: {e}", file=sys.stderr)
            return 1
    try:
        cfg = config_from_args(args, api_key).validate()
    except ValueError as e:  # a bad flag: one line, exit 1 (as QuantError)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    from server.serve import serve

    try:
        return serve(cfg, default_cache_dir())
    except QuantError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
