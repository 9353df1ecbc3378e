#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check paged_backend adapters bentos tests
# CPU matmuls round by how their work is split over threads: no thread count that follows the machine's load
# (fp32 results compared across engines are then equal bit for bit)
export MKL_DYNAMIC=FALSE OMP_DYNAMIC=FALSE
set +e
.venv/bin/pytest -q --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
