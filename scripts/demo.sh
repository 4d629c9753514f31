#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct): set up, build an int8 artifact,
# and print its quality report (perplexity, KL, top-1 agreement against the base) and memory report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
scripts/setup.sh
DATA="${QUANTSERVE_DATA:-../shared/data/wikitext-2}"
OUT="artifacts/SmolLM2-135M-Instruct-int8-sym"
eval_args=()
if [[ -f "$DATA/test.txt" ]]; then
  eval_args=(--eval-data "$DATA/test.txt" --eval-windows 16 --eval-seqlen 512)
else
  echo "note: $DATA/test.txt not found: building without a quality report (set QUANTSERVE_DATA)" >&2
fi
"$PY" -m quant.cli build --scheme int8-sym --out "$OUT" --force "${eval_args[@]}"
"$PY" -m quant.cli verify "$OUT"
echo "artifact: $(pwd)/$OUT"
