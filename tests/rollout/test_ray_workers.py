"""Two RolloutWorkers as Ray actors (Ray on loopback) serving pinned episodes concurrently."""

from __future__ import annotations

import os

import pytest

from envs.types import EpisodeStatus
from rollout.episode import EpisodeBudget, SamplingConfig
from rollout.manager import RolloutManager, TaskSpec
from rollout.worker import RolloutWorker

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ACTOR_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def ray_workers(tiny_ckpt, tmp_path_factory):
    ray = pytest.importorskip("ray")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind to loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        object_store_memory=100 << 20,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    path, _ = tiny_ckpt
    actor = ray.remote(num_cpus=1)(RolloutWorker)
    config = dict(
        model_path=str(path),
        reuse="session",
        max_model_len=768,
        max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20,
    )
    handles = [actor.options(runtime_env={"env_vars": ACTOR_ENV}).remote(config) for _ in range(2)]
    ray.get([h.get_version.remote() for h in handles])  # both engines up
    yield handles
    for h in handles:
        ray.get(h.shutdown.remote())
        ray.kill(h)
    ray.shutdown()


def test_two_actor_workers_serve_pinned_episodes_concurrently(ray_workers):
    import ray

    mgr = RolloutManager(ray_workers, EpisodeBudget(max_turns=2, max_tokens_per_turn=16), SamplingConfig())
    tasks = [TaskSpec("Calculator", {"task_index": i}) for i in range(2)]
    groups = mgr.collect(tasks, group_size=2)
    episodes = [e for g in groups for e in g.episodes]
    assert len(episodes) == 4 and all(e.status != EpisodeStatus.ERROR for e in episodes), [
        e.status_detail for e in episodes
    ]
    loads = ray.get([h.load.remote() for h in ray_workers])
    assert all(load["turns"] >= 2 for load in loads), loads  # each actor served one pinned group
    assert sum(load["turns"] for load in loads) == sum(len(e.turns) for e in episodes)
    assert all(load["resident"] == 0 for load in loads)
    for e in episodes:  # multi-turn episodes continued their resident state on their own worker
        for t in e.turns[1:]:
            assert t.num_computed_prompt_tokens == len(t.prompt_token_ids) + 1


def test_weight_push_reaches_every_actor(ray_workers, tiny_ckpt):
    import ray

    path, _ = tiny_ckpt
    mgr = RolloutManager(ray_workers)
    reports = mgr.update_weights(str(path), version=7)
    assert [r["version"] for r in reports] == [7, 7]
    assert ray.get([h.get_version.remote() for h in ray_workers]) == [7, 7]
