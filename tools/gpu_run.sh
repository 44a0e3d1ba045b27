#!/usr/bin/env bash
# Run on a lent GPU machine (no package registry), from the repository root, with gpu_carry/ and
# executor/pb/ carried (tools/gpu_prepare.sh made them): install the carried wheels offline, take
# the carried CPU kernels (else install the project without dependencies, which builds them), then
# the CUDA tests and/or the GPU benchmark. What it reports goes to $OUT (the device tool's output
# folder). Each part fits in one 10-minute call:
#
#   bash tools/gpu_run.sh first                    # the first call: tests, then sanitize, in one call
#                                                  # (a machine goes back 30 s after a call, and each
#                                                  # start costs a minute or two of the session's 30)
#   bash tools/gpu_run.sh tests [pytest args]      # the CUDA tests and the paged decode kernels' (on
#                                                  # CUDA), e.g. -k "not compiled" to split them
#   bash tools/gpu_run.sh bench [bench_gpu args]   # tools/bench_gpu.py (Qwen3-8B dims, 8 GiB cap); its
#                                                  # profile comes back as $OUT/bench_machine.yaml: copied
#                                                  # to gpu_carry/bench_machine.yaml, later calls reuse it
#                                                  # (the same figures for their plans, no re-profiling)
#   bash tools/gpu_run.sh bench --skip-capped --compiled --paged-decode
#                                                  # all-GPU decode: eager ops vs torch.compile, and
#                                                  # SDPA vs the paged decode kernels
#   bash tools/gpu_run.sh sanitize [pytest args]   # the tests whose copies cross CUDA streams (KV
#                                                  # offload and prefetch, pinned staging, streamed
#                                                  # prompt steps) under PyTorch's CUDA stream sanitizer,
#                                                  # which reports an access no event orders
#   bash tools/gpu_run.sh kernels                  # the CPU kernels' tests on this machine's CPU: its
#                                                  # AVX-512 / AVX512-BF16 paths, which our VMs may lack
#   bash tools/gpu_run.sh host                     # tools/bench_host_step.py: the host's work per GPU
#                                                  # decode step (on bench's checkpoint, after bench)
#   bash tools/gpu_run.sh all                      # tests and bench (default)
#
# Each pytest run is bounded (TESTS_BUDGET_S, SANITIZE_BUDGET_S; one test by pytest-timeout's
# TEST_TIMEOUT_S): at its budget it gets SIGINT, and pytest still prints what failed and why, so
# a run that hangs leaves its tracebacks in $OUT before the call's limit kills everything. The
# exit status says nothing: read the result files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/helm-gpu-out}
mkdir -p "$OUT"
what=${1:-all}
[ $# -gt 0 ] && shift
# the image's interpreter is python3 (a plain `python` may not exist); unbuffered, so a command cut
# off at its time limit still leaves everything it printed in $OUT
PY=${PYTHON:-python3}
python() { "$PY" "$@"; }
export PYTHONUNBUFFERED=1
export PIP_BREAK_SYSTEM_PACKAGES=1   # where python3 is a distribution's own (externally managed)
start=$SECONDS
python -V > "$OUT/setup.txt" 2>&1   # the carried wheels are cp312 (tools/gpu_prepare.sh)
python -m pip install -q --no-index --no-deps gpu_carry/wheels/*.whl >> "$OUT/setup.txt" 2>&1 \
    || { tail -40 "$OUT/setup.txt"; exit 1; }
# The CPU kernels carried, built for this Python (tools/gpu_prepare.sh): the checkout goes on the
# path as it is. Else the project, without dependencies (its build compiles the kernels in place,
# minutes); where even that cannot build offline, the kernels are built in place.
carried=gpu_carry/kernels/_kernels.$(python -c "import sysconfig; print(sysconfig.get_config_var('SOABI'))").so
if [ -f "$carried" ] && [ "$(bash tools/kernel_sources_digest.sh)" != "$(cat gpu_carry/kernels/SOURCES 2> /dev/null)" ]; then
    echo "the carried CPU kernels were built from other sources (run tools/gpu_prepare.sh again): building them here"
    carried=
fi
if [ -n "$carried" ] && [ -f "$carried" ] && cp "$carried" executor/kernels/ \
        && PYTHONPATH="$PWD" python -c "import executor.kernels" >> "$OUT/setup.txt" 2>&1; then
    echo "the CPU kernels: carried ($carried)" | tee -a "$OUT/setup.txt"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ! python -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/setup.txt" 2>&1; then
    echo "pip install -e . failed (see setup.txt): building the kernels in place, using PYTHONPATH"
    python setup.py -q build_ext --inplace >> "$OUT/setup.txt" 2>&1 || { tail -40 "$OUT/setup.txt"; exit 1; }
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "setup: $((SECONDS - start)) s" | tee -a "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/gpu.txt"
python -c "import torch, executor.kernels as k; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'kernels', k.KERNEL_ISA, 'of', k.available_isas())" | tee -a "$OUT/gpu.txt"
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } | tee -a "$OUT/gpu.txt"
# pytest bounded: SIGINT at the budget (seconds from now, or what the call has left before 550 s),
# after which pytest reports what failed; -rfE prints each failure's reason in the summary
bounded_pytest() {
    local budget=$1; shift
    local left=$((550 - (SECONDS - start)))
    [ "$budget" -gt "$left" ] && budget=$left
    [ "$budget" -lt 30 ] && { echo "no time left for: pytest $*"; return 0; }
    local per_test=()
    python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${TEST_TIMEOUT_S:-300}")
    timeout -s INT -k 20 "$budget" "$PY" -m pytest -q -s -rfE -p no:cacheprovider "${per_test[@]}" "$@"
}
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = first ]; then
    args=(--durations=12)
    [ "$what" = tests ] && args+=("$@")
    # one process per file: a CUDA error is sticky for the rest of its process, so a fault in one
    # file's test must not fail the other's
    bounded_pytest 90 "${args[@]}" tests/executor/test_paged_decode.py 2>&1 \
        | tee "$OUT/paged_decode_tests.txt" | tail -15
    # test_streamed_prefill.py runs its streamed steps on CUDA where there is CUDA; the daemon's
    # end-to-end tests serve a plan whose second stage is CUDA's (16 concurrent streams among them)
    bounded_pytest "${TESTS_BUDGET_S:-300}" "${args[@]}" tests/executor/test_cuda.py \
        tests/executor/test_streamed_prefill.py 2>&1 | tee "$OUT/cuda_tests.txt" | tail -45
    bounded_pytest 60 "${args[@]}" tests/executor/daemon/test_e2e.py 2>&1 \
        | tee "$OUT/daemon_tests.txt" | tail -15
    echo "tests: done at $((SECONDS - start)) s"
fi
if [ "$what" = sanitize ] || [ "$what" = first ]; then
    # eager steps only: the sanitizer follows kernels launched one by one, not a captured graph's.
    # It tracks CUDA tensors only: a race on a page-locked host page (item 1 of issue 11) is the
    # test's own loop's to provoke (test_prefetch_reads_what_the_compute_stream_wrote_in_a_loop)
    sargs=()
    [ "$what" = sanitize ] && sargs+=("$@")
    HELM_CUDA_GRAPHS=0 TORCH_CUDA_SANITIZER=1 bounded_pytest "${SANITIZE_BUDGET_S:-150}" \
        tests/executor/test_cuda.py \
        -k "eviction or prefetch or 3000_token or gather or staging or streamed_prompt_steps_on_cuda or prefix_reuse" \
        "${sargs[@]}" 2>&1 | tee "$OUT/sanitized_tests.txt" | tail -25
fi
if [ "$what" = kernels ]; then
    python -m pytest -q -p no:cacheprovider tests/executor/kernels tests/executor/test_every_isa.py \
        tests/executor/test_fused_blocks.py tests/executor/test_probe.py 2>&1 | tee "$OUT/cpu_kernel_tests.txt" | tail -15
fi
if [ "$what" = host ]; then
    model=/tmp/helm-bench-gpu/qwen3-8b-bf16   # bench_gpu.py's default checkpoint; else a small one
    [ -f "$model/config.json" ] || { model=/tmp/helm-host-qwen3-0.6b;
        python tools/make_model.py --size qwen3-0.6b --dtype bf16 --seed 0 --out "$model" --force > /dev/null; }
    python tools/bench_host_step.py --model "$model" "$@" 2>&1 | tee "$OUT/host_step.txt" | tail -12
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    work=/tmp/helm-bench-gpu
    mkdir -p "$work"
    # the profile an earlier call measured (it came back in its $OUT): the same figures for the plans
    [ -f gpu_carry/bench_machine.yaml ] && cp gpu_carry/bench_machine.yaml "$work/machine.yaml" \
        && echo "bench: the carried profile (gpu_carry/bench_machine.yaml)"
    bargs=()
    [ "$what" = bench ] && bargs+=("$@")
    left=$((560 - (SECONDS - start)))
    if [ "$left" -lt 60 ]; then
        echo "bench: no time left in this call ($left s): run it in a call of its own"
    else
        timeout -s INT -k 15 "$left" "$PY" tools/bench_gpu.py --work "$work" \
            --out "$OUT/bench_gpu.json" "${bargs[@]}" 2>&1 | tee "$OUT/bench_gpu.txt" | tail -40
    fi
    cp "$work/machine.yaml" "$OUT/bench_machine.yaml" 2>/dev/null
fi
