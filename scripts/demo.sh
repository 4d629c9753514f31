#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct), from a fresh machine:
#   set up; build the GPTQ w4a16 artifact (with its quality and memory report); serve it over gRPC and HTTP;
#   through quant-client: one generation, a trace of what temperature / top-k / top-p kept, a small sampling
#   sweep (CSV + JSON), and PNG plots of both; stop the server (SIGTERM: graceful drain); print the paths.
# Environment: QUANTSERVE_DATA (WikiText-2 dir, default ../shared/data/wikitext-2), DEMO_OUT (default
# demo-out), DEMO_GRPC_PORT / DEMO_HTTP_PORT (default 50051 / 8000), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
scripts/setup.sh --client
DATA="${QUANTSERVE_DATA:-../shared/data/wikitext-2}"
OUT="${DEMO_OUT:-demo-out}"
ART="artifacts/SmolLM2-135M-Instruct-w4a16"
GRPC_PORT="${DEMO_GRPC_PORT:-50051}"
HTTP_PORT="${DEMO_HTTP_PORT:-8000}"
mkdir -p "$OUT"

# --- 1. build -------------------------------------------------------------------------------------------
build_args=(--scheme w4a16 --out "$ART" --force)
if [[ -f "$DATA/valid.txt" && -f "$DATA/test.txt" ]]; then
  build_args+=(--calib "$DATA/valid.txt" --eval-data "$DATA/test.txt" --eval-windows 16 --eval-seqlen 512)
else
  echo "note: WikiText-2 not found in $DATA: calibrating on model-generated text, no quality report" >&2
  build_args+=(--calib self --calib-samples 32 --calib-seqlen 256)
fi
"$PY" -m quant.cli build "${build_args[@]}"
"$PY" -m quant.cli verify "$ART"

# --- 2. serve -------------------------------------------------------------------------------------------
"$PY" -m quant.cli serve "$ART" --grpc-port "$GRPC_PORT" --http-port "$HTTP_PORT" --memory-budget 256MiB \
  --grace 10 2> "$OUT/server.log" &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER"
    wait "$SERVER" || echo "server exited with status $?" >&2
  fi
}
trap stop_server EXIT
CLIENT=(quant-client)
TARGET=(--target "127.0.0.1:$GRPC_PORT")
for _ in $(seq 300); do  # loading (and the first kernel build) takes a while on a fresh machine
  if "${CLIENT[@]}" info "${TARGET[@]}" --timeout 2 > /dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "the server exited:" >&2; cat "$OUT/server.log" >&2; exit 1; fi
  sleep 1
done
"${CLIENT[@]}" info "${TARGET[@]}"

# --- 3. the client --------------------------------------------------------------------------------------
echo "== generate (gRPC)"
"${CLIENT[@]}" generate "The harbour was quiet that morning, and" "${TARGET[@]}" --temperature 0.7 \
  --top-p 0.9 --seed 1 --max-new-tokens 48
echo "== the same request over HTTP (same seed, same text)"
"${CLIENT[@]}" generate "The harbour was quiet that morning, and" --http --target "127.0.0.1:$HTTP_PORT" \
  --temperature 0.7 --top-p 0.9 --seed 1 --max-new-tokens 48
echo "== chat (the server applies the model's chat template)"
echo "Write one sentence about the sea." | "${CLIENT[@]}" chat "${TARGET[@]}" --temperature 0.7 --seed 1 \
  --max-new-tokens 48
echo "== trace: what temperature, top-k and top-p kept at each step"
"${CLIENT[@]}" trace "The capital of France is" "${TARGET[@]}" --temperature 0.8 --top-k 40 --top-p 0.9 \
  --seed 3 --max-new-tokens 4 --trace-n 8 --json "$OUT/trace.json"
echo "== sweep"
"${CLIENT[@]}" sweep "Once upon a time" "${TARGET[@]}" --temperature 0.7,1.0,1.3 --top-k 0,40 \
  --top-p 1.0,0.9,0.5 --seeds 2 --max-new-tokens 24 --csv "$OUT/sweep.csv" --json "$OUT/sweep.json"
"${CLIENT[@]}" plot --trace "$OUT/trace.json" --step 0 --out "$OUT/trace-step0.png"
"${CLIENT[@]}" plot --sweep "$OUT/sweep.json" --metric mean_entropy --out "$OUT/sweep-mean_entropy.png"

# --- 4. stop (graceful drain), then where everything is -------------------------------------------------
trap - EXIT
kill -TERM "$SERVER"
wait "$SERVER"
echo
echo "artifact:   $(pwd)/$ART"
echo "server log: $(pwd)/$OUT/server.log"
echo "trace:      $(pwd)/$OUT/trace.json"
echo "sweep:      $(pwd)/$OUT/sweep.csv  $(pwd)/$OUT/sweep.json"
echo "plots:      $(pwd)/$OUT/trace-step0.png  $(pwd)/$OUT/sweep-mean_entropy.png"
