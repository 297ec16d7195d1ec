#!/usr/bin/env bash
# A local Prefect server and a `process` worker for the AgentGym-RL deployments, on 127.0.0.1.
#
#   deployments/local.sh start    # server on 127.0.0.1:4200 (+ UI), work pool agentgym-local, one worker
#   deployments/local.sh deploy   # configs/*.yaml -> Prefect variables; prefect deploy of every deployment on
#                                 # the agentgym-local pool in deployments/prefect.yaml (not babyai-docker)
#   deployments/local.sh names    # the deployments `deploy` creates
#   deployments/local.sh status   # server / worker / deployments
#   deployments/local.sh stop     # stop the worker and the server (their process groups)
#   deployments/local.sh env      # print `export PREFECT_API_URL=...` (eval "$(deployments/local.sh env)")
#
# Then, e.g.:
#   prefect deployment run 'scaling-inter-rl/quickstart' --param overrides='["rollout.group_size=8"]'
#
# Every command is idempotent (start twice = one server, one worker). State, logs and pids live in
# $AGENTGYM_STATE_DIR (default <repo>/.agentgym): server.log, worker.log, *.pid, prefect-server.db.
# `start` also makes a Prefect profile `agentgym-local` (PREFECT_API_URL = this server) the active
# one, so a plain `prefect ...` in any shell talks to it; `stop` restores the previous profile
# (AGENTGYM_SET_PROFILE=0 leaves profiles alone: then use `eval "$(deployments/local.sh env)"`).
#
# Settings (environment): AGENTGYM_PREFECT_PORT (4200), AGENTGYM_WORK_POOL (agentgym-local),
# AGENTGYM_STATE_DIR, AGENTGYM_PREFECT_FILE (deployments/prefect.yaml), AGENTGYM_CONFIG_DIR
# (configs), AGENTGYM_START_TIMEOUT (180 s), PREFECT_WORKER_QUERY_SECONDS (5).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${AGENTGYM_STATE_DIR:-$ROOT/.agentgym}"
HOST=127.0.0.1
PORT="${AGENTGYM_PREFECT_PORT:-4200}"
POOL="${AGENTGYM_WORK_POOL:-agentgym-local}"
PREFECT_FILE="${AGENTGYM_PREFECT_FILE:-$ROOT/deployments/prefect.yaml}"
TIMEOUT="${AGENTGYM_START_TIMEOUT:-180}"
PROFILE=agentgym-local
API="http://$HOST:$PORT/api"
if [ -x "$ROOT/.venv/bin/prefect" ]; then
  PREFECT="$ROOT/.venv/bin/prefect"; PY="$ROOT/.venv/bin/python"
else
  PREFECT="$(command -v prefect)"; PY="$(command -v python3)"
fi

export PREFECT_API_URL="$API"
export AGENTGYM_ROOT="$ROOT"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-5}"
export PREFECT_CLI_COLORS="${PREFECT_CLI_COLORS:-false}"

say() { echo "local.sh: $*"; }
die() { echo "local.sh: $*" >&2; exit 1; }

alive() {  # alive <pidfile>: the process in the pid file runs
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

healthy() {
  curl -fsS --max-time 3 "$API/health" >/dev/null 2>&1
}

wait_for() {  # wait_for <seconds> <command...>
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

descendants() {  # descendants <pid>: every process below <pid> (flow runs, their children)
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

signal_all() {  # signal_all <SIG> <pid...>: each pid's own process group if it leads one, else the pid
  local sig="$1" p; shift
  for p in "$@"; do
    if [ "$(ps -o pgid= -p "$p" 2>/dev/null | tr -d ' ')" = "$p" ]; then
      kill "-$sig" -- "-$p" 2>/dev/null || true
    else
      kill "-$sig" "$p" 2>/dev/null || true
    fi
  done
}

stop_group() {  # stop_group <pidfile> <name>: TERM the process and everything it started, KILL after 15 s
  local f="$1" pid p left
  if ! alive "$f"; then rm -f "$f"; return 0; fi
  pid="$(cat "$f")"
  # flow runs may run in their own sessions: collect them before their parent exits
  local procs=("$pid" $(descendants "$pid"))
  signal_all TERM "${procs[@]}"
  for _ in $(seq 1 30); do
    left=0
    for p in "${procs[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.5
  done
  [ "$left" = 0 ] || signal_all KILL "${procs[@]}"
  rm -f "$f"
  say "stopped $2 (pid $pid)"
}

worker_online() {  # a worker of the pool has sent a heartbeat
  curl -fsS --max-time 3 -X POST -H 'Content-Type: application/json' -d '{}' \
    "$API/work_pools/$POOL/workers/filter" 2>/dev/null | grep -q '"status":"ONLINE"'
}

profile() {  # profile on|off: make agentgym-local the active Prefect profile / restore the previous
  [ "${AGENTGYM_SET_PROFILE:-1}" = 1 ] || return 0
  "$PY" - "$1" "$PROFILE" "$API" "$STATE/previous_profile" <<'PY'
import sys
from pathlib import Path

from prefect.settings import PREFECT_API_URL, load_profiles, save_profiles

action, name, api, saved = sys.argv[1:]
profiles = load_profiles()
saved = Path(saved)
if action == "on":
    if profiles.active_name != name:
        saved.write_text(profiles.active_name or "")
    profiles.update_profile(name, {PREFECT_API_URL: api})  # adds it, or merges into it
    profiles.set_active(name)
    save_profiles(profiles)
    print(f"local.sh: Prefect profile {name!r} is active (PREFECT_API_URL={api})")
elif profiles.active_name == name:
    prev = saved.read_text().strip() if saved.exists() else ""
    prev = prev if prev in profiles.names else ("ephemeral" if "ephemeral" in profiles.names else None)
    if prev:
        profiles.set_active(prev)
        save_profiles(profiles)
        print(f"local.sh: Prefect profile {prev!r} is active again")
    saved.unlink(missing_ok=True)
PY
}

start_server() {
  if healthy; then
    say "server already running at $API"
    return 0
  fi
  if alive "$STATE/server.pid"; then  # started but not answering yet
    wait_for "$TIMEOUT" healthy || die "server (pid $(cat "$STATE/server.pid")) does not answer; see $STATE/server.log"
    say "server running at $API"
    return 0
  fi
  if (exec 3<>"/dev/tcp/$HOST/$PORT") 2>/dev/null; then
    die "port $PORT is taken by another program; set AGENTGYM_PREFECT_PORT"
  fi
  local t0=$SECONDS
  PREFECT_SERVER_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STATE/prefect-server.db" \
  PREFECT_UI_API_URL="$API" \
    setsid "$PREFECT" server start --host "$HOST" --port "$PORT" \
    >"$STATE/server.log" 2>&1 </dev/null &
  echo $! >"$STATE/server.pid"
  if ! wait_for "$TIMEOUT" healthy; then
    tail -n 20 "$STATE/server.log" >&2 || true
    stop_group "$STATE/server.pid" server
    die "server did not answer within $TIMEOUT s; see $STATE/server.log"
  fi
  say "server up at $API in $((SECONDS - t0)) s (UI http://$HOST:$PORT, log $STATE/server.log)"
}

start_worker() {
  if ! "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1; then
    "$PREFECT" work-pool create "$POOL" --type process >/dev/null
    say "work pool $POOL (process) created"
  fi
  if alive "$STATE/worker.pid"; then
    say "worker already running (pid $(cat "$STATE/worker.pid"))"
    return 0
  fi
  (cd "$ROOT" && exec setsid "$PREFECT" worker start --pool "$POOL" --type process \
      --name "agentgym-local-$PORT" >"$STATE/worker.log" 2>&1 </dev/null) &
  echo $! >"$STATE/worker.pid"
  if ! wait_for 60 worker_online; then
    tail -n 20 "$STATE/worker.log" >&2 || true
    die "worker did not come online; see $STATE/worker.log"
  fi
  say "worker online on pool $POOL (pid $(cat "$STATE/worker.pid"), log $STATE/worker.log)"
}

cmd_start() {
  mkdir -p "$STATE"
  start_server
  start_worker
  profile on
}

cmd_stop() {
  mkdir -p "$STATE"
  stop_group "$STATE/worker.pid" worker
  stop_group "$STATE/server.pid" server
  profile off
}

cmd_status() {
  local rc=0
  if healthy; then say "server: up at $API (pid $(cat "$STATE/server.pid" 2>/dev/null || echo '?'))"
  else say "server: down"; rc=1; fi
  if alive "$STATE/worker.pid"; then say "worker: running (pid $(cat "$STATE/worker.pid")), pool $POOL"
  else say "worker: down"; rc=1; fi
  if [ $rc = 0 ]; then "$PREFECT" deployment ls 2>/dev/null || true; fi
  return $rc
}

# The deployments on the agentgym-local pool (the one this script serves); the docker pool's
# deployment needs Docker, an image registry and S3 (docs/scale-out.md), so --all would fail here.
local_names() {
  "$PY" -c 'import sys, yaml
for d in yaml.safe_load(open(sys.argv[1]))["deployments"]:
    if d["work_pool"]["name"] == "agentgym-local":
        print(d["name"])' "$PREFECT_FILE"
}

cmd_deploy() {
  healthy || die "no Prefect server at $API; run: deployments/local.sh start"
  "$PY" "$ROOT/deployments/sync_variables.py" --prefect-file "$PREFECT_FILE"
  local what=() name
  for name in $(local_names); do what+=(--name "$name"); done
  [ $# -gt 0 ] && what=("$@")
  (cd "$ROOT" && "$PREFECT" --no-prompt deploy "${what[@]}" --prefect-file "$PREFECT_FILE")
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  deploy) shift; cmd_deploy "$@" ;;
  names) local_names ;;
  env) echo "export PREFECT_API_URL=$API" ;;
  *) echo "usage: $0 start|stop|status|deploy [--name flow/deployment ...]|names|env" >&2; exit 2 ;;
esac
