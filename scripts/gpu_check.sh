#!/usr/bin/env bash
# On a machine with a CUDA device: the CUDA-marked tests, then bench/gpu.py (each CUDA kernel against its
# reference at the default model's shapes and an 8B model's, the kernel and engine benchmarks), appending the
# run's dated section (with the device name) to bench/RESULTS.md.
#   scripts/gpu_check.sh [--quick] [--only PARTS] [--deadline SECONDS] [--default-model GGUF] [--data DIR]
# (bench/gpu.py --help). Needs torch with CUDA and triton (both in the GPU images); nothing here needs torch
# 2.13-only APIs. Outputs (gpu.md, gpu.json, cuda_tests.log) go to $GPU_CHECK_OUT (default bench/out/gpu).
#
# With --deadline (a lease's budget: a lent GPU has 15 minutes, its start included) the benchmarks run first, in
# the order --only gives, no part starting past the deadline, and the CUDA tests get what is left (skipped under a
# minute). The plan for a lease, as one device call (timeout_s 600):
#   GPU_CHECK_OUT=$OUT scripts/gpu_check.sh --only headline,gemv,kernels,engine --deadline 480
# Beside it, when a lease has time left (a command of its own: the models take a few GiB of disk):
#   python bench/build_memory.py --device cuda --tokenizer word   (an 8B-shaped streamed build: time, GPU peak)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-bench/out/gpu}"
mkdir -p "$OUT_DIR"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')"
deadline=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --deadline) deadline="$2"; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
tests() {
    set -o pipefail
    "$@" "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 | tee "$OUT_DIR/cuda_tests.log"
}
status=0
start=$SECONDS
if [ -z "$deadline" ]; then
    tests || status=1
    "$PY" bench/gpu.py --out "$OUT_DIR" "${args[@]}" || status=1
else
    "$PY" bench/gpu.py --out "$OUT_DIR" "${args[@]}" || status=1
    left=$(( ${deadline%.*} + 60 - (SECONDS - start) ))  # the last part may have started just before the deadline
    if [ "$left" -ge 60 ]; then
        tests timeout "$left" || status=1
    else
        echo "gpu_check: CUDA tests skipped, ${left}s left of the deadline" | tee "$OUT_DIR/cuda_tests.log"
    fi
fi
cat "$OUT_DIR/gpu.md" >> bench/RESULTS.md
exit $status
