#!/usr/bin/env bash
# The main job on the default model: build it if missing (random weights, real Qwen3-0.6B
# dimensions, bf16), then generate offline through the executor on this machine.
#   HELM_MODEL_SIZE=qwen3-1.7b bash tools/demo.sh     # another preset from tools/model_configs
set -euo pipefail
cd "$(dirname "$0")/.."
size=${HELM_MODEL_SIZE:-qwen3-0.6b}
model=${HELM_MODEL_DIR:-models/$size}

if [ ! -f "$model/config.json" ]; then
    echo "== building $size (random weights, bf16) in $model"
    python tools/make_model.py --size "$size" --dtype bf16 --seed 0 --out "$model" --force
fi

echo "== generating with $model (all units on the CPU: no plan given)"
helm-executor generate --model "$model" --prompt "The history of the river valley" \
    --max-new-tokens 32 --temperature 0.8 --top-p 0.95 --seed 0
