#!/usr/bin/env bash
# The GPU measurements behind docs/results/h200/ (one H200, vLLM 0.26.0 runtime staged
# with ../shared/gpu/stage.sh). Each step is one device call of at most 10 minutes;
# results accumulate in $RES (kept while the machine is held) and go to $OUT as one
# archive, res-<step>-<model>.tgz.
# Every step resumes: configurations already in the result JSON are skipped.
#
#   bash scripts/h200_runs.sh longdoc llama-3.2-3b   # issue 3: 5 configs, conc 1, 1k-64k
#   bash scripts/h200_runs.sh gate    llama-3.2-3b   # issue 5: table from the run, gate on
#   bash scripts/h200_runs.sh preload llama-3.2-3b   # issue 4: queued disk hits, preload on/off
#   bash scripts/h200_runs.sh preload50 llama-3.2-3b # issue 4 as written: 50 clients (TOKENS=)
#   bash scripts/h200_runs.sh mixed   llama-3.2-3b   # issue 4: 50 x 64k, 50% reuse, conc 8
#   bash scripts/h200_runs.sh queue   llama-3.2-3b   # issue 5 item 4: queue-aware preload
#   bash scripts/h200_runs.sh tokcheck llama-3.2-3b  # CUDA token check, both KV layouts
#   bash scripts/h200_runs.sh trace   llama-3.2-3b   # what the reactor and engine did per TTFT
#   bash scripts/h200_runs.sh wbab    llama-3.2-3b   # issue 9: write-back deferred vs not (A/B)
#   bash scripts/h200_runs.sh dcab    llama-3.2-3b   # issue 9: DRAM-hit copy dma vs kernel (A/B)
#   bash scripts/h200_runs.sh scab    llama-3.2-3b   # issue 9: store copy dma vs kernel (A/B)
#   VARIANTS=... CONFIGS=... TOKENS=... bash scripts/h200_runs.sh vab llama-3.2-3b
#                                                    # any variants side by side (see the step)
#   bash scripts/h200_runs.sh sharegpt llama-3.2-3b  # issue 9 item 4: ShareGPT replay, 5 configs
#   bash scripts/h200_runs.sh scbench llama-3.2-3b   # issue 10 item 3: multi-turn shared contexts
#   WORKLOAD=.gpu/wl-longbench-docs.jsonl.gz bash scripts/h200_runs.sh replay llama-3.2-3b
#                                                    # issue 11: one workload, all configs
set -euo pipefail
STEP=${1:?step: longdoc|tokcheck|gate|preload|preload50|mixed|queue|trace|sharegpt|replay|scbench|wbab|dcab|scab|vab}
M=${2:?model: llama-3.2-3b|llama-3.1-8b}
RES=${RES:-/tmp/res}
ROOT=${ROOT:-/tmp/ldroot}
OUT=${OUT:-$RES/out}
mkdir -p "$RES" "$OUT"
# a previous call cut short may have left an engine holding GPU memory
bash scripts/h200_stop.sh
SITE=$(python3 -c 'import vllm,os;print(os.path.dirname(os.path.dirname(vllm.__file__)))')
python3 -m kvcache_core.cli patch-vllm --target "$SITE" >/dev/null
python3 -m kvcache_core.cli patch-vllm --target "$SITE" --check
# py-kvcache's vllm.general_plugins entry point, as `pip install` registers it (the runtime
# runs the repo from PYTHONPATH, which has no package metadata): the plugin then runs in
# every vLLM process here too, with its backport of vLLM's fix for the native tiered
# offload's KeyError under concurrency (kvcache_core/vllm/backports.py; the fifty-client
# and SCBench-like runs of native_fs died of it before the thirty-fourth session)
if [ -d /tmp/site ] && ! python3 -c 'import importlib.metadata as m, sys
sys.exit(0 if m.entry_points(group="vllm.general_plugins", name="py_kvcache") else 1)'; then
  DI=/tmp/site/py_kvcache-0.1.0.dist-info  # /tmp/site: on PYTHONPATH (/tmp/rt/env.sh)
  mkdir -p "$DI"
  printf 'Metadata-Version: 2.1\nName: py-kvcache\nVersion: 0.1.0\n' > "$DI/METADATA"
  printf '[vllm.general_plugins]\npy_kvcache = kvcache_core.vllm.plugin:register\n' \
    > "$DI/entry_points.txt"
fi
python3 -c 'from vllm.plugins import load_general_plugins as l; l()
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler as S
print("py-kvcache plugin: backport", "on" if getattr(S.request_finished, "_pykvcache_backport", False) else "OFF")'
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
# the card this call really got (the device tool lends an H100 or an H200): every
# result file names it, never a fixed "H200"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
MACHINE="${GPU:-unknown GPU} (GPU machine)"
# KVEXTRA="key=json key=json": extra py-kvcache config keys for every kvcache config of
# a longdoc-based step (e.g. KVEXTRA=eviction_policy=arc); SUFFIX names its result files
# apart (preload-run-$M$SUFFIX.json), so a variant runs beside the default in one call
B=(python3 -m kvcache_core.bench.longdoc --model "configs/models/$M" --root "$ROOT"
   --machine "$MACHINE" --append --resume --timeout 420)
KVX=()  # the same keys for the server-based steps (sharegpt, replay)
for kv in ${KVEXTRA:-}; do B+=(--kv-extra "$kv"); KVX+=(--kv-extra "$kv"); done
# VARIANTS="NAME=BASE:KEY=JSON ..." (steps preload, preload50, mixed, scbench): py-kvcache
# configurations with extra keys, each its own --variant (list NAME in CONFIGS)
VA=(); for v in ${VARIANTS:-}; do VA+=(--variant "$v"); done
if [ -n "${NOPROBE:-}" ]; then B+=(--no-probe); fi  # a later step of the same call
# TRACE=1: keep every engine's reactor event trace and request times under
# $RES/trace-$STEP[-$TOKENS]$SUFFIX (read them with `scripts/trace_report.py DIR --loads`: per load
# job, when its disk reads ran and how much they interleaved with other jobs')
# (preload50: one directory per TOKENS, so two sizes in one lease do not mix)
TDIR="$RES/trace-$STEP"; [ "$STEP" = preload50 ] && TDIR="$TDIR-${TOKENS:-40960}"
TDIR="$TDIR${SUFFIX:-}"
if [ -n "${TRACE:-}" ]; then mkdir -p "$TDIR"; B+=(--trace "$TDIR"); fi
# STORE_DRAIN=S: py-kvcache's store phase puts every stored block on disk (writeback_flush
# in that phase, then up to S seconds per storing request for the write-back to drain),
# so the load phase starts with the whole workload on disk as native_fs's does (without
# it, blocks past writeback_max_fraction keep no file and the load phase recomputes them)
if [ -n "${STORE_DRAIN:-}" ]; then B+=(--store-drain "$STORE_DRAIN"); fi
# SMALLDOCS=N: documents per engine at sizes below 16k (default 8; more of them narrow a
# per-engine median at 1k, where one request's spread is the size of the effect)
if [ -n "${SMALLDOCS:-}" ]; then B+=(--small-docs "$SMALLDOCS"); fi
# NOPRESPAWN=1: each engine process starts only when its turn comes (the harness before
# the twentieth session; use it if a run's log shows engines failing to start)
if [ -n "${NOPRESPAWN:-}" ]; then B+=(--no-prespawn); fi
# GATE=path: the break-even table of the *_gate configurations of a step that does not pass
# one itself (e.g. GATE=docs/results/h200/breakeven-$M.json CONFIGS=kvcache_disk_gate scbench)
if [ -n "${GATE:-}" ]; then B+=(--gate-table "$GATE"); fi
SFX=${SUFFIX:-}
# one longdoc run of --variant arms beside built-in configurations over rounds (dcab,
# scab, vab): variants_run TOKENS ROUNDS CONFIGS JSON [NAME=BASE:KEY=JSON ...]
variants_run() {
  local tok=$1 rounds=$2 configs=$3 json=$4 v
  shift 4
  local va=()
  for v in "$@"; do va+=(--variant "$v"); done
  "${B[@]}" --no-probe --tokens "$tok" --rounds "$rounds" ${va[@]+"${va[@]}"} \
    --configs "$configs" --json "$json" || true
}
case "$STEP" in
  longdoc)
    # ROUNDS (default 1): the configuration list that many times, order reversed every
    # other round; rows hold the medians over rounds
    "${B[@]}" --json "$RES/longdoc-$M.json" --rounds "${ROUNDS:-1}" \
      --configs "${CONFIGS:-recompute,kvcache_dram,native_cpu,kvcache_disk,native_fs}" ;;
  gate)
    "${B[@]}" --json "$RES/longdoc-$M.json" \
      --configs kvcache_dram_gate,kvcache_disk_gate,recompute_cold \
      --gate-table auto --gate-json "$RES/gate-$M.json" ;;
  preload)
    # 40k-token documents; the GPU KV cache capped at 4 such requests so the rest queue
    # (a loaded server); 2 docs x 6 hits + 25% requests with no reusable prefix, all 16
    # submitted at once.
    # CONFIGS narrows a call; VARIANTS as for preload50 (an A/B of a key in one call).
    "${B[@]}" --json "$RES/preload-run-$M$SFX.json" --tokens 40960 --docs 2 --repeats 6 \
      --fresh-frac 0.25 --concurrency 16 --gpu-blocks 10496 --workload mixed \
      --configs "${CONFIGS:-kvcache_nopreload,kvcache_preload,native_fs}" \
      --preload-json "$RES/preload-$M$SFX.json" "${VA[@]}" ;;
  preload50)
    # issue 4 item 5 as written: the long-document workload with 50 concurrent clients,
    # disk-only, preload on vs off vs native_fs; D from $TOKENS (one size per call fits
    # the 10-minute limit: 10240, 40960 or 65536). CONFIGS narrows a call further.
    # Documents: as many as the 64 GB disk holds (up to 8.6 GB each at 64k on the 8B),
    # repeated so that at least 50 requests are in flight at once. The engine's process
    # tree is sampled (--sample-interval) so every row, native_fs's too, has the bytes
    # its load phase read from storage (`tree read`; py-kvcache also counts its own).
    # VARIANTS="NAME=BASE:KEY=JSON ..." adds py-kvcache configurations with extra keys
    # (list NAME in CONFIGS), e.g. VARIANTS=kvcache_preload_join=kvcache_preload:join_promotions=true
    TOKENS=${TOKENS:-40960}
    if [ "$TOKENS" -gt 40960 ]; then DOCS=4; REP=13; else DOCS=8; REP=7; fi
    # ROUNDS=N: the configuration list N times, order reversed every other round, each
    # row the median over rounds (the disk's speed moves from call to call and within one)
    [ -n "${ROUNDS:-}" ] && VA+=(--rounds "$ROUNDS")
    "${B[@]}" --json "$RES/preload50-run-$M-$TOKENS$SFX.json" --tokens "$TOKENS" \
      --docs $DOCS --repeats $REP --concurrency 50 --workload longdoc --sample-interval 0.25 \
      --configs "${CONFIGS:-kvcache_nopreload,kvcache_preload,native_fs}" \
      --preload-json "$RES/preload-$M$SFX.json" "${VA[@]}" ;;
  mixed)
    # issue 4 item 5: 50 requests of 64k tokens, half reuse a cached prefix (5 docs x 5),
    # at most 8 in flight; CONFIGS and VARIANTS as for preload
    "${B[@]}" --json "$RES/mixed-run-$M$SFX.json" --tokens 65536 --docs 5 --repeats 5 \
      --fresh-frac 0.5 --concurrency 8 --workload mixed \
      --configs "${CONFIGS:-kvcache_nopreload,kvcache_preload,native_fs}" \
      --preload-json "$RES/preload-$M$SFX.json" "${VA[@]}" ;;
  queue)
    # issue 5 item 4: the preload workload with the disk tier gated (table of the gate
    # step, else the committed one): queue-aware preload on vs off, recompute beside
    T="$RES/breakeven-$M.json"; [ -f "$T" ] || T="docs/results/h200/breakeven-$M.json"
    "${B[@]}" --json "$RES/preload-run-$M.json" --tokens 40960 --docs 2 --repeats 6 \
      --fresh-frac 0.25 --concurrency 16 --gpu-blocks 10496 --workload mixed \
      --configs kvcache_disk_gate,kvcache_gate_queue,recompute_cold --gate-table "$T" \
      --preload-json "$RES/preload-$M.json" ;;
  wbab)
    # issue 9: does the background write-back cost the foreground? kvcache_dram with
    # write-back deferred behind foreground work (KVCACHE_WRITEBACK_DEFER_MS=$DEFER) vs
    # not, interleaved over $ROUNDS rounds in one call, recompute once for the ratios.
    # Results: $RES/wbab-<defer>-r<round>/longdoc-$M.json (one archive at the end).
    DEFER=${DEFER:-50}; ROUNDS=${ROUNDS:-3}
    RES_BASE="$RES"
    mkdir -p "$RES_BASE/wbab-recompute"
    "${B[@]}" --json "$RES_BASE/wbab-recompute/longdoc-$M.json" \
      --configs recompute --no-probe || true
    for r in $(seq 1 "$ROUNDS"); do
      for d in 0 "$DEFER"; do
        mkdir -p "$RES_BASE/wbab-$d-r$r"
        KVCACHE_WRITEBACK_DEFER_MS=$d "${B[@]}" --no-probe \
          --json "$RES_BASE/wbab-$d-r$r/longdoc-$M.json" --configs kvcache_dram || true
      done
    done ;;
  dcab|scab)
    # issue 9: how a DRAM hit (dcab: dram_load_copy) or a store (scab: store_copy) is
    # copied: one longdoc run of kvcache_dram variants kvcache_dram_<arm> (dcab) or
    # kvcache_dram_s<arm> (scab) (ARMS: the key's values; "native_cpu" and "recompute"
    # add those configurations as arms) over ROUNDS rounds, the order reversed every
    # other round, each engine spawned while the previous one runs (its imports overlap).
    # TOKENS narrows the sizes. Result: $RES/<step>-$M.json (rows: the medians over
    # rounds; round_results: every round's row; scab: compare the cold rows, and the
    # reactor's from_device_max_s / the worker's store_kernel_jobs in worker_stats).
    # Every kvcache arm spot-checks its DRAM-hit copies against the pool
    # (KVCACHE_VERIFY_DIRECT=1: counters direct_verified / direct_verify_failed).
    if [ "$STEP" = dcab ]; then KEY=dram_load_copy; PFX=kvcache_dram_
      DEF_ARMS="dma auto native_cpu"; DEF_TOK=4096,16384,65536
    else KEY=store_copy; PFX=kvcache_dram_s
      DEF_ARMS="dma auto native_cpu recompute"; DEF_TOK=1024,4096,16384,65536; fi
    ROUNDS=${ROUNDS:-3}; ARMS=${ARMS:-$DEF_ARMS}; TOK=${TOKENS:-$DEF_TOK}
    export KVCACHE_VERIFY_DIRECT=${KVCACHE_VERIFY_DIRECT-1}
    CF=(); VS=()
    for a in $ARMS; do
      case "$a" in native_cpu|recompute) CF+=("$a"); continue ;; esac
      CF+=("$PFX$a"); VS+=("$PFX$a=kvcache_dram:$KEY=\"$a\"")
    done
    variants_run "$TOK" "$ROUNDS" "$(IFS=,; echo "${CF[*]}")" "$RES/$STEP-$M.json" \
      ${VS[@]+"${VS[@]}"} ;;
  vab)
    # A/B of py-kvcache variants beside built-in configurations, one longdoc run over
    # ROUNDS rounds (default 3; order reversed every other round, engines spawned ahead):
    # VARIANTS="NAME=BASE:KEY=JSON[;KEY=JSON] ..." (each one --variant), CONFIGS the
    # whole list in run order (variant names and built-in configurations), TOKENS the
    # sizes. Result: $RES/vab-$NAME-$M.json (NAME default "ab"; rows: medians over the
    # rounds, round_results: every round's rows). E.g. what a 1k storing request pays for
    # (twenty-second session's plan): NAME=s1k TOKENS=1024,4096 ROUNDS=2
    # VARIANTS='kvcache_dram_nowb=kvcache_dram:disk_admission="reuse"
    # kvcache_dram_defer=kvcache_dram:writeback_defer_s=0.05
    # kvcache_dram_si0=kvcache_dram:switch_interval_s=0
    # kvcache_dram_block=kvcache_dram:store_copy_wait="block"' CONFIGS=recompute,
    # kvcache_dram,kvcache_dram_nowb,kvcache_dram_defer,kvcache_dram_si0,kvcache_dram_block
    # shellcheck disable=SC2086  # one variant per word
    variants_run "${TOKENS:?TOKENS=sizes}" "${ROUNDS:-3}" "${CONFIGS:?CONFIGS=list}" \
      "$RES/vab-${NAME:-ab}-$M.json" ${VARIANTS:-} ;;
  tokcheck)
    # identical tokens on CUDA: py-kvcache DRAM and disk hits of both gpu_kv_layout values
    # against recompute, the e2e tests' tiny Llama with real random weights
    # (scripts/gpu_token_check.py; the model argument is not used)
    python3 scripts/gpu_token_check.py --json "$RES/tokcheck.json" > "$RES/tokcheck.txt" 2>&1
    tail -3 "$RES/tokcheck.txt" ;;
  trace)
    # diagnostics: per request, the reactor's events and the engine's steps (host time
    # launching each forward) inside its TTFT window; TOKENS and CONFIGS narrow a call.
    # DEFER (ms, optional): one more kvcache_dram engine with the write-back deferred
    # behind foreground work, traced separately (trace-defer-$M).
    "${B[@]}" --json "$RES/trace-run-$M.json" --tokens "${TOKENS:-4096,16384,65536}" \
      --configs "${CONFIGS:-recompute,kvcache_dram,kvcache_disk}" --trace "$RES/trace-$M" || true
    python3 scripts/trace_report.py "$RES/trace-$M" --json "$RES/trace-report-$M.json" \
      > "$RES/trace-report-$M.txt" || true
    if [ -n "${DEFER:-}" ]; then
      KVCACHE_WRITEBACK_DEFER_MS=$DEFER "${B[@]}" --no-probe \
        --json "$RES/trace-defer-run-$M.json" --tokens "${TOKENS:-4096,16384,65536}" \
        --configs kvcache_dram --trace "$RES/trace-defer-$M" || true
      python3 scripts/trace_report.py "$RES/trace-defer-$M" \
        --json "$RES/trace-defer-report-$M.json" > "$RES/trace-defer-report-$M.txt" || true
    fi ;;
  sharegpt)
    # issue 9 item 4: real ShareGPT chat traffic (history up to each turn) at 32 req/s,
    # Poisson, through vLLM's OpenAI server, GPU prefix cache on in all 5 configs. The
    # workload is prepared on the CPU machine (python -m kvcache_core.bench.sharegpt
    # prepare) and carried as .gpu/sharegpt-llama3.jsonl.gz. 5 x (server start 30-80 s +
    # 2,000 requests ~70 s) may not fit one call: no config starts after BUDGET seconds
    # (if the longest so far would not fit), and the next call resumes with the rest.
    # N, RATE, CONFIGS, TIMEOUT (per config), BUDGET and ROUNDS (interleaved rounds of the
    # configurations) narrow a call. kvcache_dram_gate = kvcache_dram + this node's
    # break-even table (docs/results/h200/breakeven-$M.json): the operator's configuration.
    # vLLM's OpenAI server needs two wheels the runtime lacks: carry them in .gpu/extra/
    # (pip download jmespath==1.0.1 model-hosting-container-standards==0.1.16) or build
    # the runtime with EXTRA_WHEELS naming them
    if ls .gpu/extra/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .gpu/extra/*.whl
    fi
    # PARALLEL=1: every configuration's server up at once (each with KVMEM bytes of GPU
    # KV cache and GMU of --gpu-memory-utilization), rounds interleaved across them, round
    # r replaying requests r*N.. of WORKLOAD (.gpu/sharegpt-llama3-6k.jsonl.gz holds 3 x
    # 2,000). PROFILE=cfg,cfg runs those servers under py-spy (wheel in .gpu/extra;
    # PROFILE_IDLE=1 also samples waiting threads); summaries in $RES/pyspy-<cfg>.txt.
    PAR=()
    if [ -n "${PARALLEL:-}" ]; then
      PAR=(--parallel --kv-cache-memory-bytes "${KVMEM:-34359738368}"
           --gpu-memory-utilization "${GMU:-0.3}")
    fi
    if [ -n "${PROFILE:-}" ]; then
      PYSPY=$(bash scripts/pyspy_bin.sh)  # from its wheel in .gpu/extra
      PAR+=(--profile "$PROFILE" --py-spy "$PYSPY" --profile-rate 100)
      if [ -n "${PROFILE_IDLE:-}" ]; then PAR+=(--profile-idle); fi
    fi
    python3 -m kvcache_core.bench.sharegpt run --model "configs/models/$M" \
      --workload "${WORKLOAD:-.gpu/sharegpt-llama3.jsonl.gz}" --root "$ROOT" \
      --json "$RES/sharegpt-$M.json" --machine "$MACHINE" --resume \
      --n "${N:-2000}" --rate "${RATE:-32}" --timeout "${TIMEOUT:-240}" \
      --budget "${BUDGET:-420}" --rounds "${ROUNDS:-1}" --quiesce "${QUIESCE:-15}" \
      "${PAR[@]}" "${KVX[@]}" \
      --configs "${CONFIGS:-prefix_cache,kvcache_dram,native_cpu,kvcache_disk,native_fs}" \
      || true
    for f in "$ROOT"/work/*.pyspy.txt; do
      [ -f "$f" ] || continue
      c=$(basename "$f" .pyspy.txt)
      python3 scripts/pyspy_report.py --rate 100 "$f" --json "$RES/pyspy-$c.json" \
        > "$RES/pyspy-$c.txt" 2>&1 || true
      python3 scripts/pyspy_report.py --rate 100 --only-stack busy_loop "$f" \
        > "$RES/pyspy-$c-busy.txt" 2>&1 || true
      gzip -c "$f" > "$RES/pyspy-$c.raw.gz" || true
    done
    cp "$ROOT"/work/*.log "$RES/" 2>/dev/null || true ;;
  replay)
    # issue 11: one workload file (any `kvcache workload ... --token-ids` file, made on
    # the CPU machine and carried), every configuration's server up at once, ROUNDS
    # interleaved rounds over disjoint slices of N requests (N=0: the whole file, one
    # round), Poisson arrivals at RATE req/s. Results: $RES/replay-<workload>-$M.json.
    # Workloads of the issue (CPU machine, then carry .gpu/wl-*.jsonl.gz):
    #   kvcache workload longbench --type docs --chains 8 --steps 4 --doc-tokens 8192 \
    #     --token-ids --out .gpu/wl-longbench-docs.jsonl.gz
    #   kvcache workload longbench --type code --chains 8 --steps 4 --doc-tokens 8192 \
    #     --token-ids --out .gpu/wl-longbench-code.jsonl.gz
    #   kvcache workload scbench --contexts 8 --context-tokens 16384 --rounds 4 \
    #     --token-ids --vocab-size 128000 --out .gpu/wl-scbench.jsonl.gz
    #   kvcache workload bailian --synthetic coder --n 2000 --vocab-size 128000 \
    #     --max-prompt-tokens 32768 --out .gpu/wl-bailian-coder.jsonl.gz
    # CONFIGS default: prefix_cache,native_cpu,native_fs,kvcache (+ lmcache once its
    # wheels are in the runtime: EXTRA_WHEELS of make-runtime.sh).
    WL=${WORKLOAD:?WORKLOAD=path of a workload file}
    WN=$(basename "$WL"); WN=${WN%%.jsonl*}; WN=${WN#wl-}
    if ls .gpu/extra/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .gpu/extra/*.whl
    fi
    # VARIANTS="NAME=BASE:KEY=JSON[;KEY=JSON] ...": py-kvcache configurations with extra
    # keys beside the others (list NAME in CONFIGS), e.g.
    # VARIANTS=kvcache_admit=kvcache:eviction_policy=lru-admit. PROFILE=cfg,cfg (and
    # PROFILE_IDLE=1) as in the sharegpt step: py-spy summaries in $RES/pyspy-<cfg>.txt.
    # QUIESCE (default 15): seconds each round may wait for every server to be idle (what
    # the previous configuration still writes back); the serving order changes per round.
    # Rounds of several calls of one workload combine with `python -m
    # kvcache_core.bench.sharegpt merge A.json B.json --json OUT.json`.
    VAR=()
    for v in ${VARIANTS:-}; do VAR+=(--variant "$v"); done
    if [ -n "${PROFILE:-}" ]; then
      PYSPY=$(bash scripts/pyspy_bin.sh)
      VAR+=(--profile "$PROFILE" --py-spy "$PYSPY" --profile-rate 100)
      if [ -n "${PROFILE_IDLE:-}" ]; then VAR+=(--profile-idle); fi
    fi
    python3 -m kvcache_core.bench.sharegpt run --model "configs/models/$M" \
      --workload "$WL" --root "$ROOT" --json "$RES/replay-$WN$SFX-$M.json" "${VAR[@]}" \
      --machine "$MACHINE" --n "${N:-0}" --rate "${RATE:-2}" \
      --rounds "${ROUNDS:-1}" --timeout "${TIMEOUT:-300}" --budget "${BUDGET:-0}" \
      --quiesce "${QUIESCE:-15}" \
      --parallel "${KVX[@]}" \
      --kv-cache-memory-bytes "${KVMEM:-21474836480}" --gpu-memory-utilization "${GMU:-0.2}" \
      --configs "${CONFIGS:-prefix_cache,native_cpu,native_fs,kvcache}" || true
    for f in "$ROOT"/work/*.pyspy.txt; do
      [ -f "$f" ] || continue
      c=$(basename "$f" .pyspy.txt)
      python3 scripts/pyspy_report.py --rate 100 "$f" --json "$RES/pyspy-$c.json" \
        > "$RES/pyspy-$c.txt" 2>&1 || true
    done
    cp "$ROOT"/work/*.log "$RES/" 2>/dev/null || true ;;
  scbench)
    # issue 10 item 3: SCBench-like multi-turn: 4 shared contexts of $TOKENS tokens visited
    # round-robin for 6 rounds (24 turns, round 0 stores), 4 turns in flight, the GPU KV
    # cache capped at about 2 contexts (16-token GPU blocks), the same DRAM/CPU tier of 1.3
    # contexts for all three configs: working set 4 contexts (15 GB at 32k on the 3B), so
    # the tier thrashes. One engine process per config runs all rounds while the driver
    # samples host memory and disk bytes read of its process tree every 0.25 s.
    # Estimate per config on the 3B at 32k: start 25-65 s, 4 cold turns + 15 GB of stores
    # ~5-10 s, 20 reuse turns of 3.8 GB each from a 2.4 GB/s disk <= ~45 s, shutdown ~10 s:
    # <= ~130 s; TIMEOUT (per config, default 170 s) keeps 3 configs + the bandwidth probe
    # under 600 s. A config cut off by TIMEOUT is recorded as failed; --resume runs only the
    # missing ones in a later call. CONFIGS, TOKENS, ROUNDS, TIMEOUT narrow a call.
    TOKENS=${TOKENS:-32768}
    GB=$(( (2 * (TOKENS + 64) + 15) / 16 + 96 ))
    # KVEXTRA=writeback_flush=true SUFFIX=-flush: py-kvcache with the deferred write-back
    # of blocks kept in DRAM while the write-back was full (the A/B of that key);
    # VARIANTS= as for the preload step (a key against the defaults in one call).
    "${B[@]}" --json "$RES/scbench-run-$M$SFX.json" --workload scbench --tokens "$TOKENS" \
      --docs 4 --repeats "${ROUNDS:-6}" --concurrency 4 --gpu-blocks "$GB" \
      --timeout "${TIMEOUT:-170}" \
      --configs "${CONFIGS:-kvcache_nopreload,kvcache_preload,native_fs}" \
      --preload-json "$RES/preload-$M$SFX.json" "${VA[@]}" ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
# one archive: the device tool brings back only a few files per call
tar czf "$OUT/res-$STEP-$M.tgz" -C "$RES" --exclude=./out . || true
