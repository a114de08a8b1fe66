#!/usr/bin/env bash
# One GPU check, under 8 minutes on one H200, from a bare checkout (pdserve need not be installed):
#
#     bash bench/gpu_check.sh          # on the GPU machine
#     bash bench/gpu_check.sh --cpu    # here: a dry run of every Python part on CPU (tiny sizes)
#
# Parts, each under its own time limit (their sum is the 8-minute bound); a part that fails or runs out
# of time is marked in the table and the others still run:
#   1. the GPU tests (pytest -m gpu)
#   2. the kernel benchmark: achieved bandwidth / FLOP/s next to the measured copy and matmul ceilings
#      (target: decode attention >= 70% of the copy ceiling)
#   3. CUDA-graph decode against eager (target: >= 3x the step rate at batch 1)
#   4. two actors on one GPU, colocated and disaggregated, greedy tokens against the CPU path
#   5. KV copies with torch, cupy-p2p and staged: cuda:0 -> cuda:1 where a second GPU exists
#   6. time to first token of the first request after READY=1 against the last of ten (target: <= 2x)
# It writes ONE results table for bench/RESULTS.md ("GPU"): gpu_check.md, with gpu_check.json (all numbers) and
# gpu_check.log (this output), to $OUT if set, else bench/out/.
#
# NOTE: the lent GPU machine (Python 3.12) has torch, triton, cupy, aiohttp, uvloop, safetensors,
# tokenizers, jinja2, prometheus-client, tqdm, pytest and pytest-timeout, but no network. Carry the
# rest as wheels in .whl (ignored by git), prepared here once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl orjson pytest-asyncio
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DEVICE=cuda:0
LIMITS=(install 40 tests 110 kernels 70 graphs 45 parity 70 transfer 30 first 85 report 15)
if [ "${1:-}" = "--cpu" ]; then
    DEVICE=cpu
fi
RESULTS="${OUT:-bench/out}"
RAW="$(mktemp -d)"
trap 'rm -rf "$RAW"' EXIT
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1
mkdir -p "$RAW/site" && ln -s "$PWD" "$RAW/site/pdserve"     # the checkout as the pdserve package, uninstalled
export PYTHONPATH="$RAW/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PDSERVE_CACHE="$RAW/cache"
unset TRITON_INTERPRET PDSERVE_KERNELS
status=0

limit() {  # limit NAME: the seconds NAME may take
    local i
    for ((i = 0; i < ${#LIMITS[@]}; i += 2)); do
        [ "${LIMITS[i]}" = "$1" ] && echo "${LIMITS[i + 1]}" && return
    done
    echo 60
}

part() {  # part KEY NAME COMMAND...: run COMMAND under KEY's limit, record its exit status and time
    local key=$1 name=$2 seconds start rc
    shift 2
    seconds=$(limit "$key")
    echo "== $name (at most ${seconds}s)"
    start=$SECONDS
    timeout --kill-after=10 "$seconds" "$@"
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$seconds" >> "$RAW/parts.tsv"
    [ "$rc" -eq 0 ] || status=1
}

if [ -d .whl ]; then
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    part install "install wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"

# NOTE: --continue-on-collection-errors: a module whose optional dependencies are missing must not hide the rest
part tests "gpu tests" python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    -o addopts="" --junitxml="$RAW/gpu_tests.xml" tests/
part kernels "kernel benchmark" python3 -m pdserve.bench.kernel_bench --device "${DEVICE%%:*}" --out "$RAW"
if [ "$DEVICE" = cpu ]; then
    part graphs "graph decode" python3 -m pdserve.bench.decode_graph_bench --device cpu --model demo:tiny --context 64 \
        --batch-sizes 1,4 --iters 3 --out "$RAW"
    part parity "parity" python3 -m pdserve.bench.gpu_parity --device cpu --model demo:tiny --max-tokens 8 --out "$RAW"
else
    part graphs "graph decode" python3 -m pdserve.bench.decode_graph_bench --device "$DEVICE" --out "$RAW"
    part parity "parity" python3 -m pdserve.bench.gpu_parity --device "$DEVICE" --out "$RAW"
fi
part transfer "kv transfer" python3 -m pdserve.bench.transfer_bench --out "$RAW"
part first "first request" python3 -m pdserve.bench.first_request --device "$DEVICE" \
    --model "$([ "$DEVICE" = cpu ] && echo demo:tiny || echo demo:base)" --out "$RAW"
part report "report" python3 -m pdserve.bench.gpu_report --raw "$RAW" --out "$RESULTS"
exit $status
