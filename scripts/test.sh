#!/usr/bin/env bash
# Set everything up and run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -q -ra --timeout=900 "$@"
