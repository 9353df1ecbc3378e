#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check paged_backend adapters bentos tests
set +e
.venv/bin/pytest -q --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
