#!/usr/bin/env bash
# Check `pdserve simulate --hardware measured` against `pdserve bench` on this machine (docs/planning.md):
# for each load, serve MODEL in MODE, bench the load, stop the server, then simulate the same load (same seed)
# and print predicted vs measured. Run it on a quiet machine; timings taken beside other work are void.
#
#   MODEL=smollm2 MODE=adaptive OUT=bench/out/validate bash bench/validate_simulation.sh [LOAD ...]
#
# Each engine's steps go to $OUT/steps_{served,simulated}_LOAD.jsonl (PDSERVE_STEP_TRACE: the same line per step,
# virtual times in the simulated one), to see where a prediction parts from the run.
# LOADs: saturated long30 long10 multiturn (default: all four). EXTRA: flags added to every bench and simulate
# (e.g. EXTRA="--num-prompts 8" for a quick try); SERVE_EXTRA: flags added to serve and simulate (engine options).
set -euo pipefail
MODEL=${MODEL:-smollm2}
MODE=${MODE:-adaptive}
OUT=${OUT:-bench/out/validate}
PORT=${PORT:-8123}
PDSERVE=${PDSERVE:-python -m pdserve.server.cli}
SLO=${SLO:-"ttft_ms=2000 itl_ms=200"}
mkdir -p "$OUT"
TOKENIZER=$(python -c "from pdserve.engine.model.resolve import resolve_model; print(resolve_model('$MODEL').path)")
declare -A LOAD=(
  [saturated]="--dataset-name random --random-input-len 128 --random-output-len 64 --request-rate inf --num-prompts 40"
  [long30]="--dataset-name mixed --long-fraction 0.3 --long-input-len 2048 --short-input-len 64 --output-len 32 --request-rate 1 --num-prompts 40"
  [long10]="--dataset-name mixed --long-fraction 0.1 --long-input-len 1024 --short-input-len 64 --output-len 32 --request-rate 2 --num-prompts 40"
  [multiturn]="--dataset-name multiturn --num-conversations 12 --num-turns 4 --system-prompt-len 256 --user-message-len 32 --output-len 32 --request-rate 0.5"
)
for name in "${@:-saturated long30 long10 multiturn}"; do
  for load in $name; do
    flags="${LOAD[$load]} --tokenizer $TOKENIZER --num-warmups 2 --seed 0 --slo $SLO ${EXTRA:-}"
    rm -f "$OUT/steps_served_$load.jsonl" "$OUT/steps_simulated_$load.jsonl"
    PDSERVE_STEP_TRACE="$OUT/steps_served_$load.jsonl" $PDSERVE serve --model "$MODEL" --mode "$MODE" --port "$PORT" ${SERVE_EXTRA:-} > "$OUT/serve_$load.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
      kill -0 $server 2>/dev/null || { echo "server exited: $OUT/serve_$load.log" >&2; exit 1; }
      sleep 2
    done
    $PDSERVE bench --base-url "http://127.0.0.1:$PORT" --disable-tqdm $flags --result-json "$OUT/bench_$load.json"
    kill $server; wait $server || true
    PDSERVE_STEP_TRACE="$OUT/steps_simulated_$load.jsonl" $PDSERVE simulate --hardware measured --model "$MODEL" --mode "$MODE" ${SERVE_EXTRA:-} \
      --profile-json "$OUT/profile_$MODE.json" $flags --result-json "$OUT/sim_$load.json" \
      --compare "$OUT/bench_$load.json" | tee "$OUT/compare_$load.txt" | sed -n '/^predicted/,$p'
  done
done
