#!/usr/bin/env bash
# Regenerate the gRPC stubs from protos/ (committed; tests/test_protos.py checks they are up to date).
# Output mirrors the proto package inside the client distribution:
# protos/quantserve/v1/*.proto -> clients/quantserve/v1/*_pb2*.py(i).
# $PYTHON (default python3) is the interpreter whose grpcio-tools generates them: tests/test_protos.py passes its own,
# so the stubs are checked against the pinned grpcio-tools of the environment running the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-clients}"
"${PYTHON:-python3}" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    protos/quantserve/v1/inference.proto
