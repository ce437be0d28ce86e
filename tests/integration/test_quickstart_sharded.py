"""The quickstart experiment with a sharded learner under ``ray job submit``: configs/exp/quickstart.yaml
(its model, env, algorithm and engine) with ``learner.num_workers=2`` (two FSDP2 ranks over gloo) and the
object-store weight sync (and again with the nccl one), shortened to 3 GRPO steps without the warm start, on a
local cluster of the test's own (the plug-in job test's fixture: scripts/ray_local.sh, stopped at the end)."""

import json
import subprocess
from pathlib import Path

import pytest
from test_plugin_job import RAY, cluster  # noqa: F401 (the fixture)

from rl.config import CONFIGS_ROOT
from rl.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

SHORT = ("sft.enabled=false", "curriculum.steps=3", "env.num_eval_tasks=8", "rollout.tasks_per_step=4",
         "rollout.group_size=4", "run.eval_every=0", "run.save_every=0", "run.plots=false", "run.tensorboard=false",
         "run.progress_bar=false")  # fmt: skip
SHARDED = ("learner.num_workers=2", "learner.num_cpus=0.5", "learner.sync_bucket_mb=0.25")


# nccl: its group over gloo on CPU. The ipc transport (shared memory on CPU) is held bit for bit to the others,
# through the same WeightSync.push to real engine workers, in tests/rl/test_weight_sync.py (~100 s of CI less)
@pytest.mark.parametrize("transport", ["object_store", "nccl"])
def test_quickstart_with_two_learner_ranks_under_ray_job_submit(tmp_path, cluster, transport):  # noqa: F811
    dashboard, env = cluster
    run = tmp_path / "run"
    cmd = [RAY, "job", "submit", "--address", dashboard, "--", "python", "-m", "rl.train", "--config",
           str(CONFIGS_ROOT / "exp" / "quickstart.yaml"), f"run.dir={run}", *SHORT, *SHARDED,
           f"learner.weight_sync={transport}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=CONFIGS_ROOT.parent, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "succeeded" in log, log[-6000:]
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "learner/version" in r}
    assert sorted(rows) == [1, 2, 3]
    for step, r in rows.items():
        assert r["learner/version"] == step == r["sync/version"]  # every version reached the workers
        assert r["perf/sync_s"] > 0 and r["sync/buckets"] > 1  # streamed in buckets
        assert r["mismatch/tokens"] > 0 and r["grad_norm"] >= 0  # random init: rewards may all be 0
    assert rows[1]["mismatch/logprob_abs_mean"] < 1e-3  # the engine runs the weights the group trains
    assert rows[3]["mismatch/logprob_abs_mean"] < 1e-3  # ... after two synced updates as well
    ckpt = Path(run / "checkpoints" / "step_000003" / "learner.dcp")
    assert {"rank_0.pt", "rank_1.pt", ".metadata"} <= {p.name for p in ckpt.iterdir()}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["held_out_success_after"] is not None
