#!/usr/bin/env bash
# The quickstart: start a local Ray cluster on loopback, `ray job submit` the quickstart experiment
# (SFT warm start of the tiny hybrid model, then GRPO on the multi-turn Calculator env), stop the
# cluster. Extra arguments are config overrides, e.g. `scripts/quickstart.sh curriculum.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# the cluster listens on loopback only; Ray 2.5x's token auth would make `ray job submit` need a token
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
RAY_TMP="$(mktemp -d /tmp/lh_ray.XXXXXX)"
PORT="${LH_DASHBOARD_PORT:-8265}"
GCS_PORT="${LH_GCS_PORT:-6390}"
cleanup() { ray stop >/dev/null 2>&1 || true; rm -rf "$RAY_TMP"; }
trap cleanup EXIT
# the job runs in the directory `ray start` ran in: the repo root (it has no ./ray folder to shadow ray)
ray start --head --port="$GCS_PORT" --num-cpus=2 --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
    --dashboard-port="$PORT" --temp-dir="$RAY_TMP" --disable-usage-stats \
    --object-store-memory=1000000000 >/dev/null
# no --working-dir: the job runs here, in the checkout (outputs land in ./runs/quickstart)
ray job submit --address "http://127.0.0.1:$PORT" -- \
    python -m rl.train --config configs/exp/quickstart.yaml "$@"
