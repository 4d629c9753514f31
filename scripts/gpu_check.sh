#!/usr/bin/env bash
# On a machine with a CUDA device: the CUDA-marked tests first, then bench/gpu.py's parts by priority (headline:
# the 8B w4a16 engine; bf16: the same rows for a bf16 8B; then attention, linear, gemv, engine, default; each
# kernel against its reference, timed beside its peers). The run's report (dated, with the device name and the
# CUDA tests' summary) takes the place of bench/RESULTS.md's "GPU check" section (`bench/gpu.py --record`).
#   scripts/gpu_check.sh [--deadline SECONDS] [--tests-timeout SECONDS] [bench/gpu.py's options: --only, --quick, ...]
# Needs torch with CUDA and triton (both in the GPU images); nothing here needs torch 2.13-only APIs. Outputs
# (gpu.md, gpu.json, cuda_tests.log, section.md: what went into bench/RESULTS.md) go to $GPU_CHECK_OUT (default
# bench/out/gpu).
#
# --deadline: the seconds from this script's start after which no benchmark part starts (a lent GPU has 15 minutes,
# the machine's start included). The tests run first (at most --tests-timeout, default 180 s; about 45 s on an H100),
# the parts then take what is left. The plan for a lease, as one device call (timeout_s 600):
#   GPU_CHECK_OUT=$OUT scripts/gpu_check.sh --deadline 420      (carry: [".whl"], after scripts/gpu_wheels.sh here)
# and back here, `python bench/gpu.py --record <the returned section.md>` puts the run into this checkout's RESULTS.md.
# Wheels in .whl/ (scripts/gpu_wheels.sh: xgrammar, which the image lacks, for the JSON-mask test) are installed
# into a scratch directory first; without them that one test is skipped, saying so.
# Before it, see scripts/gpu_unverified.md: the CUDA-only paths changed since the last green GPU run, each with the
# test or bench line that verifies it; a lease's check empties that list or records what failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-bench/out/gpu}"
start=$SECONDS  # the deadline counts from here
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/gpu.md"  # a report left by an earlier run is never appended as this one's
deadline=""
tests_timeout=180
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --deadline) deadline="${2:?--deadline needs seconds}"; shift 2 ;;
        --deadline=*) deadline="${1#--deadline=}"; shift ;;
        --tests-timeout) tests_timeout="${2:?--tests-timeout needs seconds}"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        .whl/*.whl && export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
set +e
timeout "$tests_timeout" "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 | tee "$OUT_DIR/cuda_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
set -e
echo "gpu_check: CUDA tests took $((SECONDS - start)) s" | tee -a "$OUT_DIR/cuda_tests.log"
if [ -n "$deadline" ]; then
    left=$(( ${deadline%.*} - (SECONDS - start) ))
    [ "$left" -gt 0 ] || left=1
    args+=(--deadline "$left")
fi
"$PY" bench/gpu.py --out "$OUT_DIR" "${args[@]+"${args[@]}"}" || status=1
summary=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$OUT_DIR/cuda_tests.log" | tail -n 1 || true)
if [ -f "$OUT_DIR/gpu.md" ]; then
    {
        cat "$OUT_DIR/gpu.md"
        echo
        echo "- CUDA tests (tests/test_cuda.py, run first): ${summary:-no summary (cut by --tests-timeout)}"
    } > "$OUT_DIR/section.md"
    "$PY" bench/gpu.py --record "$OUT_DIR/section.md" || status=1
else  # bench/RESULTS.md keeps the last run's section
    echo "gpu_check: bench/gpu.py wrote no report (see its output); bench/RESULTS.md left as it was" >&2
    status=1
fi
exit $status
