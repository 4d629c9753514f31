#!/usr/bin/env bash
# On a machine with a CUDA device: the CUDA-marked tests, then bench/gpu.py (each CUDA kernel against its
# reference at the default model's shapes and an 8B model's, the kernel and engine benchmarks), appending the
# run's dated section (with the device name) to bench/RESULTS.md.
#   scripts/gpu_check.sh [--quick] [--default-model GGUF] [--data WIKITEXT_DIR]   (bench/gpu.py --help)
# Needs torch with CUDA and triton (both in the GPU images); nothing here needs torch 2.13-only APIs.
# Beside it, on the same machine (a command of its own: the models take a few GiB of disk):
#   python bench/build_memory.py --device cuda --tokenizer word   (an 8B-shaped streamed build: time, GPU peak)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-bench/out/gpu}"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')"
status=0
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py || status=1
"$PY" bench/gpu.py --out "$OUT_DIR" "$@" || status=1
cat "$OUT_DIR/gpu.md" >> bench/RESULTS.md
exit $status
