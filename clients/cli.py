"""`quant-client`: the command-line client (its commands arrive with the server, issue #6)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quant-client", description="quantserve client (no server commands yet)")
    p.add_argument("--version", action="version", version="quant-client 0.1.0")
    p.parse_args(argv)
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
