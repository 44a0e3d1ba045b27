#!/usr/bin/env bash
# The sha256 of what the CPU kernels are built from (setup.py, the Cython module, the C sources),
# globbed in the C locale: tools/gpu_prepare.sh records it beside the kernels it carries, and
# tools/gpu_run.sh builds afresh where the checkout's differs.
set -euo pipefail
cd "$(dirname "$0")/.."
LC_ALL=C
cat setup.py executor/kernels/_kernels.pyx executor/kernels/csrc/* | sha256sum | cut -d' ' -f1
