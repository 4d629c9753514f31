#!/usr/bin/env bash
# Regenerate the gRPC stubs from protos/ (committed; tests/test_protos.py checks they are up to date).
# Output mirrors the proto package inside the client distribution:
# protos/quantserve/v1/*.proto -> clients/quantserve/v1/*_pb2*.py(i).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-clients}"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    protos/quantserve/v1/inference.proto
