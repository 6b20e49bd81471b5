#!/usr/bin/env bash
# One device call's work on the GPU machine: a step of scripts/h200_runs.sh with a time
# limit that leaves nothing behind, its results kept for a later call of the same lease
# and copied to $OUT.
#
#   bash scripts/h200_call.sh SECONDS STEP MODEL      (environment as for h200_runs.sh)
#
# - SECONDS may be `auto` (with CONFIGS set): PER_CONFIG_S per configuration in CONFIGS,
#   plus 30 s for the disk probe unless NOPROBE=1. PER_CONFIG_S defaults to 110 on an
#   H200 and 170 on any other card (the queued mixed workload's configuration, store
#   phase included, took 80-90 s on the H200 and 130-150 s on an H100 in the
#   twenty-seventh session; limits below that cut every configuration);
# - sources the staged runtime (/tmp/rt/env.sh) when it is there;
# - RES defaults to /tmp/res, which survives between calls while the machine is held:
#   a longdoc-based step cut short resumes in the next call (--resume skips the
#   configurations, or with ROUNDS the (configuration, round) pairs, already measured);
#   FRESH=1 empties it first;
# - after SECONDS, scripts/h200_stop.sh ends the step: the benchmark drivers kill their
#   engine process groups (SIGTERM handler), then whatever still holds GPU memory is
#   killed (`timeout` alone would end only the shell, and an orphaned engine core keeps
#   its GPU memory: the next engine fails to start);
# - the step's log goes to $RES/call-STEP$SUFFIX.log (SUFFIX as for h200_runs.sh, so that
#   two steps in one call, or calls of one lease, keep their own logs); $RES is archived
#   as $OUT/res.tgz;
# - SPY=1: scripts/stack_sampler.py samples the engine processes' stacks (py-spy dump
#   --native, every SPY_INTERVAL s, default 0.5) into $RES/stacks-STEP$SUFFIX.txt while the
#   step runs, with time.monotonic() stamps that line up with the reactor trace (TRACE=1):
#   carry the py-spy binary as .gpu/py-spy (or set PYSPY). Where was the engine's main
#   thread during a stall (`trace_report.py --stalls`)? grep its stack at those times.
set -uo pipefail
T=${1:?seconds}; STEP=${2:?step}; M=${3:?model}
[ -f /tmp/rt/env.sh ] && source /tmp/rt/env.sh
if [ "$T" = auto ]; then
  [ -n "${CONFIGS:-}" ] || { echo "h200_call: SECONDS=auto needs CONFIGS" >&2; exit 2; }
  n=$(awk -F, '{print NF}' <<< "$CONFIGS")
  if [ -z "${PER_CONFIG_S:-}" ]; then
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
      *H200*) PER_CONFIG_S=110 ;;
      *) PER_CONFIG_S=170 ;;
    esac
  fi
  probe=30; [ -n "${NOPROBE:-}" ] && probe=0
  T=$(( n * PER_CONFIG_S + probe ))
  echo "h200_call: $STEP limit ${T}s ($n configuration(s) x ${PER_CONFIG_S}s)"
fi
export RES=${RES:-/tmp/res}
[ -n "${FRESH:-}" ] && rm -rf "$RES"
mkdir -p "$RES"
OUT=${OUT:-$RES/out}
LOG="$RES/call-$STEP${SUFFIX:-}.log"
# its own process group, so that whatever of it is left can be killed as a whole
setsid bash scripts/h200_runs.sh "$STEP" "$M" > "$LOG" 2>&1 &
pid=$!
spy=
if [ -n "${SPY:-}" ]; then
  PYSPY=${PYSPY:-.gpu/py-spy}
  if [ -x "$PYSPY" ]; then
    python3 scripts/stack_sampler.py --pyspy "$PYSPY" --native \
      --interval "${SPY_INTERVAL:-0.5}" --out "$RES/stacks-$STEP${SUFFIX:-}.txt" \
      2>> "$LOG" &
    spy=$!
  else
    echo "h200_call: SPY=1 but no py-spy at $PYSPY: no stacks" | tee -a "$LOG"
  fi
fi
end=$(( SECONDS + T ))
while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
  echo "h200_call: $STEP still running after ${T}s: stopping it" | tee -a "$LOG"
  bash scripts/h200_stop.sh >> "$LOG" 2>&1
  kill -TERM -- "-$pid" 2>/dev/null
  sleep 2
  kill -KILL -- "-$pid" 2>/dev/null
fi
wait "$pid"; rc=$?
if [ -n "$spy" ]; then kill -TERM "$spy" 2>/dev/null; wait "$spy" 2>/dev/null; fi
bash scripts/h200_stop.sh >> "$LOG" 2>&1
echo "h200_call: $STEP rc=$rc" | tee -a "$LOG"
mkdir -p "$OUT"
tar czf "$OUT/res.tgz" --exclude=out -C "$(dirname "$RES")" "$(basename "$RES")"
exit 0
