#!/usr/bin/env bash
# Prepare, on a machine with a package registry, what a lent GPU machine (none) needs to run the
# GPU checks (issue 11): Python 3.12 wheels of what its image lacks, at the versions this checkout's
# generated gRPC code was made with, in gpu_carry/wheels, and executor/pb/ generated here.
#
#   bash tools/gpu_prepare.sh
#   then, with the device tool: run  bash tools/gpu_run.sh   carrying  gpu_carry  executor/pb
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python setup.py -q build_py   # regenerates executor/pb/ from protos/ (never a stale copy)
out=gpu_carry/wheels
rm -rf "$out" && mkdir -p "$out"
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$out" "grpcio==$(ver grpcio)" "protobuf==$(ver protobuf)" \
    "grpcio-health-checking==$(ver grpcio-health-checking)" "grpcio-reflection==$(ver grpcio-reflection)" \
    jsonschema prometheus-client
du -sh gpu_carry executor/pb
ls "$out"
