#!/usr/bin/env bash
# Re-run the CPU benchmarks whose figures in bench/README.md come from this script's records
# (issue 44 item 4), one at a time, each writing bench/results/<bench>-<TAG>-<variant>.json.
#
#   bash bench/record_all.sh TAG            # e.g. TAG=idle-2026-12-08; on an idle machine
#   bash bench/record_all.sh TAG --list     # what would run, and which records exist already
#   bash bench/record_all.sh TAG --only rollout_efficiency,store_throughput
#
# Resumable: a benchmark whose record exists is skipped, so re-running after an interruption
# goes on with the next one. Each runs at nice 0 alone: do not start other heavy work beside it
# (on 2 cores a second job distorts timings 2-4x; each record keeps the load average it saw).
# Logs: bench/results/logs/ (git-ignored). Commit the records with the figures they back.
# The TRL race (bench/time_to_success.py, hours) and the vLLM and GPU benchmarks are not here:
# their commands are in bench/README.md.
set -u
cd "$(dirname "$0")/.."
TAG="${1:?usage: bash bench/record_all.sh TAG [--list] [--only a,b]}"
shift
MODE=run ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --list) MODE=list ;;
    --only) ONLY="${2:?--only needs a comma-separated list of names}"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run bash scripts/setup.sh first" >&2; exit 2; }
mkdir -p bench/results/logs

# name (the record is bench/results/<name>-<TAG>.json) | script and arguments (the README's command)
JOBS=(
  "rollout_efficiency|bench/rollout_efficiency.py"
  "env_concurrency|bench/env_concurrency.py"
  "pipeline_overhead|bench/pipeline_overhead.py"
  "pipeline_overhead:smollm2|bench/pipeline_overhead.py --model smollm2"
  "pipeline_overhead:textcraft-h20|bench/pipeline_overhead.py --model smollm2 --config configs/ablation/textcraft.yaml --horizons 20 --iterations 3"
  "store_throughput|bench/store_throughput.py"
  "rollout_memory|bench/rollout_memory.py"
  "scaling_curves|bench/scaling_curves.py"
  "learning_test_spread|bench/learning_test_spread.py --seeds 12"
  "async_overlap|bench/async_overlap.py --latencies 0 300 --iterations 5 --horizon 4"
  "roofline:1t|bench/roofline.py --threads 1"
  "kv_cache_decode|bench/kv_cache_decode.py"
)

failed=0
for job in "${JOBS[@]}"; do
  key="${job%%|*}" cmd="${job#*|}"
  bench="${key%%:*}" variant=""
  [ "$key" != "$bench" ] && variant="-${key#*:}"
  tag="$TAG$variant"
  record="bench/results/$bench-$tag.json"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$bench,"* && ",$ONLY," != *",$key,"* ]]; then continue; fi
  if [ -f "$record" ]; then echo "have  $record"; continue; fi
  if [ "$MODE" = list ]; then echo "to do $record  <- $PY $cmd --tag $tag"; continue; fi
  log="bench/results/logs/$bench-$tag.log"
  echo "$(date -u +%H:%M:%S) run   $record  (log: $log)"
  if ! $PY $cmd --tag "$tag" >"$log" 2>&1; then
    echo "FAILED $bench (exit $?): see $log" >&2
    failed=$((failed + 1))
  elif [ ! -f "$record" ]; then
    echo "FAILED $bench: it ran, but wrote no $record (see $log)" >&2
    failed=$((failed + 1))
  fi
done
[ "$MODE" = list ] || echo "done: $failed failed; commit the new records: git add bench/results/*-$TAG*.json"
exit $((failed > 0))
