"""``RolloutWorker``: one vLLM engine serving turns of many episodes, token ids in and out.

A plain class (``ray.remote`` is applied where it is launched). Each call to ``generate`` takes one
turn per episode ("session"): the token ids appended since that episode's previous turn, and
returns the sampled ids, their sampling logprobs, the policy version and what the engine really
computed. Token ids are never re-derived from text.

Routing replay records (``TurnOutput``): the experts the engine routed each token of the turn to, for
every token it computed in the turn -- the new prompt ids (``prompt_routed_experts``), the sampled ids
(``routed_experts``; the last one is fed only with the next turn, so its row is -1) and the previous
turn's last sampled token (``prev_token_routed_experts``, fed first in this turn). A prompt id the
engine did not compute (a stock prefix-cache hit) is -1; with whole-turn session reuse every new id is
computed. So an episode's turns together hold the routes of every token the engine computed for it,
each as the turn that first computed it recorded it (rl/batching.py lays them out for the learner).

Whole-turn state reuse (``reuse="session"``): an episode's request stays alive in the engine
between turns (vLLM streaming-input sessions, ``rollout.sessions``), so its KV blocks *and* its KDA
recurrent/conv states stay resident and the next turn prefills only the new tokens plus the one
token sampled last (which the engine had not fed yet). Resident sessions are bounded by
``max_resident_sessions`` (derived from the KV budget); the least recently used idle session is
closed when a new one needs room, and a closed, evicted or stale session falls back to one request
over its full history (prefix-cache hits if enabled, recompute otherwise) -- the outputs do not
depend on which path ran. ``reuse="prefix_cache"`` is stock vLLM (full history every turn, block
prefix caching with align-mode recurrent checkpoints) and ``reuse="none"`` recomputes everything.

Weight updates copy tensors into the running model in place (our vLLM model uses plain torch
layers, so there is no CPU repacking to redo) -- full weights, or a LoRA adapter folded into the
base weights (``rollout.adapters``) -- bump the policy version, close every resident
session and reset the prefix cache; requests also carry ``cache_salt = "v<version>"`` so no prefix
computed by an older version can be matched, unless ``allow_stale_cache`` is set. Full weights also
arrive in buckets, through Ray's object store (``load_weight_bucket``) or broadcast over a process group
of the learner and the workers (``join_weight_group`` / ``receive_weight_bucket``, the ``nccl`` transport,
rollout/weight_broadcast.py), or mapped from the learner's own buffers on this GPU or host
(``load_ipc_bucket``, the ``ipc`` transport, rollout/weight_ipc.py), and are loaded the same way.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rollout.adapters import AdapterWeights

REUSE_MODES = ("session", "prefix_cache", "none")
TURN_OUTPUTS = ("final", "delta")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The default CUDA-graph batch sizes: powers of two from 2 below ``max_num_seqs``, and ``max_num_seqs``
    itself. No graph of 1 (unless ``max_num_seqs`` is 1): vLLM runs a one-sequence decode step in the graph
    of 2, padded, while capturing a graph of 1 token would make dynamo specialise every compiled region on a
    token count of 1 (its 0/1 rule) and compile each again during start-up (cpu_tiny's no-grad forward:
    12 graphs for 300, 64, 128 and 32 tokens, 23 once 1 token ran; tests/model/test_compile.py)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1 << i for i in range(1, max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


@dataclass
class WorkerConfig:
    model_path: str
    reuse: str = "session"
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    kv_cache_memory_bytes: int = 128 << 20
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_resident_sessions: int | None = None  # None: what the KV budget holds at max_model_len / 2 each
    allow_stale_cache: bool = False
    seed: int = 0
    num_threads: int | None = 1
    enforce_eager: bool = True
    logprobs_mode: str = "processed_logprobs"  # logprobs of the distribution actually sampled from
    # where the sampled tokens' logprobs come from: the model runner's step records (True; vLLM computes them as
    # for logprobs=0, ``rollout.engine_hooks.install_sampled_logprobs``) or vLLM's per-request logprob outputs
    # (False), whose host work made a 64-sequence decode step on an H100 0.8-1 ms longer (bench/RESULTS.md)
    record_logprobs: bool = True
    # how vLLM hands a turn's tokens back: one output a request when its turn ends ("final", FINAL_ONLY) or one a
    # request and engine step ("delta"), whose objects vLLM's output processor builds every decode step (64
    # requests on an H100 host: 0.22-0.36 ms a step against 0.05-0.07 ms, the decode step 6% shorter;
    # bench/RESULTS.md). The same turns either way
    turn_outputs: str = "final"
    policy_version: int = 0
    stall_steps: int = 200  # engine steps without progress before idle sessions are force-closed
    in_process: bool = True  # engine core in this process (fast start; a Ray actor is a process already)
    # "auto" | "expanded" | "latent" (rollout.vllm_layers); None: the checkpoint's, else auto (latent on CUDA)
    mla_cache_form: str | None = None
    # KDA layers per vLLM state layer (rollout.vllm_plugin.kda_state_depth): "auto", KDA layers / MLA layers (gpu_1b:
    # 3, one KV-cache group for all KDA states instead of 3); 1, one each; an int, that many. None: auto, except
    # 1 with reuse="prefix_cache": a stack's states need a page as large as the stack, vLLM raises the attention
    # block to match where that page is the larger (gpu_1b's latent cache on a GPU: ~432 -> ~1,280 tokens), and
    # prefix caching reuses whole blocks only (its recurrent checkpoints sit at block ends); not measured there
    kda_state_depth: int | str | None = None
    # vLLM attention backend name (e.g. "TRITON_ATTN", "FLASH_ATTN"); None: vLLM's pick, except the latent
    # form on CUDA with a head over 256, which takes TRITON_ATTN (see latent_attention_backend)
    attention_backend: str | None = None
    # share of the GPU vLLM checks is free at start-up (the KV budget is kv_cache_memory_bytes); lower it
    # for several engines, or an engine beside a learner, on one GPU. None: vLLM's default (0.9)
    gpu_memory_utilization: float | None = None
    # batch sizes vLLM captures CUDA graphs for (enforce_eager=False). None: powers of two from 2 up to
    # max_num_seqs (``capture_sizes``). vLLM's own list (1, 2, 4, then every 8 up to its maximum: 54 graphs for 128
    # sequences) made gpu_1b's cold first call on an H200 105 s; 8 powers of two 79 s, and 48 s with the
    # compile workers of ``model.serving.inductor_compile_threads`` (bench/RESULTS.md); a batch between
    # two sizes runs in the next larger graph. Pass vLLM's list explicitly to get it back.
    cudagraph_capture_sizes: list[int] | None = None
    # session workers under vLLM's async scheduler (its GPU default), the model's stale-step guard keeping each
    # parked session's recurrent state at its turn's end (``scheduling_kwargs``); off: synchronous scheduling.
    # Needs the turns of one generate call to share their stop ids, and the engine core in this process (in_process)
    async_sessions: bool = False

    def __post_init__(self) -> None:
        from rollout.vllm_plugin import MLA_CACHE_FORM_CHOICES

        if self.reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {self.reuse!r}")
        if self.mla_cache_form is not None and self.mla_cache_form not in MLA_CACHE_FORM_CHOICES:
            raise ValueError(f"mla_cache_form must be one of {MLA_CACHE_FORM_CHOICES}, got {self.mla_cache_form!r}")
        if self.turn_outputs not in TURN_OUTPUTS:
            raise ValueError(f"turn_outputs must be one of {TURN_OUTPUTS}, got {self.turn_outputs!r}")
        if self.async_sessions and self.reuse != "session":
            raise ValueError(f"async_sessions applies to reuse='session' only, got reuse={self.reuse!r}")
        if self.async_sessions and not self.in_process:
            # a turn ends with one more engine step (``generate``: the step run past the stop); an engine core in its
            # own process answers a step only with outputs, and that one has none: it waited forever on an H100
            raise ValueError("async_sessions needs in_process=True (an engine core in its own process would leave "
                             "the step after a turn's stop unanswered); set in_process=true or async_sessions=false")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or not all(isinstance(n, int) and n > 0 for n in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of positive ints, got {sizes!r}")
        if not Path(self.model_path, "config.json").is_file():
            raise FileNotFoundError(f"model_path {self.model_path!r} has no config.json")
        if self.kda_state_depth is not None:  # checked against the checkpoint's layers here, not in the engine's start
            import json
            from types import SimpleNamespace

            from rollout.vllm_plugin import kda_state_depth

            lac = json.loads(Path(self.model_path, "config.json").read_text()).get("linear_attn_config") or {}
            layers = {k: lac.get(k, []) for k in ("kda_layers", "full_attn_layers")}
            kda_state_depth(SimpleNamespace(linear_attn_config=layers, kda_state_depth=self.kda_state_depth))


@dataclass
class TurnRequest:
    session_id: str
    token_ids: list[int]  # [P] ids appended since this session's previous turn (all of the prompt at first)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class TurnOutput:
    session_id: str
    token_ids: list[int]  # [A] sampled ids (a stop token, if hit, is the last one)
    logprobs: list[float]  # [A] sampling logprobs of token_ids
    routed_experts: np.ndarray | None  # [A, num_moe_layers, top_k] int16; -1 where not computed this turn
    prev_token_routed_experts: np.ndarray | None  # [L, K] of the previous turn's last sampled token
    finish_reason: str  # "stop", "length" or "context" (no room left in max_model_len)
    stop_token_id: int | None
    policy_version: int
    num_new_tokens: int  # prompt ids the caller appended (P)
    num_computed_prompt_tokens: int  # prompt ids the engine actually prefilled for this turn
    reused_session: bool  # True when the episode's resident state was continued
    context_len: int  # tokens of the episode after this turn
    # [P, L, K] int16 experts of the request's token_ids (the turn's new prompt ids) as this turn computed
    # them; -1 where the engine did not compute one (a prefix-cache hit). None when nothing was recorded
    prompt_routed_experts: np.ndarray | None = None


@dataclass
class _Session:
    history: list[int] = field(default_factory=list)  # every token of the episode so far
    internal_id: str | None = None  # set while the engine holds the request (resident)
    external_id: str = ""  # the id vLLM reports outputs under (fixed for a resident request's life)
    version: int = -1  # policy version that computed the resident state
    incarnation: int = 0
    last_used: float = 0.0
    sampled: int = 0  # tokens the resident request sampled in its earlier turns (its final outputs hold them too)


@dataclass
class _Pending:
    request: TurnRequest
    session: _Session
    internal_id: str
    resumable: bool
    reused: bool
    prompt_len: int  # tokens before the first sampled one (= its position)
    prev_pos: int  # position of the previous turn's last sampled token (-1 on the first turn)
    earlier: int = 0  # the request's tokens of earlier turns at the head of its outputs (final outputs of a session)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None


class RolloutWorker:
    """One vLLM engine; see the module docstring. Not thread-safe: one call at a time."""

    _live_in_process = 0  # in-process engines alive in this process (they share its vLLM dist groups)

    def __init__(self, config: WorkerConfig | dict[str, Any]) -> None:
        self.config = config if isinstance(config, WorkerConfig) else WorkerConfig(**config)
        self.version = self.config.policy_version
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # LRU order: oldest first
        self.failure: str | None = None  # set when the engine raised mid-turn: see ``check_usable``
        self.llm = self._start_engine()
        RolloutWorker._live_in_process += int(self.config.in_process)
        from rollout.engine_hooks import install_step_recorder
        from rollout.sessions import SessionEngine

        self.engine = SessionEngine(self.llm.llm_engine, self._install_turn_ends if self.config.async_sessions else None)
        self.llm.collective_rpc(install_step_recorder)
        if self.config.record_logprobs:
            from rollout.engine_hooks import install_sampled_logprobs

            self.llm.collective_rpc(install_sampled_logprobs)
        self.max_resident = self._resident_budget()
        self.stats = {
            "turns": 0,
            "reused_turns": 0,
            "evictions": 0,
            "new_tokens": 0,
            "computed_prompt_tokens": 0,
        }

    # --- engine ---------------------------------------------------------------------------------------
    def _start_engine(self):
        c = self.config
        if c.num_threads:
            import torch

            torch.set_num_threads(c.num_threads)
            os.environ.setdefault("OMP_NUM_THREADS", str(c.num_threads))
        set_engine_process(c.in_process)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # hooks are callables (MP engines)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=c.model_path,
            dtype=c.dtype,
            enforce_eager=c.enforce_eager,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            enable_prefix_caching=c.reuse == "prefix_cache",
            seed=c.seed,
            logprobs_mode=c.logprobs_mode,
            use_tqdm_on_load=vllm_logs_info(),  # the weight-loading bar is start-up chatter
        )
        if c.block_size:
            kwargs["block_size"] = c.block_size
        if c.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
        overrides = engine_hf_overrides(c)
        if overrides:
            kwargs["hf_overrides"] = overrides
        backend = c.attention_backend or latent_attention_backend(c)
        if backend:
            kwargs["attention_config"] = {"backend": backend}
        if c.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
        if c.async_sessions:
            from rollout.vllm_compat import MISSING, session_rollback

            if session_rollback() == MISSING:
                raise ValueError("async_sessions needs a vLLM scheduler that rolls a stopped session back to its "
                                 "turn's end (vLLM >= 0.31, or 0.26-0.30 with rollout.vllm_compat's backport); this "
                                 "one has neither: set rollout.engine.async_sessions=false")  # fmt: skip
        kwargs.update(scheduling_kwargs(c.reuse, c.async_sessions))
        if not c.enforce_eager:
            sizes = c.cudagraph_capture_sizes or capture_sizes(c.max_num_seqs)
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(sizes))}
        return LLM(**kwargs)

    def _install_turn_ends(self, ids: list[int]) -> None:
        from rollout.engine_hooks import set_turn_end_ids

        self.llm.collective_rpc(set_turn_end_ids, args=(ids,))

    def _resident_budget(self) -> int:
        if self.config.reuse != "session":
            return 0
        if self.config.max_resident_sessions is not None:
            return max(0, min(self.config.max_resident_sessions, self.config.max_num_seqs - 1))
        cache = self.llm.llm_engine.vllm_config.cache_config
        capacity_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
        per_session = max(self.config.max_model_len // 2, cache.block_size)
        # one max_num_seqs slot stays free so that fallback requests always get scheduled
        return max(0, min(capacity_tokens // per_session, self.config.max_num_seqs - 1))

    # --- public API -----------------------------------------------------------------------------------
    def generate(self, requests: list[TurnRequest | dict[str, Any]]) -> list[TurnOutput]:
        """Run one turn for each request (distinct sessions) to completion; outputs in request order."""
        reqs = [r if isinstance(r, TurnRequest) else TurnRequest(**r) for r in requests]
        ids = [r.session_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"one turn per session per call; duplicated session ids in {ids}")
        stops = {tuple(sorted(set(r.stop_token_ids))) for r in reqs} if self.config.async_sessions else set()
        if len(stops) > 1:  # checked before any turn starts
            raise ValueError(f"with async_sessions the turns of one generate call must share their stop_token_ids "
                             f"(the stale-step guard holds one set at a time), got {sorted(stops)}")  # fmt: skip
        self.check_usable()
        self.engine.begin_batch()
        outputs: dict[str, TurnOutput] = {}
        pending: list[_Pending] = []
        for r in reqs:
            started = self._start_turn(r, protected=set(ids))
            if isinstance(started, TurnOutput):
                outputs[r.session_id] = started
            else:
                pending.append(started)
        from rollout.engine_hooks import pop_request_records

        try:
            self._run(pending)
            if self.config.async_sessions:
                # the step an async scheduler ran past the last turn's stop: processed now (its output dropped,
                # rollout.vllm_compat), so the next turn never resumes a session with a step still in flight
                self.engine.step()
            records = self.llm.collective_rpc(pop_request_records, args=([p.internal_id for p in pending],))[0]
        except Exception as e:  # the engine's state is unknown now: this worker takes no more turns
            self.failure = f"{type(e).__name__}: {e}"
            raise
        for p in pending:
            outputs[p.request.session_id] = self._finish_turn(p, records[p.internal_id])
        return [outputs[i] for i in ids]

    def end_sessions(self, session_ids: list[str]) -> None:
        """Forget episodes (closing their resident requests)."""
        close = []
        for sid in session_ids:
            s = self.sessions.pop(sid, None)
            if s is not None and s.internal_id is not None:
                close.append(s.internal_id)
        self.engine.close(close)

    def update_weights(
        self,
        weights: str | os.PathLike | dict[str, Any] | AdapterWeights,
        version: int,
        adapter_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load new weights in place and tag them ``version``.

        Full weights: a safetensors file/dir or a state dict. Adapter-only (``adapter_only``, or
        None and ``weights`` is an ``AdapterWeights`` or a peft adapter dir): the LoRA adapter is
        folded into the base weights (``rollout.adapters``). Either way a bad update raises before
        any weight changes, and the stale-cache rules are the same."""
        from rollout.adapters import is_adapter_update

        t0 = time.perf_counter()
        is_adapter = is_adapter_update(weights, adapter_only)
        count = self._load_adapter(weights) if is_adapter else self._load_full(weights)
        if not self.config.allow_stale_cache:
            self._close_resident(keep=set())
            self.llm.reset_prefix_cache()
        self.version = int(version)
        seconds = time.perf_counter() - t0
        return {"version": self.version, "tensors": count, "adapter_only": is_adapter, "seconds": seconds}

    def _load_full(self, weights: str | os.PathLike | dict[str, Any]) -> int:
        from model.moe import stacked_names
        from rollout.adapters import rebase_inplace
        from rollout.engine_hooks import load_state_dict_inplace, load_weights_inplace

        if isinstance(weights, dict):
            names = list(weights)
            if self.config.in_process:
                counts = self.llm.collective_rpc(load_state_dict_inplace, args=(weights,))
            else:  # tensors cannot ride in collective_rpc across processes: go through a file
                counts = self._load_via_file(weights)
        else:
            from safetensors import safe_open

            names, counts = [], [0]
            for path in map(str, _safetensors_files(weights)):  # one file, or the shards of a sharded export
                with safe_open(path, "pt") as f:
                    names += list(f.keys())
                counts[0] += int(self.llm.collective_rpc(load_weights_inplace, args=(path,))[0])
        # these are the new base of adapted layers (per-expert file tensors: the stacked weights they fill)
        self.llm.collective_rpc(rebase_inplace, args=(stacked_names(names),))
        return int(counts[0])

    def load_weight_bucket(self, tensors: dict[str, Any]) -> int:
        """One bucket of a streamed full-weight update (rl/weight_sync.py), copied in place; the update is
        complete, tagged and the caches dropped, at ``finish_weight_update``. Deviation from
        ``update_weights``: a bad bucket raises after the buckets before it were loaded."""
        return self._load_full(tensors)

    def finish_weight_update(self, version: int, tensors: int = 0) -> dict[str, Any]:
        """End a streamed update: tag ``version`` and apply the same stale-cache rules as ``update_weights``."""
        if not self.config.allow_stale_cache:
            self._close_resident(keep=set())
            self.llm.reset_prefix_cache()
        self.version = int(version)
        return {"version": self.version, "tensors": tensors, "adapter_only": False}

    # --- the nccl weight sync's receiving end (rl/weight_sync.py, rollout/weight_broadcast.py) ---------
    def weight_device(self) -> dict:
        """The engine's model device (type, name, GPU UUID): what picks the broadcast group's backend."""
        from rollout.weight_broadcast import engine_device

        return self.llm.collective_rpc(engine_device)[0]

    def join_weight_group(self, spec) -> None:
        """Join a weight-broadcast group (``spec``: a ``GroupSpec`` for this worker's rank), leaving any
        group joined before; blocks until every rank has joined or ``spec.timeout_s`` has passed."""
        import torch

        from rollout.weight_broadcast import WeightReceiver

        self.leave_weight_group()
        self._receiver = WeightReceiver(spec, torch.device(self.weight_device()["device"]))

    def receive_weight_bucket(self, meta) -> int:
        """One broadcast bucket (``meta``: its ``BucketMeta``): full weights are copied in place like
        ``load_weight_bucket``'s (``finish_weight_update`` ends the update); adapter tensors are kept
        until ``finish_adapter_broadcast``. Returns the tensors received."""
        tensors = self._weight_receiver().receive(meta)
        return len(tensors) if meta.kind == "adapter" else self._load_full(tensors)

    def finish_adapter_broadcast(self, version: int, scale_fields: dict) -> dict[str, Any]:
        """Fold the adapter received over the group into the base weights (``update_weights``'s path)."""
        from rollout.adapters import AdapterWeights

        tensors = self._weight_receiver().pop_adapter()
        return self.update_weights(AdapterWeights(tensors, **scale_fields), version, True)

    # --- the ipc weight sync's receiving end (rl/weight_sync.py, rollout/weight_ipc.py) ----------------
    def load_ipc_bucket(self, bucket) -> int:
        """One bucket the learner shares on this host (``bucket``: an ``IpcBucket``, handles to the learner's
        flat buffers, not their bytes), mapped without a copy: full weights are copied in place from it like
        ``load_weight_bucket``'s (``finish_weight_update`` ends the update), adapter tensors copied out and
        kept until ``finish_ipc_adapter``. The mapping is dropped before this returns: the learner frees or
        reuses its buffers once every worker has answered. Returns the tensors received."""
        import torch

        from rollout.weight_ipc import load_mapped

        device = torch.device(self._engine_device()["device"])
        if bucket.meta.kind != "adapter":
            return load_mapped(bucket, device, self._load_full)
        if bucket.meta.index == 0:
            self._ipc_adapter = {}  # a new update: what a failed one left is dropped
        return load_mapped(bucket, device, self._keep_ipc_adapter)

    def finish_ipc_adapter(self, version: int, scale_fields: dict) -> dict[str, Any]:
        """Fold the adapter received by ``load_ipc_bucket`` into the base weights (``update_weights``'s path)."""
        from rollout.adapters import AdapterWeights

        tensors, self._ipc_adapter = getattr(self, "_ipc_adapter", {}), {}
        if not tensors:
            raise ValueError("no adapter tensors were received before finishing an ipc adapter update")
        return self.update_weights(AdapterWeights(tensors, **scale_fields), version, True)

    def _keep_ipc_adapter(self, tensors: dict[str, Any]) -> int:
        self._ipc_adapter.update({k: v.clone() for k, v in tensors.items()})  # out of the learner's buffer
        return len(tensors)

    def _engine_device(self) -> dict:
        """``weight_device()``, asked of the engine once."""
        record = getattr(self, "_device_record", None)
        if record is None:
            record = self._device_record = self.weight_device()
        return record

    def leave_weight_group(self) -> None:
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()

    def _weight_receiver(self):
        receiver = getattr(self, "_receiver", None)
        if receiver is None:
            raise RuntimeError("this worker is in no weight-broadcast group (join_weight_group first)")
        return receiver

    def _load_adapter(self, adapter) -> int:
        from rollout.adapters import AdapterWeights, apply_adapter_inplace

        if self.config.in_process:
            w = adapter if isinstance(adapter, AdapterWeights) else AdapterWeights.from_dir(adapter)
            return int(self.llm.collective_rpc(apply_adapter_inplace, args=(w,))[0])
        if not isinstance(adapter, AdapterWeights):
            return int(self.llm.collective_rpc(apply_adapter_inplace, args=(str(adapter),))[0])
        with tempfile.TemporaryDirectory() as d:
            path = str(adapter.save(d))
            return int(self.llm.collective_rpc(apply_adapter_inplace, args=(path,))[0])

    def load(self) -> dict[str, Any]:
        resident = sum(s.internal_id is not None for s in self.sessions.values())
        return {
            "sessions": len(self.sessions),
            "resident": resident,
            "max_resident": self.max_resident,
            "version": self.version,
            **self.stats,
        }

    def get_version(self) -> int:
        """The policy version this worker samples from; raises once its engine has failed (``check_usable``),
        so the driver's ping (``rl.rollouts.WorkerPool.replace_dead``) replaces it like a dead worker."""
        self.check_usable()
        return self.version

    def check_usable(self) -> None:
        """Raise if the engine raised during a turn (vLLM's scheduler or the model: its requests and states
        may be inconsistent), naming that error; the worker's episodes of that turn were already failed."""
        if self.failure is not None:
            raise RuntimeError(f"this rollout worker's engine failed ({self.failure}); start a new worker")

    def shutdown(self) -> None:
        self.end_sessions(list(self.sessions))
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                shutdown_engine_core(engine_core, self.config.in_process)
            del llm
        import gc

        gc.collect()

    # --- turns ----------------------------------------------------------------------------------------
    def _start_turn(self, r: TurnRequest, protected: set[str]) -> _Pending | TurnOutput:
        if not r.token_ids:
            raise ValueError(f"session {r.session_id!r}: a turn needs at least one new token id")
        if r.max_tokens < 1:
            raise ValueError(f"session {r.session_id!r}: max_tokens must be >= 1, got {r.max_tokens}")
        s = self.sessions.get(r.session_id) or _Session()
        self.sessions[r.session_id] = s
        self.sessions.move_to_end(r.session_id)
        s.last_used = time.monotonic()
        prev_len = len(s.history)
        full_len = prev_len + len(r.token_ids)
        room = self.config.max_model_len - full_len
        if room < 1:
            s.history.extend(r.token_ids)
            return self._empty_output(r, s, "context")
        params = self._params(r, min(r.max_tokens, room))
        salt = None if self.config.allow_stale_cache else f"v{self.version}"
        can_continue = s.internal_id is not None and (
            s.version == self.version or self.config.allow_stale_cache
        )
        if s.internal_id is not None and not can_continue:
            self._close(s)
        if can_continue:
            # the previous turn's last sampled token was never fed through the model: it leads the chunk
            self.engine.add_chunk(s.external_id, s.internal_id, [s.history[-1], *r.token_ids], params, salt)
            earlier = s.sampled if self.config.turn_outputs == "final" else 0
            pend = _Pending(r, s, s.internal_id, True, True, full_len, prev_len - 1, earlier)
        else:
            s.incarnation += 1
            s.external_id = f"{r.session_id}#{s.incarnation}"
            resumable = self.config.reuse == "session" and self._make_room(protected)
            full = [*s.history, *r.token_ids]  # the engine keeps its own copy (SessionEngine._prompt)
            internal = self.engine.add_request(s.external_id, full, params, resumable, salt)
            s.internal_id = internal if resumable else None
            s.version = self.version
            s.sampled = 0
            pend = _Pending(r, s, internal, resumable, False, full_len, prev_len - 1)
        s.history.extend(r.token_ids)  # in place: a reused turn copies no history
        self.stats["new_tokens"] += len(r.token_ids)
        return pend

    def _params(self, r: TurnRequest, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        recorded = self.config.record_logprobs  # then the step records carry them, not vLLM's outputs
        final = self.config.turn_outputs == "final"
        return SamplingParams(
            n=1,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=max_tokens,
            stop_token_ids=list(r.stop_token_ids),
            logprobs=None if recorded else 0,
            flat_logprobs=not recorded,  # a few flat lists a request, not a dict and a Logprob object a token
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY if final else RequestOutputKind.DELTA,
        )

    def _run(self, pending: list[_Pending]) -> None:
        by_ext = {p.session.external_id: p for p in pending}
        open_turns = len(pending)
        idle_steps = 0
        while open_turns:
            for out in self.engine.step():
                p = by_ext.get(out.request_id)
                if p is None or p.finish_reason is not None:
                    continue
                c = out.outputs[0]
                p.tokens.extend(_this_turn(c.token_ids, p))
                if not self.config.record_logprobs:
                    p.logprobs.extend(_this_turn(_sampled_logprobs(c), p))
                if c.finish_reason is not None:
                    p.finish_reason, p.stop_reason = c.finish_reason, c.stop_reason
                    open_turns -= 1
            idle_steps = 0 if self.engine.core_outputs else idle_steps + 1
            if idle_steps >= self.config.stall_steps:
                # parked sessions hold blocks; if the engine cannot schedule, release the idle ones
                if not self._close_resident(keep={p.request.session_id for p in pending}):
                    raise RuntimeError(f"vLLM engine made no progress for {idle_steps} steps")
                idle_steps = 0

    def _finish_turn(self, p: _Pending, rec) -> TurnOutput:
        s, r = p.session, p.request
        prompt_routed, routed, prev_routed = _routed_rows(
            rec, p.prompt_len, len(r.token_ids), len(p.tokens), p.prev_pos
        )
        if self.config.record_logprobs:
            p.logprobs = rec.sampled_logprobs(p.prompt_len, len(p.tokens))
        s.history.extend(p.tokens)
        s.sampled += len(p.tokens)
        if not p.resumable:
            s.internal_id = None
        computed = max(0, rec.num_computed_tokens - max(0, len(p.tokens) - 1))
        last = p.prompt_len + len(p.tokens) - 1
        if self.config.async_sessions and p.finish_reason == "stop" and fed_position(rec, last):
            # the async scheduler's stale step fed the stop token (its state guarded, its routes meaningless):
            # the token is fed for real with the next turn, as under synchronous scheduling
            if routed is not None:
                routed[-1] = -1
            computed = max(0, computed - 1)
        self.stats["turns"] += 1
        self.stats["reused_turns"] += int(p.reused)
        self.stats["computed_prompt_tokens"] += computed
        stop_id = p.stop_reason if isinstance(p.stop_reason, int) else None
        if stop_id is None and p.finish_reason == "stop" and p.tokens:
            stop_id = p.tokens[-1]  # EOS stops report no stop_reason
        return TurnOutput(
            session_id=r.session_id,
            token_ids=list(p.tokens),
            logprobs=list(p.logprobs),
            routed_experts=routed,
            prev_token_routed_experts=prev_routed,
            finish_reason=p.finish_reason or "length",
            stop_token_id=stop_id,
            policy_version=self.version,
            num_new_tokens=len(r.token_ids),
            num_computed_prompt_tokens=computed,
            reused_session=p.reused,
            context_len=len(s.history),
            prompt_routed_experts=prompt_routed,
        )

    def _empty_output(self, r: TurnRequest, s: _Session, reason: str) -> TurnOutput:
        return TurnOutput(
            r.session_id,
            [],
            [],
            None,
            None,
            reason,
            None,
            self.version,
            len(r.token_ids),
            0,
            False,
            len(s.history),
        )

    # --- residency ------------------------------------------------------------------------------------
    def _resident(self) -> list[str]:
        return [sid for sid, s in self.sessions.items() if s.internal_id is not None]

    def _make_room(self, protected: set[str]) -> bool:
        """True when one more session may stay resident (closing LRU idle sessions if needed)."""
        if self.max_resident <= 0:
            return False
        resident = self._resident()
        for sid in resident:  # oldest first
            if len(resident) < self.max_resident:
                break
            if sid not in protected:
                self._close(self.sessions[sid])
                self.stats["evictions"] += 1
                resident.remove(sid)
        return len(resident) < self.max_resident

    def _close(self, s: _Session) -> None:
        if s.internal_id is not None:
            self.engine.close([s.internal_id])
            s.internal_id = None

    def _close_resident(self, keep: set[str]) -> bool:
        closed = False
        for sid in self._resident():
            if sid not in keep:
                self._close(self.sessions[sid])
                closed = True
        return closed

    def _load_via_file(self, state_dict: dict[str, Any]) -> list[int]:
        from safetensors.torch import save_file

        from rollout.engine_hooks import load_weights_inplace

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "weights.safetensors")
            save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, path)
            return self.llm.collective_rpc(load_weights_inplace, args=(path,))

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)


def set_engine_process(in_process: bool) -> None:
    """Where the next engine built in this process runs its core: here, or in a process of its own. vLLM reads
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` through ``vllm.envs``, which caches every variable once an engine core
    has started, so the cache is dropped too: without that, a second engine would silently take the first
    one's layout (and an in-process engine taken for a separate one would tear down the process's vLLM
    groups at its shutdown)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    import vllm.envs as vllm_envs

    disable = getattr(vllm_envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def count_in_process_engine() -> None:
    """Count a plain ``vllm.LLM`` built in this process among the in-process engines (``RolloutWorker`` counts
    its own): it shares their vLLM distributed groups; ``shutdown_engine_core`` ends it."""
    RolloutWorker._live_in_process += 1


def shutdown_engine_core(engine_core, in_process: bool) -> None:
    """Shut down an engine's EngineCore. An in-process one is counted (``count_in_process_engine``): its
    shutdown tears down the process's vLLM distributed groups, which every other in-process engine here
    still uses, so only the last one alive may do that."""
    if not in_process:
        engine_core.shutdown()
        return
    RolloutWorker._live_in_process -= 1
    if RolloutWorker._live_in_process <= 0:
        engine_core.shutdown()
        return
    import vllm.v1.engine.core as core_mod

    teardown, core_mod.cleanup_dist_env_and_memory = core_mod.cleanup_dist_env_and_memory, lambda: None
    try:
        engine_core.shutdown()
    finally:
        core_mod.cleanup_dist_env_and_memory = teardown


def engine_hf_overrides(c: WorkerConfig) -> dict[str, Any]:
    """The HF config fields a worker's engine overrides (vLLM's ``hf_overrides``): the MLA cache form when set, the
    KDA state depth when set or when prefix caching keeps one KDA layer a state layer (``WorkerConfig``), the
    stale-step guard under async sessions."""
    overrides: dict[str, Any] = {"mla_cache_form": c.mla_cache_form} if c.mla_cache_form else {}
    if c.kda_state_depth is not None:
        overrides["kda_state_depth"] = c.kda_state_depth
    elif c.reuse == "prefix_cache":
        overrides["kda_state_depth"] = 1
    if c.async_sessions:
        overrides["stale_step_guard"] = True
    return overrides


def latent_attention_backend(c: WorkerConfig) -> str | None:
    """TRITON_ATTN for the latent MLA form on CUDA when its head is over 256: vLLM 0.26 would pick
    FlashAttention-4 for such a head (FlashAttention-3 stops at 256), which its wheel does not ship;
    vLLM's Triton backend takes any head of at least 32. None (vLLM's pick) otherwise."""
    import json
    from types import SimpleNamespace

    import torch

    from rollout.vllm_plugin import latent_head_size, mla_cache_form

    if not torch.cuda.is_available():
        return None
    config = SimpleNamespace(**json.loads(Path(c.model_path, "config.json").read_text()))
    if c.mla_cache_form:
        config.mla_cache_form = c.mla_cache_form
    if mla_cache_form(config) != "latent" or latent_head_size(config) <= 256:
        return None
    return "TRITON_ATTN"


def scheduling_kwargs(reuse: str, async_sessions: bool = False) -> dict[str, Any]:
    """A session worker's engine schedules synchronously unless ``async_sessions`` (vLLM's GPU default is async
    scheduling; its CPU platform has none). An async scheduler plans step N+1 before step N's tokens are known,
    so a turn that ends on a stop token at step N (a length stop is foreseen and not scheduled past) has run one
    more step: the stop token has gone through the model and the parked session's recurrent (KDA) state has moved
    past the turn's end, which no rollback of the scheduler's token count undoes, and the next turn, which starts
    with that token, would feed it twice. vLLM 0.26 (the GPU wheel) also delivers that stale step's token into
    the parked session, and when it ends the turn a second time the session is queued twice: on an H200
    (bench/rollout_gpu.py's reuse part, greedy turns that may end on EOS, 2026-12-04) the scheduler raised
    ``Invalid request status: RUNNING`` at the fourth turn. Workers without sessions keep vLLM's default.
    ``async_sessions`` keeps it too: the model's stale-step guard (``rollout.vllm_layers.StaleStepGuard``) steps
    such a stop token with no state, so the parked state stays at the turn's end."""
    return {"async_scheduling": False} if reuse == "session" and not async_sessions else {}


def vllm_logs_info() -> bool:
    """True when vLLM logs at INFO or below (its default, ``VLLM_LOGGING_LEVEL``). The engine draws its
    weight-loading progress bar only then: a run that quiets vLLM (``run.verbose``, rl/console.py) has
    no use for it either."""
    import logging

    import vllm.envs

    level = logging.getLevelName(vllm.envs.VLLM_LOGGING_LEVEL)
    return not isinstance(level, int) or level <= logging.INFO


def _sampled_logprobs(completion) -> list[float]:
    """The sampled tokens' logprobs of a completion. vLLM's sampler puts the sampled token first at each
    position, so with ``logprobs=0`` a ``FlatLogprobs`` (``flat_logprobs=True``) holds them at its
    positions' start indices; a list of {token: Logprob} per position is looked up by token."""
    lps = completion.logprobs
    if lps is None:
        return [float("nan")] * len(completion.token_ids)
    starts = getattr(lps, "start_indices", None)
    if starts is not None:
        flat = lps.logprobs
        return [float(flat[i]) for i in starts]
    return [float(lp[t].logprob) for lp, t in zip(lps, completion.token_ids)]


def _this_turn(values: list, p: _Pending) -> list:
    """An output's values (tokens, logprobs) of the running turn: a session's final outputs hold its earlier turns'
    too, ahead of them."""
    if not p.earlier:
        return values
    if len(values) < p.earlier:
        raise RuntimeError(f"session {p.request.session_id!r}: vLLM's output holds {len(values)} values, fewer than "
                           f"the {p.earlier} its earlier turns sampled")  # fmt: skip
    return values[p.earlier :]


def fed_position(rec, position: int) -> bool:
    """Whether the steps of a request's record (``rollout.engine_hooks.RequestRecord``) fed ``position``."""
    return any(bool((q == position).any()) for q in rec.positions)


def _routed_rows(
    rec, prompt_len: int, num_prompt: int, num_sampled: int, prev_pos: int
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The experts this turn's forwards routed tokens to, looked up by position in the step records:
    (the turn's new prompt ids, positions prompt_len - num_prompt .. prompt_len - 1 [P, L, K]; the
    sampled tokens, positions prompt_len .. [A, L, K]; the previous turn's last sampled token, position
    prev_pos, which this turn fed first [L, K] or None), -1 rows where the engine did not compute the
    token in this turn: a prefix-cache hit, or the last sampled token (fed only with the next turn).
    Earlier positions a fallback request recomputed are not returned: the episode keeps what the
    turn that first computed them recorded."""
    if not rec.routed:
        return None, None, None
    pos = np.concatenate(rec.positions)
    rows = np.concatenate(rec.routed)
    L, K = rows.shape[1:]
    # position -> row of its last record (a recomputed position keeps its last value): np.unique's first
    # index in the reversed order is the last occurrence
    last_pos, rev_i = np.unique(pos[::-1], return_index=True)
    last_row = len(pos) - 1 - rev_i

    def at(first: int, n: int) -> np.ndarray:
        out = np.full((n, L, K), -1, dtype=np.int16)
        lo, hi = np.searchsorted(last_pos, [first, first + n])
        out[last_pos[lo:hi] - first] = rows[last_row[lo:hi]]
        return out

    j = np.searchsorted(last_pos, prev_pos)
    found = prev_pos >= 0 and j < len(last_pos) and last_pos[j] == prev_pos
    prev = rows[last_row[j]].copy() if found else None
    return at(prompt_len - num_prompt, num_prompt), at(prompt_len, num_sampled), prev


def _safetensors_files(path: str | os.PathLike) -> list[Path]:
    """A .safetensors file, or a directory's: one file, or the shards its ``model.safetensors.index.json``
    lists (what a sharded learner exports)."""
    import json

    p = Path(path)
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (p / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shards that are not there: {missing}")
            return [p / s for s in shards]
        files = sorted(p.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{p} must hold exactly one .safetensors file (or a model.safetensors.index.json), "
                             f"found {[f.name for f in files]}")  # fmt: skip
        return files
    if not p.is_file():
        raise FileNotFoundError(f"no weights at {p}")
    return [p]
