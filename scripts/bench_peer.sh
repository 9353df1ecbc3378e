#!/bin/bash
# `paged-backend bench peer` on the GPU machine, with vLLM from the peer bundle on the path.
# The bundle (vLLM 0.26 for torch 2.11 / cu130) is built on the CPU machine by
# ../shared/peers/vllm/make_bundle.sh into .peer/parts/vllm_bundle.tar.xz; carry .peer/parts.
# Usage, from the repo root with paged_backend importable (installed, or on PYTHONPATH):
#     bash scripts/bench_peer.sh [--only decode prefill int4] [bench peer options]
set -euo pipefail
BUNDLE=$(realpath "${BUNDLE:-.peer/parts/vllm_bundle.tar.xz}")
SITE=${PEER_SITE:-/tmp/site}
if [ ! -f "$SITE/vllm/__init__.py" ]; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='fully_trusted')" \
    "$BUNDLE" "$SITE"
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
cd "${TMPDIR:-/tmp}"  # not the checkout: its paged_backend/ folder would shadow the installed package
exec python3 -m paged_backend.benchmarks.peer "$@"
