#!/usr/bin/env bash
# Set up (with the dev extra) and run the whole test suite, the 135M-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
scripts/setup.sh --dev
# A worker per core (pytest-xdist). worksteal: each worker starts on its half of the tests in file order and takes
# from the other's tail when done, so a module's fixtures are built twice only where the halves meet (measured
# 8:21 against 9:14 for a file per worker; pytest 589.4 s against 971.9 s in one process:
# bench/RESULTS.md#test-suite-wall-time-scriptstestsh).
exec "$PY" -m pytest -q -p no:cacheprovider --timeout 900 -n auto --dist worksteal "$@"
