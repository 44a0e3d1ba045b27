#!/usr/bin/env bash
# The main job on the default model: build it if missing (random weights, real Qwen3-0.6B
# dimensions, bf16), profile this machine, plan the model for it, then generate offline
# through the executor with that plan.
#   HELM_MODEL_SIZE=qwen3-1.7b bash tools/demo.sh     # another preset from tools/model_configs
set -euo pipefail
cd "$(dirname "$0")/.."
size=${HELM_MODEL_SIZE:-qwen3-0.6b}
model=${HELM_MODEL_DIR:-models/$size}
machine=models/machine.yaml
plan=models/$size.plan.yaml

if [ ! -f "$model/config.json" ]; then
    echo "== building $size (random weights, bf16) in $model"
    python tools/make_model.py --size "$size" --dtype bf16 --seed 0 --out "$model" --force
fi
if [ ! -f "$machine" ]; then
    echo "== profiling this machine (quick) into $machine"
    helm-plan profile --quick --name this-machine -o "$machine"
fi
echo "== planning $size for this machine"
helm-plan plan "$model" --machine "$machine" -o "$plan"
head -n 3 "$plan"

echo "== generating with $model on $plan"
helm-executor generate --model "$model" --plan "$plan" --prompt "The history of the river valley" \
    --max-new-tokens 32 --temperature 0.8 --top-p 0.95 --seed 0
