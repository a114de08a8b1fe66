#!/usr/bin/env bash
# One GPU check, under 8 minutes on one H200: the GPU tests, then the kernel benchmark (its table
# is printed last), then the whole-model CUDA-graph decode benchmark when bench/decode_graph_bench.py
# exists. Runs from a bare checkout (pdserve need not be installed): bash bench/gpu_check.sh
# Results go to $OUT if set, else bench/out/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET PDSERVE_KERNELS
status=0

# NOTE: the lent GPU machine has torch, triton, cupy, aiohttp and uvloop but no network. Prepare the
# rest here (`pip download -d .wheels orjson safetensors tokenizers jinja2 prometheus_client tqdm
# pytest pytest-asyncio pytest-timeout --python-version 3.11 --only-binary=:all:`) and carry `.wheels`.
if [ -d .wheels ]; then
    python -m pip install -q --no-index --find-links .wheels orjson safetensors tokenizers jinja2 \
        prometheus_client tqdm pytest pytest-asyncio pytest-timeout || status=1
fi

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

echo "== GPU tests"
if python -c "import pytest" 2>/dev/null; then
    # NOTE: --continue-on-collection-errors: a module whose optional dependencies are missing here must not hide the rest
    timeout 240 python -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
        -o addopts="" tests/ || status=1
else
    echo "pytest is not installed: GPU tests not run"; status=1
fi

if [ -f bench/decode_graph_bench.py ]; then
    echo "== decode graph benchmark"
    timeout 90 python -m bench.decode_graph_bench || status=1
fi

echo "== kernel benchmark"
timeout 150 python -m bench.kernel_bench || status=1
exit $status
