#!/usr/bin/env bash
# Stop what a device call left running (GPU machine; every process there is ours):
#   1. SIGTERM to the benchmark drivers (longdoc, sharegpt): each kills the engine process
#      groups it started (its SIGTERM handler) and exits; wait up to 45 s for them;
#   2. then SIGKILL every process that still holds GPU memory and every vLLM server, and
#      wait until the GPU's memory is free (an orphaned engine core keeps its memory, and
#      the next engine fails to start: the twenty-first session lost a call that way).
# Used after `timeout ... h200_runs.sh` in a call, and by h200_runs.sh before its step.
#   bash scripts/h200_stop.sh
pkill -TERM -f '[k]vcache_core.bench.longdoc --model' 2>/dev/null
pkill -TERM -f '[k]vcache_core.bench.sharegpt run' 2>/dev/null
for _ in $(seq 90); do
  pgrep -f '[k]vcache_core.bench.(longdoc --model|sharegpt run)' >/dev/null || break
  sleep 0.5
done
pkill -KILL -f '[v]llm.entrypoints' 2>/dev/null
if command -v nvidia-smi >/dev/null 2>&1; then
  for _ in $(seq 60); do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)
    [ -z "$pids" ] && break
    echo "h200_stop: killing GPU processes left over: $(echo $pids)" >&2
    kill -9 $pids 2>/dev/null
    sleep 0.5
  done
fi
exit 0
