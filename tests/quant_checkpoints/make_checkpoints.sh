#!/usr/bin/env bash
# Regenerates tests/quant_checkpoints/* with the reference tools, each in its own venv outside
# the repo (the test venv needs none of them). CPU only; about 10 minutes on 2 cores.
#   /tmp/quantvenv     torch 2.13, transformers 5.24, GPTQModel 7.6.0, AutoAWQ 0.2.9 (--no-deps)
#   /tmp/quantvenv_ct  torch 2.13, llm-compressor 0.14.0.1 (it pins transformers <= 5.17)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
QV="${QUANTVENV:-/tmp/quantvenv}"
CV="${QUANTVENV_CT:-/tmp/quantvenv_ct}"

if [ ! -x "$QV/bin/python" ]; then
  "$PY" -m venv "$QV"
  "$QV/bin/pip" install torch==2.13.0 transformers==5.24.0 safetensors accelerate numpy datasets zstandard
  "$QV/bin/pip" install --no-deps --no-build-isolation autoawq==0.2.9
  GPTQMODEL_CPU_WORKERS=2 BUILD_CUDA_EXT=0 "$QV/bin/pip" install gptqmodel==7.6.0
fi
if [ ! -x "$CV/bin/python" ]; then
  "$PY" -m venv "$CV"
  "$CV/bin/pip" install torch==2.13.0 llmcompressor==0.14.0.1 tokenizers
fi

cd "$HERE"
"$QV/bin/python" make_checkpoints.py base           # seeded tiny Llama + tokenizer -> base/ (not committed)
GPTQMODEL_CPU_WORKERS=2 "$QV/bin/python" make_checkpoints.py gptq
"$QV/bin/python" make_checkpoints.py awq
"$CV/bin/python" make_checkpoints.py ct
rm -rf base logs */quant_log.csv
du -sh ./*/
