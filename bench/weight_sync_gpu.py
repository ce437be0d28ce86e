"""The weight-sync transports on GPUs: ``nccl`` (ProcessGroupNCCL) between GPUs and ``ipc`` (CUDA IPC) on
one GPU, each against object_store and directory.

    python bench/weight_sync_gpu.py --out DIR [--preset gpu_1b] [--bucket-mb 256] [--repeats 2]
                                    [--parts sync,colocated,shared_gpu] [--lora] [--learner-ranks 1]

A local Ray cluster; the learner group (``--learner-ranks`` Learner actors, one GPU each) and one
rollout worker actor (a vLLM engine on a GPU of its own) started from the learner's export, as
rl/train.py sets them up. Parts:

* ``sync``: for each transport of ``--transports`` (directory, object_store, nccl by default; any subset,
  e.g. ``nccl`` alone for gpu_8b, whose directory sync writes and reads 31 GiB): every weight of the
  engine is zeroed, ``WeightSync.push`` sends the learner's weights, and the SHA-1 of every tensor of the
  engine's state dict must equal that of the fresh engine (hashed once it started from the learner's
  export of the same version, before anything was zeroed; with ``--lora`` the first transport's engine):
  a transport that moved nothing, or moved it wrong, fails; then ``--repeats`` more pushes timed
  (``perf/sync_s``, and GiB/s of the engine's weights: the learner sends its fp32 tensors, so the wire
  carries more under a bf16 engine). The nccl group's backend must be ``nccl`` when every end is on CUDA.
  ``--learner-ranks`` N: the learner sharded over N ranks (FSDP2, one GPU each; rank 0 gathers and
  sends). ``--lora``: adapter-only sync (the learner sharded with fsdp, also at one rank). Needs a GPU
  for the engine beside the learner's N (skipped otherwise). On CUDA an ipc push to that engine must
  then be refused naming both GPUs (CUDA IPC maps memory of the same GPU only).
* ``colocated``: the learner and one rollout worker on one GPU (Ray shares of 0.5 each, as
  configs/exp/gpu_colocated.yaml; on a one-GPU machine the learner reserves 0.5 for it), the same
  zero / push / SHA-1 check and timing for ``--colocated-transports`` (directory, object_store, then
  ipc: the engine maps the learner's bucket buffers by CUDA IPC). Skipped on two or more GPUs (the
  learner holds a whole one there) and for a sharded learner on a GPU (its ranks take whole GPUs); on
  CPU it runs the same code through shared memory.
* ``shared_gpu``: two rollout workers on one GPU (``num_gpus=0.5`` each, the learner on another), or on a
  one-GPU machine one worker beside the learner: an nccl push must be refused naming both ends (NCCL
  cannot put two ranks on one device).

Results: DIR/weight_sync_gpu.json (rewritten after every part); exit 1 when a check fails. On a
machine without CUDA it runs on CPU (gloo; ``--preset tiny``), which is how the script is tried here.

Device run (2 GPUs: nvidia-h200-x2 for ``sync``; nvidia-h200 for ``colocated``, and ``shared_gpu`` on
either; N + 1 GPUs for ``--learner-ranks`` N), with the Ray, vLLM, omegaconf and gymnasium wheels carried
as for bench/rollout_gpu.py (bench/RESULTS.md, "Rollout on the H200")::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_LOGGING_LEVEL=WARNING \\
        python3 bench/weight_sync_gpu.py --out $OUT --preset gpu_1b
    # gpu_8b from a learner sharded over 2 GPUs to an engine on a third (nvidia-h200-x4):
    python3 bench/weight_sync_gpu.py --out $OUT --preset gpu_8b --learner-ranks 2 --parts sync --transports nccl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.worker import RolloutWorker  # noqa: E402

PRESETS = {name: ROOT / f"configs/model/{file}.yaml" for name, file in
           (("tiny", "cpu_tiny"), ("gpu_1b", "gpu_1b"), ("gpu_8b", "gpu_8b"))}  # fmt: skip
# the device image's NCCL settings (multicast off), kept in every Ray worker
KEEP_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "PYTHONPATH",
            "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_LOGGING_LEVEL")  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _engine_weights(worker) -> dict:
    """The engine's state dict without vLLM's private layer state (names ending in ``._...``: the attention
    layers' ``_k_scale`` / ``_v_scale`` / ``_q_scale`` / ``_prob_scale``, no checkpoint tensor and never
    synced; zeroed they would stay zero and differ from a fresh engine's)."""
    sd = worker.model_runner.get_model().state_dict()
    return {k: v for k, v in sd.items() if not k.rsplit(".", 1)[-1].startswith("_")}


def _zero(worker) -> int:
    import torch

    with torch.no_grad():
        sd = _engine_weights(worker)
        for t in sd.values():
            t.zero_()
    return len(sd)


def _digest(worker) -> dict[str, str]:
    import hashlib

    import torch

    sd = _engine_weights(worker)
    raw = {k: v.detach().reshape(-1).view(torch.uint8).cpu().numpy() for k, v in sd.items()}
    return {k: hashlib.sha1(b.tobytes()).hexdigest() for k, b in raw.items()}


def _nbytes(worker) -> int:
    return sum(t.numel() * t.element_size() for t in worker.model_runner.get_model().state_dict().values())


class BenchWorker(RolloutWorker):
    """A rollout worker with two probes into its engine: zero every weight, hash every weight."""

    def zero_weights(self) -> int:
        return self.llm.collective_rpc(_zero)[0]

    def digest(self) -> dict[str, str]:
        return self.llm.collective_rpc(_digest)[0]

    def nbytes(self) -> int:
        return self.llm.collective_rpc(_nbytes)[0]


class Pool:
    """What ``WeightSync.push`` needs of a pool: the workers and the version bookkeeping."""

    def __init__(self, workers, version: int) -> None:
        self.workers, self.version = workers, version

    def adopt(self, version, path, adapter_only=False) -> None:
        self.version = version


class Bench:
    def __init__(self, args) -> None:
        import ray
        import torch

        self.args, self.out = args, args.out
        self.cuda = torch.cuda.is_available()
        self.results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "cuda": self.cuda,
                              "gpus": torch.cuda.device_count() if self.cuda else 0, "checks": {}, "parts": {}}  # fmt: skip
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
        ray.init(num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False, log_to_driver=True,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})  # fmt: skip
        self.tmp = Path(tempfile.mkdtemp(prefix="weight_sync_gpu_"))
        self.cfg = self._config()

    def _config(self):
        from rl.config import load_config

        a = self.args
        overrides = [f"learner.device={'cuda' if self.cuda else 'cpu'}", f"learner.sync_bucket_mb={a.bucket_mb}",
                     f"learner.num_workers={a.learner_ranks}", "learner.torch_threads=null",
                     f"learner.sync_timeout_s={a.timeout_s}"]  # fmt: skip
        if self.colocates():  # half of the one GPU, the other half for the colocated part's engine
            overrides.append("learner.num_gpus=0.5")
        if a.lora:  # sharded (fsdp, also at one rank): the unsharded learner's LoRA base export of a random
            # init writes a config.json without ``architectures``, which vLLM refuses
            overrides += ["learner.lora.enabled=true", "learner.lora.sync=adapter", "learner.sharding=fsdp"]
        cfg = load_config(None, overrides)
        from bench.learner_mfu import load_arch

        return dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, arch=load_arch(PRESETS[a.preset]), seed=0)
        )

    def colocates(self) -> bool:
        """A one-GPU machine: the learner (one rank) and the colocated part's engine share its GPU."""
        one_gpu = self.cuda and self.results["gpus"] == 1
        return one_gpu and "colocated" in self.args.parts and self.args.learner_ranks == 1

    def spare_gpus(self) -> int:
        """GPUs beside the learner's ranks (one each on CUDA)."""
        return self.results["gpus"] - self.args.learner_ranks

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "weight_sync_gpu.json").write_text(json.dumps(self.results, indent=1, default=str))

    def check(self, name: str, ok: bool) -> None:
        self.results["checks"][name] = bool(ok)
        log(f"check {name}: {'ok' if ok else 'FAILED'}")

    def worker(self, start: str, gpus: float, share: float):
        import ray

        engine = dict(model_path=start, dtype="bfloat16" if self.cuda else "float32", max_model_len=1024,
                      max_num_seqs=4, kv_cache_memory_bytes=256 << 20)  # fmt: skip
        if self.cuda:
            engine["gpu_memory_utilization"] = share
        actor = ray.remote(num_cpus=1, num_gpus=gpus if self.cuda else 0, max_restarts=0)(BenchWorker)
        return actor.remote(engine)

    # --- parts ----------------------------------------------------------------------------------------
    def part_sync(self, group) -> dict:
        import ray

        from rl.weight_sync import WeightSync

        if self.cuda and self.spare_gpus() < 1:
            return {"skipped": f"{self.results['gpus']} GPUs: the learner's {self.args.learner_ranks} rank(s) hold "
                               "them all, the engine needs another"}  # fmt: skip
        syncs = {t: WeightSync(group, dataclasses.replace(self.cfg.learner, weight_sync=t), self.tmp / t / "weights")
                 for t in self.args.transports}  # fmt: skip
        start, adapter, version = syncs[self.args.transports[0]].start_weights()
        t0 = time.time()
        w = self.worker(start, 1, self.args.gpu_share)
        if adapter:
            ray.get(w.update_weights.remote(adapter, version, True))
        ray.get(w.get_version.remote())
        log(f"engine up in {time.time() - t0:.1f} s")
        pool = Pool([w], version)
        out = self.time_transports("sync", syncs, pool, self.args.transports)
        if "nccl" in out:
            out["nccl"]["backend"] = syncs["nccl"].group.backend
            if self.cuda:
                self.check("nccl_group_is_nccl_on_cuda", syncs["nccl"].group.backend == "nccl")
        if self.cuda:  # the engine on a GPU of its own: CUDA IPC cannot map the learner's memory there
            ipc_cfg = dataclasses.replace(self.cfg.learner, weight_sync="ipc")
            ipc = WeightSync(group, ipc_cfg, self.tmp / "ipc")
            try:
                ipc.push(pool)
                message = ""
            except ValueError as e:
                message = str(e)
            out["ipc_refused"] = message
            self.check("ipc_on_another_gpu_refused_by_name", "rollout worker 0 is on GPU" in message)
        for sync in syncs.values():
            sync.close()
        ray.get(w.shutdown.remote())
        ray.kill(w)
        return out

    def part_colocated(self, group) -> dict:
        """The learner and the engine on one GPU (or both on the CPU): directory, object_store, ipc."""
        import ray

        from rl.weight_sync import WeightSync

        if self.cuda and not self.colocates():
            return {"skipped": f"{self.results['gpus']} GPUs, {self.args.learner_ranks} learner rank(s): the learner "
                               "holds whole GPUs; run one rank on one GPU"}  # fmt: skip
        transports = self.args.colocated_transports
        syncs = {t: WeightSync(group, dataclasses.replace(self.cfg.learner, weight_sync=t), self.tmp / f"co_{t}")
                 for t in transports}  # fmt: skip
        start, adapter, version = syncs[transports[0]].start_weights()
        w = self.worker(start, 0.5, self.args.gpu_share)  # the other half of the learner's GPU
        if adapter:
            ray.get(w.update_weights.remote(adapter, version, True))
        out = self.time_transports("colocated", syncs, Pool([w], version), transports)
        for sync in syncs.values():
            sync.close()
        ray.get(w.shutdown.remote())
        ray.kill(w)
        return out

    def time_transports(self, part: str, syncs: dict, pool: Pool, transports: list[str]) -> dict:
        """For each transport: zero the engine, push, compare every tensor's SHA-1 with the fresh engine's (it
        started from the learner's export of this same version), then time ``--repeats`` more pushes.
        Results land in ``parts[part]`` as they come. ``--lora``: an adapter push restores only the adapted
        weights (the zeroed rest stays zero), so the reference is the first transport's engine instead."""
        import ray

        w = pool.workers[0]
        reference = None if self.args.lora else ray.get(w.digest.remote())  # before anything is zeroed
        against = "the_first_transport" if self.args.lora else "a_fresh_engine"
        out = {}
        gib = ray.get(w.nbytes.remote()) / 2**30
        self.results["engine_gib"] = gib
        for t in transports:
            ray.get(w.zero_weights.remote())
            first = syncs[t].push(pool)
            got = ray.get(w.digest.remote())
            reference = got if reference is None else reference
            bad = [k for k in reference if reference[k] != got.get(k)]
            ok = not bad and got.keys() == reference.keys()
            name = t if part == "sync" else f"{part}_{t}"
            self.check(f"{name}_weights_equal_{against}", ok)
            times = [first.seconds] + [syncs[t].push(pool).seconds for _ in range(self.args.repeats)]
            out[t] = {"seconds": times, "best_s": min(times), "engine_gib_per_s": gib / min(times),
                      "buckets": first.buckets, "mismatched": bad[:10]}  # fmt: skip
            log(f"{part} {t}: {times} s, {first.buckets} buckets")
            self.results["parts"][part] = out
            self.save()
        return out

    def part_shared_gpu(self, group) -> dict:
        import ray

        from rl.weight_sync import WeightSync

        if not self.cuda:
            return {"skipped": "no CUDA"}
        sync = WeightSync(
            group, dataclasses.replace(self.cfg.learner, weight_sync="nccl"), self.tmp / "shared"
        )
        start, _adapter, version = sync.start_weights()
        if self.spare_gpus() >= 1:  # two engines share a GPU the learner left
            workers = [self.worker(start, 0.5, self.args.gpu_share / 2) for _ in range(2)]
            want = "rollout worker 0 and rollout worker 1 are on the same GPU"
        else:  # one engine reserving no GPU: it takes the learner's
            workers = [self.worker(start, 0, self.args.gpu_share / 2)]
            want = "the learner and rollout worker 0 are on the same GPU"
        ray.get([w.get_version.remote() for w in workers])
        try:
            sync.push(Pool(workers, version))
            message = ""
        except ValueError as e:
            message = str(e)
        self.check("shared_gpu_refused_by_name", want in message)
        for w in workers:
            ray.get(w.shutdown.remote())
            ray.kill(w)
        return {"message": message}

    def run(self) -> int:
        from rl.learner_group import LearnerGroup

        t0 = time.time()
        group = LearnerGroup(self.cfg.model, self.cfg.learner, self.cfg.algorithm)
        log(f"learner group up in {time.time() - t0:.1f} s")
        for part in self.args.parts:
            try:
                self.results["parts"][part] = getattr(self, f"part_{part}")(group)
            except Exception:
                self.results["parts"][part] = {"error": traceback.format_exc()}
                self.check(f"{part}_ran", False)
                log(traceback.format_exc())
            self.save()
        group.shutdown()
        return 0 if all(self.results["checks"].values()) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--preset", default=None, choices=sorted(PRESETS), help="default: gpu_1b on CUDA, else tiny"
    )
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", default="sync,colocated,shared_gpu")
    p.add_argument("--transports", default="directory,object_store,nccl", help="of the sync part")
    p.add_argument(
        "--colocated-transports", default="directory,object_store,ipc", help="the colocated part's"
    )
    p.add_argument("--lora", action="store_true", help="LoRA adapter-only sync")
    p.add_argument("--learner-ranks", type=int, default=1, help="learner.num_workers (sharded when > 1)")
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--gpu-share", type=float, default=0.3, help="gpu_memory_utilization of the engine")
    args = p.parse_args(argv)
    import torch

    args.preset = args.preset or ("gpu_1b" if torch.cuda.is_available() else "tiny")
    args.parts = args.parts.split(",")
    args.transports = args.transports.split(",")
    args.colocated_transports = args.colocated_transports.split(",")
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
