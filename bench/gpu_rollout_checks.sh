#!/usr/bin/env bash
# Issue 13's open GPU checks in one device call on one H200, each phase under its own time budget:
#   1. bench/rollout_gpu.py --parts mla@$MLA_S,reuse (one process, one gpu_1b checkpoint):
#      mla    latent vs expanded MLA cache form in fp32: greedy tokens routed freely (the raw first mismatch
#             and where the forms first chose other experts), then with the expanded engine's routes replayed
#             in the latent engine (tokens must be equal); the latent engine against the learner;
#      reuse  whole-turn reuse at gpu_1b in bf16 with vLLM's CUDA graphs: 64 concurrent 8-turn episodes,
#             2,048-token first prompt, tool responses of 100-400 tokens, 64 greedy tokens a turn; session
#             and none first (the bar), decode tok/s at 64 sequences, then stock prefix caching and the
#             peer (vLLM's native Kimi Linear, history resubmitted under prefix caching), each when the
#             budget holds it (the first things dropped when time runs short).
#   2. one GRPO step of configs/exp/gpu_colocated.yaml (learner and engine share the GPU, weight_sync=ipc)
#      on a local Ray cluster, the held-out evals before and after included; its perf/* seconds printed.
# Usage, with the environment of bench/RESULTS.md ("Rollout on the H200") exported:
#   OUT=... bash bench/gpu_rollout_checks.sh     (about 9 minutes: BUDGET_S)
# Files under $OUT (8): phases.txt, rollout_gpu.log, rg/rollout_gpu.{json,md}, rl_train.log,
# rl/{metrics.jsonl,summary.json,errors.jsonl}.
set -u
: "${OUT:?set OUT to the results folder}"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}   # the whole script
ROLLOUT_S=${ROLLOUT_S:-350} # phase 1 starts no step after this; stopped 40 s later
MLA_S=${MLA_S:-180}         # of which the mla part (the rest: reuse)
RL_STEPS=${RL_STEPS:-1}     # 2: a second, warm step (step 1 is logged after step 2's rollout)
RL_DIR=${RL_DIR:-${TMPDIR:-/tmp}/rl_colocated}
RL_CONFIG=${RL_CONFIG:-configs/exp/gpu_colocated.yaml}
# appended to each command line (trying the script on a CPU: ROLLOUT_ARGS="--small --episodes 4 ...",
# RL_CONFIG / RL_ARGS naming a CPU-sized run)
ROLLOUT_ARGS=${ROLLOUT_ARGS:-}
RL_ARGS=${RL_ARGS:-}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT/rg" "$OUT/rl"
t0=$SECONDS
phase() { echo "$(date +%T) +$((SECONDS - t0)) s: $*" | tee -a "$OUT/phases.txt"; }

phase "rollout_gpu.py mla@$MLA_S,reuse, budget $ROLLOUT_S s"
timeout -s INT -k 20 $((ROLLOUT_S + 40)) "$PY" bench/rollout_gpu.py --out "$OUT/rg" \
    --parts "mla@$MLA_S,reuse" --dtypes fp32 --cuda-graphs --episodes 64 --budget-s "$ROLLOUT_S" \
    $ROLLOUT_ARGS >"$OUT/rollout_gpu.log" 2>&1
phase "rollout_gpu.py exit $?"

rl_s=$((BUDGET_S - (SECONDS - t0) - 10))
((rl_s < 120)) && rl_s=120
phase "rl.train $RL_CONFIG, $RL_STEPS steps, weight_sync=ipc, stopped after $rl_s s"
RAY_ADDRESS= timeout -s INT -k 20 "$rl_s" "$PY" -m rl.train --config "$RL_CONFIG" run.dir="$RL_DIR" \
    run.resume=never curriculum.steps="$RL_STEPS" learner.weight_sync=ipc ray.num_cpus=8 $RL_ARGS \
    >"$OUT/rl_train.log" 2>&1
phase "rl.train exit $?"
for f in metrics.jsonl summary.json errors.jsonl; do [ -f "$RL_DIR/$f" ] && cp "$RL_DIR/$f" "$OUT/rl/"; done

cat "$OUT/rg/rollout_gpu.md" 2>/dev/null
"$PY" - "$OUT/rl/metrics.jsonl" <<'EOF'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError as e:
    sys.exit(f"rl: no metrics ({e})")
for r in rows:
    keep = {k: round(v, 4) for k, v in r.items()
            if k.startswith(("perf/", "mismatch/", "sync/")) and isinstance(v, float)}
    print(f"rl step {r['step']}: {keep}")
EOF
tail -n 5 "$OUT/rl_train.log"
phase "done"
