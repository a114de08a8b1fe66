#!/usr/bin/env bash
# 1P1D adaptive at this checkout vs an older commit (OLD_TREE: a worktree of it) on the three adaptive loads, three
# alternating runs, SmolLM2: OLD_TREE=/path/to/worktree OUT=experiments/out/m22 bash experiments/adaptive_vs_commit.sh
set -uo pipefail
O=${OUT:-$PWD/experiments/out/m22}; mkdir -p $O; OLD=${OLD_TREE:?a worktree of the older commit}
cd /tmp    # NOTE: not the checkout: an old commit's top-level packages must not shadow its own tree
PORT=8124
TOKENIZER=$(python -c "from pdserve.engine.model.resolve import resolve_model; print(resolve_model('smollm2').path)")
declare -A LOAD=(
  [saturated]="--dataset-name random --random-input-len 128 --random-output-len 64 --request-rate inf --num-prompts 40"
  [long30]="--dataset-name mixed --long-fraction 0.3 --long-input-len 2048 --short-input-len 64 --output-len 32 --request-rate 1 --num-prompts 40"
  [long10]="--dataset-name mixed --long-fraction 0.1 --long-input-len 1024 --short-input-len 64 --output-len 32 --request-rate 2 --num-prompts 40"
)
mkdir -p /tmp/pdserve-old-site && ln -sfn "$OLD" /tmp/pdserve-old-site/pdserve
declare -A PP=([new]="" [old]="$OLD:/tmp/pdserve-old-site")
for run in 1 2 3; do for load in saturated long30 long10; do for commit in new old; do
  PYTHONPATH=${PP[$commit]} python -m pdserve.server.cli serve --model smollm2 --mode adaptive --port $PORT > $O/serve_${commit}_${load}_$run.log 2>&1 &
  server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do kill -0 $server 2>/dev/null || { echo "server exited" >&2; break; }; sleep 2; done
  python -m pdserve.server.cli bench --base-url "http://127.0.0.1:$PORT" --disable-tqdm ${LOAD[$load]} --tokenizer $TOKENIZER --num-warmups 2 --seed 0 --slo ttft_ms=2000 itl_ms=200 --result-json $O/${commit}_${load}_$run.json > $O/${commit}_${load}_$run.out 2>&1
  kill $server; wait $server
done; done; done
