#!/usr/bin/env bash
# Set everything up and run the quickstart training (SmolLM2-135M-Instruct on BabyAI, the four
# ScalingInter-RL stages of configs/quickstart.yaml: horizons 2, 3, 4, 5, 6 iterations each) on
# the embedded defaults: a temporary local Prefect server, MLflow in ./mlflow.db, trajectories in
# ./trajectories.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/agentgym models prepare smollm2 >/dev/null
exec .venv/bin/agentgym train --config configs/quickstart.yaml "$@"
