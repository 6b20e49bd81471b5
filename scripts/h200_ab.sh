#!/usr/bin/env bash
# A/B of two commits on the GPU machine in one device call (issue 14's "within 3% of the
# run before the change, same lease, both commits"): the long-document benchmark
# (kvcache_core.bench.longdoc, 1k-64k) per configuration, runs of the two commits
# interleaved (round r: before,after if r is odd, else after,before), one engine process
# per run, until ABBUDGET seconds have passed. Results: /tmp/ab/<before|after>-r<round>/
# longdoc-$M.json and logs, archived as $OUT/ab.tgz; then `python scripts/ab_report.py
# ab-dir --json docs/results/h200/ab-<name>-$M.json` on the CPU machine.
#
# On the CPU machine first (the device copy has no git history):
#   rm -rf .gpu/before && mkdir -p .gpu/before && \
#     git archive <before-commit> kvcache_core scripts configs pyproject.toml | tar x -C .gpu/before
# Device call (after staging the runtime), carry [".gpu/before"]:
#   source /tmp/rt/env.sh && CONFS="kvcache_dram kvcache_disk" bash scripts/h200_ab.sh
# CONFS, R0 (first round number), ABBUDGET (s, default 430), M (model) narrow a call;
# RUNLIMIT (s, default 150) stops a run, with a py-spy dump of it in <run>.log.hang when
# .gpu/extra holds the py-spy wheel (carry it).
# A/B of configuration keys instead of commits: BKV / AKV = "key=json key=json" extra
# py-kvcache keys of the before / after side, and SAMETREE=1 runs both from this tree
# (no .gpu/before needed), e.g.
#   SAMETREE=1 AKV=switch_interval_s=0 CONFS=kvcache_disk bash scripts/h200_ab.sh
# LDARGS="--flag value ...": extra longdoc arguments for both sides, e.g.
#   SAMETREE=1 AKV=dram_load_sync=true LDARGS="--hit-suffix-tokens 64" CONFS=kvcache_dram
set -u
M=${M:-llama-3.2-3b}; T0=$(date +%s); AFTER=$PWD
run() { # $1=before|after $2=config $3=round
  local dir=$AFTER; [ "$1" = before ] && [ -z "${SAMETREE:-}" ] && dir=$AFTER/.gpu/before
  local kvx=() kv; [ "$1" = before ] && kv=${BKV:-} || kv=${AKV:-}
  for k in $kv; do kvx+=(--kv-extra "$k"); done
  rm -rf /tmp/ldroot; mkdir -p "/tmp/ab/$1-r$3"
  local log="/tmp/ab/$1-r$3-$2.log"
  ( cd "$dir" && export PYTHONPATH=$dir:/tmp/rt:/tmp/site && \
    exec python3 -m kvcache_core.bench.longdoc --model "$AFTER/configs/models/$M" \
      --root /tmp/ldroot --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) (GPU machine)" --append --resume --timeout 140 \
      --no-probe --json "/tmp/ab/$1-r$3/longdoc-$M.json" --configs "$2" "${kvx[@]}" \
      ${LDARGS:-} ) > "$log" 2>&1 &
  # watchdog: a run past RUNLIMIT s (default 150) gets a py-spy dump of its process tree
  # (PYSPY: the binary, from the wheel in .gpu/extra) appended to its log, then is killed
  local p=$! t=0 rc
  while kill -0 "$p" 2>/dev/null && [ "$t" -lt "${RUNLIMIT:-150}" ]; do sleep 1; t=$((t+1)); done
  if kill -0 "$p" 2>/dev/null; then
    local tree; tree="$p $(desc "$p")"
    if [ -n "${PYSPY:-}" ]; then
      for q in $tree; do echo "=== py-spy dump $q: $(tr '\0' ' ' < /proc/$q/cmdline 2>/dev/null | cut -c1-160)"
        timeout 20 "$PYSPY" dump --pid "$q" 2>&1; done >> "$log.hang" 2>&1
    fi
    kill $tree 2>/dev/null; sleep 3; kill -9 $tree 2>/dev/null; wait "$p" 2>/dev/null; rc=124
  else
    wait "$p"; rc=$?
  fi
  echo "$(($(date +%s)-T0))s $1 $2 r$3 rc=$rc"
}
desc() { local c; for c in $(pgrep -P "$1"); do echo "$c"; desc "$c"; done; }
[ -n "${PYSPY:-}" ] || PYSPY=$(bash scripts/pyspy_bin.sh)
SITE=$(python3 -c 'import vllm,os;print(os.path.dirname(os.path.dirname(vllm.__file__)))')
python3 -m kvcache_core.cli patch-vllm --target "$SITE" >/dev/null
python3 -m kvcache_core.cli patch-vllm --target "$SITE" --check
r=${R0:-1}
while :; do
  for c in ${CONFS:-kvcache_dram kvcache_disk}; do
    if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
    for w in $order; do
      [ $(($(date +%s)-T0)) -gt "${ABBUDGET:-430}" ] && break 3
      run "$w" "$c" "$r"
    done
  done
  r=$((r+1))
done
tar czf "${OUT:-/tmp}/ab.tgz" -C /tmp ab
