#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ruff check --quiet .
exec python -m pytest -q "$@"
