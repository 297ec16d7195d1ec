#!/usr/bin/env bash
# The wheels bench/gpu_throughput.py needs on a GPU machine without network whose image has
# torch (CUDA) but not this project's other needs: deepspeed, pydantic (+ its core and types),
# hjson, and transformers at this venv's version (with regex, which its import checks).
# --trl adds TRL (the version bench/update_throughput.py pins) and its datasets, dill, multiprocess.
# Written for Python 3.12 on x86-64 (the device tool's image); ~19 MB, ~21 MB with --trl.
#
#   bash bench/gpu_wheels.sh [--trl] [DIR]      # DIR: .whl/gpu_throughput (under the git-ignored .whl/)
#
# Then, on the device (bench/README.md, section 12):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TRL=0
if [[ "${1:-}" == "--trl" ]]; then TRL=1; shift; fi
DIR="${1:-.whl/gpu_throughput}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$DIR"

# this venv's versions: the device runs the code with the libraries it was tested with here
ver() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }
PKGS=(
  "transformers==$(ver transformers)" "regex==$(ver regex)"
  "pydantic==$(ver pydantic)" "pydantic_core==$(ver pydantic_core)" "annotated-types==$(ver annotated-types)"
  "typing-inspection==$(ver typing-inspection)" "typing_extensions==$(ver typing_extensions)"
  "hjson==$(ver hjson)"
)
if [[ "$TRL" == 1 ]]; then
  PKGS+=("trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19")
fi
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$DIR" "${PKGS[@]}"
# DeepSpeed is published as a source archive only: build its (pure Python) wheel here
if ! compgen -G "$DIR/deepspeed-*.whl" >/dev/null; then
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==$(ver deepspeed)"
fi
ls -1 "$DIR"
du -sh "$DIR"
