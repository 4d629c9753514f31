#!/usr/bin/env bash
# Set up (with the dev extra) and run the whole test suite, the 135M-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
scripts/setup.sh --dev
# A worker per core (pytest-xdist), each test file on one worker, so that its module fixtures are built once.
exec "$PY" -m pytest -q -p no:cacheprovider --timeout 900 -n auto --dist loadfile "$@"
