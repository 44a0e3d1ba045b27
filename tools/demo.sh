#!/usr/bin/env bash
# The main job on the default model, end to end: build it if missing (random weights, real
# Qwen3-0.6B dimensions, bf16), profile this machine, plan the model for it, start the executor
# daemon on that plan, stream a generation over gRPC, show measured versus predicted step time,
# and stop the daemon cleanly (SIGTERM: it drains and exits 0).
#   HELM_MODEL_SIZE=qwen3-1.7b bash tools/demo.sh     # another preset from tools/model_configs
set -euo pipefail
cd "$(dirname "$0")/.."
size=${HELM_MODEL_SIZE:-qwen3-0.6b}
model=${HELM_MODEL_DIR:-models/$size}
machine=models/machine.yaml
plan=models/$size.plan.yaml
log=models/$size.daemon.log
report=models/$size.report.json
start_timeout_s=600

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

echo "== starting the daemon on $plan (JSON logs: $log)"
helm-executor serve --plan "$plan" --model "$model" --host 127.0.0.1 --port 0 2> "$log" &
pid=$!
stop_daemon() {  # on any exit: SIGTERM, then SIGKILL if it has not drained within 60 s
    if kill -0 "$pid" 2> /dev/null; then
        kill -TERM "$pid" 2> /dev/null || true
        for _ in $(seq 1 600); do kill -0 "$pid" 2> /dev/null || return 0; sleep 0.1; done
        echo "the daemon did not stop; killing it" >&2
        kill -KILL "$pid" 2> /dev/null || true
    fi
}
trap stop_daemon EXIT

port=""
for _ in $(seq 1 $((start_timeout_s * 10))); do
    port=$(grep -o '"msg": "listening".*"port": [0-9]*' "$log" | grep -o '[0-9]*$' || true)
    [ -n "$port" ] && break
    if ! kill -0 "$pid" 2> /dev/null; then echo "the daemon exited:" >&2; cat "$log" >&2; exit 1; fi
    sleep 0.1
done
[ -n "$port" ] || { echo "the daemon did not start listening within $start_timeout_s s" >&2; exit 1; }
addr=127.0.0.1:$port
echo "== waiting for SERVING on $addr (the plan loads and warms up first)"
helm-executor info --addr "$addr" --wait "$start_timeout_s" > /dev/null

echo "== streaming a generation over gRPC"
helm-executor generate --addr "$addr" --prompt "The history of the river valley" \
    --max-new-tokens 32 --temperature 0.8 --top-p 0.95 --seed 0

echo "== measured vs predicted step time per stage (helm-executor report; JSON in $report)"
helm-executor report --addr "$addr" -o "$report"

echo "== stopping the daemon (SIGTERM: drains, exits 0)"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
trap - EXIT
grep '"msg": "stopped"' "$log" || true
[ "$status" -eq 0 ] || { echo "the daemon exited with $status" >&2; exit "$status"; }
echo "== done"
