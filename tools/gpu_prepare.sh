#!/usr/bin/env bash
# Prepare, on a machine with a package registry, what a lent GPU machine (none) needs to run the
# GPU checks (issue 11): Python 3.12 wheels of what its image lacks, at the versions this checkout's
# generated gRPC code was made with, in gpu_carry/wheels, executor/pb/ generated here, and the CPU
# kernels built for Python 3.12 in gpu_carry/kernels (where a python3.12 is here).
#
#   bash tools/gpu_prepare.sh
#   then, with the device tool: run  bash tools/gpu_run.sh   carrying  gpu_carry  executor/pb
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# setup.py needs the build requirements at their pinned versions (pip install -e . had them in an
# isolated environment only); pip installs nothing where they are met. (pyproject's one line of
# build requires, read with a regular expression: Python 3.10 has no tomllib.)
pip install -q $(python -c 'import re; t = open("pyproject.toml").read()
print(" ".join(re.findall(r"\"([^\"]+)\"", re.search(r"^requires = \[(.*)\]", t, re.M).group(1))))')
python setup.py -q build_py   # regenerates executor/pb/ from protos/ (never a stale copy)
# Each part is made aside and swapped in only once whole: a download or build that fails keeps
# the carry that was there.
out=gpu_carry/wheels
mkdir -p gpu_carry
fresh=$(mktemp -d gpu_carry/.wheels.XXXXXX)
trap 'rm -rf "$fresh"' EXIT
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$fresh" "grpcio==$(ver grpcio)" "protobuf==$(ver protobuf)" \
    "grpcio-health-checking==$(ver grpcio-health-checking)" "grpcio-reflection==$(ver grpcio-reflection)" \
    jsonschema prometheus-client
rm -rf "$out" && mv "$fresh" "$out"
# The CPU kernels, built here for the image's Python 3.12: their build (seven C units at -O3, one
# after another) takes minutes of a lent machine's time, in every call that starts a fresh one.
# One build carries every ISA's variant (setup.py), so this one runs there. Without a python3.12
# here, gpu_run.sh builds them there.
py312=
for candidate in python3.12 "$(pyenv root 2> /dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -V > /dev/null 2>&1; then py312=$candidate; break; fi   # (a pyenv shim may not run)
done
if [ -n "$py312" ]; then
    tmp=$(mktemp -d)
    "$py312" -m venv "$tmp/venv"
    "$tmp/venv/bin/pip" install -q "cython==$(ver cython)" setuptools
    mkdir -p "$tmp/src/executor/kernels"
    cp setup.py pyproject.toml "$tmp/src/"
    cp -r executor/kernels/_kernels.pyx executor/kernels/csrc "$tmp/src/executor/kernels/"
    (cd "$tmp/src" && "$tmp/venv/bin/python" setup.py -q build_ext --inplace > build.log 2>&1) \
        || { tail -20 "$tmp/src/build.log"; rm -rf "$tmp"; exit 1; }
    mkdir -p "$tmp/kernels"
    for so in "$tmp"/src/executor/kernels/_kernels.cpython-312-*.so; do
        strip --strip-debug -o "$tmp/kernels/$(basename "$so")" "$so"
    done
    bash tools/kernel_sources_digest.sh > "$tmp/kernels/SOURCES"  # what it was built from
    rm -rf gpu_carry/kernels && mv "$tmp/kernels" gpu_carry/kernels
    rm -rf "$tmp"
else
    echo "gpu_prepare: no python3.12 here: gpu_run.sh will build the CPU kernels on the GPU machine"
fi
du -sh gpu_carry executor/pb
ls "$out" gpu_carry/kernels 2>/dev/null
