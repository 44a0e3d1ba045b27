#!/usr/bin/env bash
# Run on a lent GPU machine (no package registry), from the repository root, with gpu_carry/ and
# executor/pb/ carried (tools/gpu_prepare.sh made them): install the carried wheels offline, build
# the CPU kernels in place, install the project without dependencies, then the CUDA tests and the
# GPU benchmark. Everything it reports goes to $OUT (the device tool's output folder).
#
#   bash tools/gpu_run.sh                       # CUDA tests + tools/bench_gpu.py (Qwen3-8B dims, 8 GiB cap)
#   bash tools/gpu_run.sh --skip-accelerate     # arguments go to bench_gpu.py
#   HELM_GPU_TESTS_ONLY=1 bash tools/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/helm-gpu-out}
mkdir -p "$OUT"
{
    python -m pip install -q --no-index --no-deps gpu_carry/wheels/*.whl && python setup.py -q build_ext --inplace
} > "$OUT/setup.txt" 2>&1 || { tail -40 "$OUT/setup.txt"; exit 1; }
# The project itself, without dependencies; where even that cannot build offline, the checkout
# on the path serves (the console scripts are then `python -m planner` / `python -m executor.cli`).
python -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/setup.txt" 2>&1 \
    || { echo "pip install -e . failed (see setup.txt): using PYTHONPATH"; export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, executor.kernels as k; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'kernels', k.KERNEL_ISA)" | tee -a "$OUT/gpu.txt"
python -m pytest -q -p no:cacheprovider tests/executor/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.txt" | tail -30
if [ -z "${HELM_GPU_TESTS_ONLY:-}" ]; then
    python tools/bench_gpu.py --out "$OUT/bench_gpu.json" "$@" 2>&1 | tee "$OUT/bench_gpu.txt" | tail -40
fi
