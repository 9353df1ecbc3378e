#!/bin/bash
# `paged-backend bench peer` (our kernels beside vLLM's, on a CUDA GPU) with vLLM importable.
#
# vLLM comes from one of:
#   - the environment itself: pip install vllm==0.26.* (built for torch 2.11 / cu130);
#   - a tarball of unpacked wheels (a site-packages tree with vllm/ at its top), given as
#     $VLLM_BUNDLE or as the first argument (a path ending in .tar, .tar.gz, .tgz or .tar.xz):
#     it is unpacked once into $VLLM_SITE (default: ${TMPDIR:-/tmp}/vllm-site) and put on PYTHONPATH.
#
# Usage, from anywhere with paged_backend importable (installed, or on PYTHONPATH):
#     bash scripts/bench_peer.sh [VLLM_TARBALL] [--only decode prefill int4] [bench peer options]
set -euo pipefail
BUNDLE=${VLLM_BUNDLE:-}
case "${1:-}" in
  *.tar | *.tar.gz | *.tgz | *.tar.xz) BUNDLE=$1; shift ;;
esac
if [ -n "$BUNDLE" ]; then
  SITE=${VLLM_SITE:-${TMPDIR:-/tmp}/vllm-site}
  if [ ! -f "$SITE/vllm/__init__.py" ]; then
    mkdir -p "$SITE"
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" \
      "$(realpath "$BUNDLE")" "$SITE"
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
fi
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
cd "${TMPDIR:-/tmp}"  # not the checkout: its paged_backend/ folder would shadow the installed package
exec python3 -m paged_backend.benchmarks.peer "$@"
