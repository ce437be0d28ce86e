#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Extra arguments go to pytest.
# LONGHORIZON_TEST_WORKERS: pytest-xdist worker processes (default 2; 0 runs in this process). Two workers on a
# 2-core machine take the suite from ~28 to ~16 minutes: much of it waits on engine and Ray start-ups.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ruff check --quiet .
exec python -m pytest -q -n "${LONGHORIZON_TEST_WORKERS:-2}" "$@"
