#!/usr/bin/env bash
# The quickstart: start a local Ray cluster on loopback, `ray job submit` the quickstart experiment
# (SFT warm start of the tiny hybrid model, then GRPO on the multi-turn Calculator env), stop the
# cluster. Extra arguments are config overrides, e.g. `scripts/quickstart.sh curriculum.steps=5`.
# The cluster is this script's own (scripts/ray_local.sh: its own temp dir, free ports, or
# LH_GCS_PORT / LH_DASHBOARD_PORT): other Ray clusters of the machine are left running, and only
# this one is stopped at the end, however the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/ray_local.sh
trap ray_local_stop EXIT
trap 'exit 130' INT TERM  # through the EXIT trap: the cluster is stopped on Ctrl-C too
# the job runs in the directory `ray start` ran in: the repo root (it has no ./ray folder to shadow ray)
ray_local_start --num-cpus=2 --object-store-memory=1000000000
# no --working-dir: the job runs here, in the checkout (outputs land in ./runs/quickstart)
ray job submit --address "$RAY_LOCAL_DASHBOARD" -- \
    python -m rl.train --config configs/exp/quickstart.yaml "$@"
