"""Typed configuration: the dataclasses here are the source of truth, YAML only sets values.

``load_config(path, overrides)`` composes YAML files and ``key=value`` overrides with OmegaConf
against the schema, then validates cross-field rules, so an unknown key, a wrong type or an
impossible combination fails with a message naming the key before any actor starts. Below the
loader nothing sees an OmegaConf object: each component receives its own plain sub-config
(``LearnerConfig``, ``RolloutConfig``, ...), never the whole ``TrainConfig``.

The rules themselves live in rl/config_checks.py, which lists problems; ``validate`` and
``check_nested_keys`` here raise them as one ``ConfigError``.

Composition: a YAML file may start with a ``defaults`` list, Hydra style, merged in order before
the file's own values::

    defaults:
      - ../base.yaml            # a path relative to this file (".yaml" optional)
      - model: cpu_tiny         # configs/model/cpu_tiny.yaml, placed under the key ``model.arch``

Group entries (``group: name``) read ``configs/<group>/<name>.yaml`` and place it under the key
listed in ``GROUP_TARGETS``.

Merging: the schema, each ``defaults`` entry, the file itself and then each override, in that order,
merge key by key (a later layer sets single fields and keeps the others); lists are replaced whole.
A data mix (``env.mix``, ``sft.env_mix``: ``MIX_FIELDS``) is replaced whole too: the last layer that
sets a mix decides it, so an experiment naming only ``my_env`` trains on ``my_env`` alone, not on
``my_env`` plus the ``Calculator`` its defaults name. A mix whose every key starts with ``+`` extends
the mix below it instead (those entries set or added, the others kept)::

    env:
      mix: {my_env: 1.0}         # exactly {my_env: 1.0}, whatever the defaults said
    sft:
      env_mix: {+my_env: 1.0}    # the inherited warm-start mix plus my_env

On the command line ``env.mix={my_env: 1.0}`` replaces the mix (mind the space after the colon: YAML
reads ``{my_env:1.0}`` as one key without a weight, which is rejected), while ``env.mix={+my_env: 1.0}``
and ``env.mix.my_env=1.0`` set one entry. A curriculum stage's ``mix`` replaces ``env.mix`` for that
stage; written with ``+`` keys it is ``env.mix`` plus those entries. ``env.kwargs`` and
``sft.env_kwargs`` merge key by key like every other dict. ``python -m rl.train`` prints the resolved
mixes, stages and warm-start data before it starts anything.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl import algorithms
from rl.config_checks import (  # noqa: F401 (the constants and env_kwarg_names: re-exported)
    DRIVER_SET_ENGINE_KEYS,
    GYM_MAKE_KEYS,
    RESUME_MODES,
    config_errors,
    env_kwarg_names,
    nested_key_errors,
)

CONFIGS_ROOT = Path(__file__).resolve().parent.parent / "configs"
GROUP_TARGETS = {"model": "model.arch", "env": "env", "exp": ""}


class ConfigError(ValueError):
    """A configuration is unusable; the message names the key and the reason."""


# --------------------------------------------------------------------------- model


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights; weight sync then ships adapters only."""
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """peft target module names; "all-linear" means every nn.Linear except the LM head."""
    target_parameters: list[str] = field(default_factory=lambda: ["experts.gate_up_proj", "experts.down_proj"])
    """peft target parameters: the routed experts' stacked weights (``model.lora.ROUTED_EXPERTS``, one adapter
    per expert); [] leaves the routed experts frozen. peft adapts parameters only without LoRA dropout."""
    sync: str = "merged"
    """Weights shipped to rollout workers: merged (adapters folded into full weights by the learner)
    or adapter (adapter tensors only; workers fold them into their copy of the base weights,
    rollout/adapters.py). Adapter sync ships nothing but the adapters, so it cannot carry an
    updated balancing bias (learner.balancer=update)."""


@dataclass
class ModelConfig:
    arch: dict[str, Any] = field(default_factory=dict)
    """``model.HybridConfig`` fields (a preset from configs/model/ plus overrides); unknown keys, here and
    in ``linear_attn_config``, are rejected before the run starts (``check_nested_keys``)."""
    init_from: str | None = None
    """Checkpoint directory to start from (e.g. the SFT warm start); None = random init."""
    seed: int = 0
    """Seed of the random initialisation (unset in the YAML: the run's top-level ``seed``)."""
    tokenizer: str = "project"
    """The tokenizer and chat template the rollouts render with and the engines load: project (the
    tiny tokenizer of rollout/assets with our ChatML layout: the quickstart's), checkpoint (the one in
    ``init_from``: its tokenizer files and chat template, e.g. a converted Kimi Linear checkpoint's), or
    the path of a directory holding a Hugging Face tokenizer with a chat template. Not project: the
    template must render tools, tool calls and tool results (rollout/template_renderer.py); checked
    before the run starts, with the model's vocab_size covering the tokenizer."""
    template_check: str = "error"
    """A chat template that cannot keep token-in-token-out exactness (a start-up probe renders a
    conversation turn by turn and at once, e.g. one that strips earlier <think> reasoning): error
    (the run does not start) or warn (it starts, warned: RL trains on the ids the engines saw, which
    are not what the template renders for the same conversation)."""

    def tokenizer_dir(self) -> str | None:
        """The directory of the run's tokenizer; None for the project's tiny tokenizer. ConfigError for
        ``checkpoint`` without ``init_from`` (a config file may leave it to the command line, as
        configs/exp/from_checkpoint.yaml does; ``rl.preflight`` refuses to start such a run)."""
        if self.tokenizer == "project":
            return None
        if self.tokenizer == "checkpoint" and not self.init_from:
            raise ConfigError("model.tokenizer: checkpoint takes the tokenizer from model.init_from, which is "
                              "unset: set model.init_from=DIR (e.g. a converted checkpoint) or model.tokenizer=DIR")  # fmt: skip
        return self.init_from if self.tokenizer == "checkpoint" else self.tokenizer


# --------------------------------------------------------------------------- env


@dataclass
class EnvConfig:
    mix: dict[str, float] = field(default_factory=lambda: {"Calculator": 1.0})
    """Training data mix: env registry id -> sampling weight (a curriculum stage may override it)."""
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Constructor kwargs per env id (checked against the env constructor's parameters before the run)."""
    eval_env: str = "Calculator"
    """Env id of the held-out evaluation."""
    num_eval_tasks: int = 64
    """Held-out tasks per evaluation (greedy, one episode per task)."""
    eval_offset: int = 0
    """Held-out tasks are the test split's task_index eval_offset + i (train and test splits are disjoint)."""
    seed: int = 0
    """Unset in the YAML: the run's top-level ``seed``."""


# --------------------------------------------------------------------------- rollout


@dataclass
class RolloutConfig:
    num_workers: int = 1
    """Rollout worker actors (one vLLM engine each)."""
    worker_num_cpus: float = 1.0
    worker_num_gpus: float | None = None
    """Ray GPUs reserved per rollout worker (rl/placement.py). Unset: 1 on a cluster with GPUs, else 0.
    A fraction shares a GPU (with the learner or other workers); bound the engine's memory with
    engine.gpu_memory_utilization or engine.kv_cache_memory_bytes then. learner.weight_sync=nccl needs a
    GPU of its own per engine (NCCL cannot put two ranks on one GPU); ipc needs the learner's GPU."""
    group_size: int = 8
    """Episodes per task (G): the unit of group baselines."""
    tasks_per_step: int = 8
    """Tasks per RL step; the step trains on tasks_per_step * group_size episodes."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_context_tokens: int = 1024
    """Budget of the whole episode in tokens (prompt + all turns); a curriculum stage may override it."""
    episode_timeout_s: float = 120.0
    """Wall-clock budget of an episode's env and tool work; time waiting for the engine's turns does not
    count (the token budgets bound it), so a loaded machine does not time whole batches out."""
    max_episode_retries: int = 1
    """Times an episode that failed for infrastructure reasons (worker died) is re-run before the step fails."""
    max_env_error_fraction: float = 0.5
    """The run stops (exit code 3, checkpoints and metrics so far kept) when more than this fraction of a
    step's episodes failed in the env (its constructor, reset or step raised); below it, the failed
    episodes are left out of the loss and the run goes on. Every failure is in ``errors.jsonl``."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Extra engine keyword arguments passed to the rollout worker (e.g. kv_cache_memory_bytes): fields of
    ``rollout.worker.WorkerConfig``, unknown ones rejected before the run (``check_nested_keys``)."""
    seed: int = 0
    """Sampling seed of the engines (worker i gets seed + i); unset in the YAML: the run's ``seed``."""


# --------------------------------------------------------------------------- algorithm


@dataclass
class AlgorithmConfig:
    """The objective. ``name`` picks a preset row from ``rl/algorithms.py``; fields left null take it."""

    name: str = "grpo"
    credit: str = "outcome"
    """outcome: the episode reward broadcast over all sampled tokens; turn: per-turn rewards, discounted
    returns across turns; gae: turn-level GAE with a value head read at turn boundaries."""
    gamma: float = 1.0
    """Discount across turns (credit=turn or gae)."""
    lam: float = 0.95
    """GAE lambda across turns."""
    baseline: str | None = None
    std_norm: str | None = None
    ratio_level: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (None: off)."""
    loss_agg: str | None = None
    norm_tokens: int = 512
    """Constant normaliser for loss_agg=constant: per-episode token budget."""
    dynamic_sampling: bool | None = None
    max_resample_rounds: int = 2
    """Dynamic sampling: extra collection rounds to refill dropped groups."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap on pi_old / pi_rollout per token (None: off)."""
    vf_coef: float | None = None
    value_clip: float | None = 0.2
    ppo_epochs: int = 1
    num_minibatches: int = 1
    """Optimizer steps per RL step = ppo_epochs * num_minibatches."""
    adv_eps: float = 1e-6

    def resolved(self) -> AlgorithmConfig:
        """A copy with every null field filled from the preset row."""
        row = algorithms.preset(self.name)
        values = {
            k: (row[k] if getattr(self, k) is None and k in row else getattr(self, k)) for k in _fields(self)
        }
        return AlgorithmConfig(**values)


# --------------------------------------------------------------------------- reward


@dataclass
class RewardFunctionConfig:
    """One reward function of the rubric: ``{fn: ..., weight: 1.0, kwargs: {...}, name: ...}``."""

    fn: str = ""
    """A built-in name (``rewards.BUILTIN_REWARDS``: exact_match, answer_equivalence, solved, env_reward,
    format_compliance, ...), the name of an entry point in the ``longhorizon.rewards`` group, or a
    ``"module:attr"`` string (a module importable by the driver, e.g. on PYTHONPATH)."""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function (checked against its signature before the run starts)."""
    name: str | None = None
    """Name in metrics (``reward/fn/<name>``) and ``episode.reward_breakdown``; None: the spec's last part
    (``"mypkg.rewards:reversed_ok"`` -> ``reversed_ok``). Names must be unique."""


@dataclass
class RewardConfig:
    """The training and evaluation reward: a ``rewards.Rubric`` of weighted functions.

    Without functions (the default) an episode's reward is the env's own: the sum of its per-turn
    rewards, whatever the episode's status. With functions the reward is the rubric's weighted sum
    only (list ``{fn: env_reward}`` to keep the env's reward as one term); each function's unweighted
    mean over the episodes it scored is logged as ``reward/fn/<name>`` (``eval/fn/<name>`` in evaluation).

    Short-circuits, and how they differ from the env reward:

    - TRUNCATED episodes (a turn, token, context or time budget ran out): with ``truncated_reward``
      null they are scored by the functions like any other, as the env reward scores them (functions
      can read ``episode.status``); a number gives every truncated episode exactly that reward and
      skips the functions (e.g. 0 so that shaping terms cannot reward running out of budget; note that
      it also skips penalties, so a truncated episode can then score above a finished wrong one).
    - ERROR episodes (the env, a tool or the worker failed) get ``error_reward`` and stay out of the
      loss anyway (rl/rollouts.py); the env reward gives them what the env returned before failing.
    - A function that raises (or returns a non-finite value or a non-number) gives that episode
      ``error_reward`` as its total; the other functions' values are still recorded, the error text is
      kept in ``episode.info["reward_error"]``, the episode is counted in ``reward/errors`` (the
      fraction of episodes scored with the error reward, ERROR episodes included) and
      ``reward/fn_errors`` (a count), and the run goes on. Such an episode trains with ``error_reward``.
    """

    functions: list[RewardFunctionConfig] = field(default_factory=list)
    """Empty: the env reward, and nothing below applies."""
    truncated_reward: float | None = None
    """None: truncated episodes are scored by the functions; a number: their reward, functions skipped."""
    error_reward: float = 0.0
    """The reward of ERROR episodes and of episodes on which a function raised (see above)."""


# --------------------------------------------------------------------------- learner


@dataclass
class LearnerConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch (gradient accumulation over micro-batches)."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    dtype: str = "float32"
    """Autocast dtype for forward: float32 or bfloat16 (bfloat16 needs a GPU). With bfloat16 the matmuls
    compute in bf16 while parameters, gradients and AdamW state stay fp32 (fp32 master weights)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them, over ``checkpoint_scope``."""
    checkpoint_scope: str = "layer"
    """With activation_checkpointing: layer (attention and FFN of every decoder layer), ffn (only the
    FFN / MoE sub-blocks: the attention kernels' outputs are kept, the wide expert activations are
    recomputed), or attention (only the attention sub-blocks)."""
    fast_paths: str = "auto"
    """``model.fast``: auto (each op's fast path where it pays on the device), reference (the readable
    loops), or per op, e.g. "moe=loop,attention=flex"."""
    compile: bool = False
    """Regional torch.compile of the element-wise regions (norms, AttnRes mixes, expert GLUs); a region
    whose compilation fails runs eagerly (warned once), so a run never stops on it."""
    compile_scope: str = "auto"
    """With compile: regions (the element-wise regions alone), moe (also every MoE block whole: one graph
    for all MoE layers, its element-wise work fused across the router, permutation and projections),
    blocks (the MoE blocks, every KDA layer whole: in training its convolutions and kernel inside, one graph
    each way; and every MLA layer on the varlen attention), or
    auto: blocks on a GPU (gpu_1b on the H200: 334 ms per step against 402 with regions), regions on CPU."""
    cuda_graphs: bool = False
    """With compile on a CUDA device (a single-process learner): every compiled block (MoE, KDA and MLA layers)
    replays as CUDA graphs (inductor's cudagraph trees), one launch for a block's kernels instead of one each. A
    graph is recorded per micro-batch shape, so each micro-batch is padded to a multiple of micro_batch_tokens /
    token_buckets with one filler sequence (zero loss weight, left out of the routing statistics) and its
    sequences to a power of two, on a static layout (``model.layers.seq_layout(static=True)``). gpu_1b at 16K
    tokens on an H100: 172 ms a step against 188 ms compiled without graphs (bench/RESULTS.md, 2026-12-06)."""
    token_buckets: int | None = None
    """Micro-batch sizes the learner pads to: multiples of ceil(micro_batch_tokens / token_buckets) tokens.
    None: 8 with cuda_graphs, else no padding."""
    routing_replay: bool = True
    """Replay the rollout's expert choices in the learner forward (R3); gate weights are recomputed."""
    balancer: str = "frozen"
    """MoE balancing bias during RL: frozen, or update (recomputed each step and shipped with weights)."""
    num_cpus: float = 1.0
    """Ray CPUs reserved for the learner actor."""
    num_gpus: float | None = None
    """Ray GPUs reserved per learner rank (rl/placement.py). Unset: 1 when the learner runs on CUDA
    (device cuda, or auto on a cluster with GPUs), else 0. A fraction shares the GPU with rollout
    workers (colocation, e.g. 0.5 with rollout.worker_num_gpus=0.5); sharded ranks take whole GPUs."""
    torch_threads: int | None = 1
    """torch intra-op threads of the learner process (None: torch's default). On a few shared cores
    one thread is fastest for tiny models: OpenMP spinning on small ops costs more than it gains."""
    seed: int = 0
    """Unset in the YAML: the run's top-level ``seed``."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    num_workers: int = 1
    """Learner ranks (Ray actors, one per GPU or a CPU process each) forming one torch.distributed
    process group (NCCL on GPU, gloo on CPU); each mini-batch's micro-batches are spread over them by
    token count (rl/learner_group.py). 1: the single learner."""
    sharding: str = "auto"
    """auto: FSDP2 (rl/parallel.py) when num_workers > 1, the plain learner at 1; fsdp: FSDP2 also at 1
    worker (a multi-GPU run's code path at world size 1); none: never (only with num_workers=1)."""
    expert_parallel: int = 1
    """Expert parallelism of the sharded learner (rl/parallel.py): the learner ranks form a dp x ep mesh
    and each rank holds E / ep routed experts of every MoE layer, tokens sent to them by all-to-all
    (kernels/moe/ep.py); the rest is sharded by FSDP2 as without it. Must divide learner.num_workers and
    the model's num_experts; 1: every rank holds (its FSDP shard of) all experts."""
    weight_sync: str = "directory"
    """How new weights reach the rollout workers (rl/weight_sync.py): directory (a checkpoint directory
    under run.dir that every worker reads), object_store (buckets through Ray's object store, no files),
    nccl (buckets broadcast over a process group of the learner and the workers: NCCL when every end is
    on CUDA, each on a GPU of its own (rollout.worker_num_gpus=1), gloo otherwise), ipc (a learner
    sharing its GPU with the engines, or CPU learner and engines on one host: each bucket stays in the
    learner's device buffers, the workers map them by CUDA IPC or shared-memory handle and copy in place;
    an engine on another GPU is refused)."""
    sync_bucket_mb: float = 256
    """Largest bucket of gathered parameters (MiB) an export or sync holds in one host buffer."""
    sync_timeout_s: float = 300
    """weight_sync=nccl: the broadcast group's timeout; a worker that never joins a collective makes the
    sync fail after it, naming the worker, instead of hanging. weight_sync=ipc: the longest a worker may
    take to load one bucket."""


# --------------------------------------------------------------------------- sft


@dataclass
class SFTConfig:
    enabled: bool = False
    """In rl.train: run the warm start first when model.init_from is unset."""
    env_mix: dict[str, float] = field(default_factory=lambda: {"Calculator": 1.0})
    env_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Constructor kwargs per env id for the warm start's expert data and its check, merged over
    ``env.kwargs`` (e.g. an easier difficulty than RL trains on)."""
    num_episodes: int = 256
    """Scripted-expert episodes to train on."""
    epochs: int = 2
    batch_episodes: int = 16
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: all epochs)."""
    target_success: float | None = None
    """Stop as soon as the warm start's greedy success on ``num_check_tasks`` validation tasks (train split,
    none of them a warm-start task), measured through a rollout engine every ``check_every`` steps,
    reaches this value. None: train for ``max_steps`` / all epochs. A target the warm start never
    reaches is reported (console, sft_metrics.json), not hidden."""
    check_every: int = 25
    num_check_tasks: int = 64
    lr: float = 1e-3
    warmup_steps: int = 10
    output_dir: str = ""
    """Checkpoint directory; empty = <run_dir>/sft."""
    seed: int = 0
    """Expert-episode sampling and batch order; unset in the YAML: the run's top-level ``seed``."""


# --------------------------------------------------------------------------- curriculum


@dataclass
class NIAHConfig:
    enabled: bool = True
    num_samples: int = 8
    lengths: list[int] = field(default_factory=list)
    """Haystack lengths in tokens; empty = the stage's max_context_tokens."""


@dataclass
class StageConfig:
    name: str = "stage"
    steps: int = 10
    max_context_tokens: int | None = None
    mix: dict[str, float] | None = None
    tasks_per_step: int | None = None
    group_size: int | None = None
    max_tokens_per_turn: int | None = None


@dataclass
class CurriculumConfig:
    stages: list[StageConfig] = field(default_factory=list)
    """Empty: one stage of ``steps`` steps with the rollout/env settings."""
    steps: int = 10
    niah: NIAHConfig = field(default_factory=NIAHConfig)


# --------------------------------------------------------------------------- run, logging, ray


@dataclass
class RunConfig:
    dir: str = "runs/${name}"
    save_every: int = 10
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    resume: str = "auto"
    """auto (or true): resume from the newest checkpoint in ``dir`` when there is one, refused (exit 2,
    differing keys listed) when the config differs from the one the run last ran with, apart from
    ``RESUME_FREE_KEYS`` (rl/rundir.py); force: resume anyway, the change recorded (config.<n>.yaml,
    config_changes.jsonl, ``run/config_version``); never (or false): start over, an earlier run in
    ``dir`` moved to ``dir/previous/<n>/``."""
    eval_every: int = 0
    """Held-out eval every N steps (always before the first and after the last step); 0 = only those."""
    tensorboard: bool = True
    plots: bool = True
    progress_bar: bool = True
    no_signal_steps: int = 3
    """Warn (console and summary.json) after this many consecutive steps without learning signal: every
    group's rewards identical (group baselines) or every reward equal (batch baselines); rl/signal.py.
    0 = no such warning."""
    stop_after_steps: int | None = None
    """Stop (after checkpointing) once this many steps ran in this process: for kill-and-resume tests."""
    verbose: bool = False
    """Library chatter on the console: vLLM's and Ray's INFO lines, weight-saving/loading progress bars,
    library FutureWarnings. False (default): warnings and errors only, so the run's own progress
    stays readable (rl/console.py says what is set where)."""
    transcripts_per_step: int = 4
    """Episodes per training step (and per evaluation) written to ``transcripts/`` for reading: at least
    one success, one failure and one env error when the step has them (rl/transcripts.py); 0 = none."""

    def __post_init__(self) -> None:
        # YAML/CLI booleans reach a str field as "True"/"False": the old bool spellings keep working
        self.resume = {"true": "auto", "false": "never"}.get(str(self.resume).lower(), self.resume)


@dataclass
class RayConfig:
    address: str | None = None
    """None: join the cluster of ``ray job submit`` / RAY_ADDRESS, else start a local one."""
    num_cpus: int | None = None
    """CPUs of a locally started cluster (None: all)."""
    object_store_memory: int = 1_000_000_000
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    name: str = "run"
    seed: int = 0
    """The run's seed. Every section's ``seed`` (model init, SFT data and order, engine sampling, learner,
    env) that the YAML files and overrides leave unset takes this value; training tasks derive from it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)


# --------------------------------------------------------------------------- loading


def _fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _compose(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load one YAML file with its ``defaults`` list merged underneath it."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"defaults cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    defaults = node.pop("defaults", [])
    if not isinstance(defaults, ListConfig | list):
        raise ConfigError(f"{path}: 'defaults' must be a list")
    parts = [_load_default(entry, path, (*seen, path)) for entry in defaults]
    return _merge(*parts, node) if parts else node


MIX_FIELDS = ("env.mix", "sft.env_mix")
"""Data mixes (env id -> weight) that a layer replaces instead of merging into (module docstring)."""
EXTEND = "+"
"""A mix whose every key starts with this extends the mix below it instead of replacing it."""


def _merge(*layers: DictConfig) -> DictConfig:
    """``OmegaConf.merge`` with the mix rule of the module docstring: a layer that sets a mix of
    ``MIX_FIELDS`` replaces the mix below it, one whose keys all start with ``EXTEND`` is merged into it.
    An extension stays marked while nothing below sets that mix (a file's ``defaults`` may not), so it
    extends whatever the later-merged lower layers (in the end the schema's default) hold."""
    out = layers[0]
    for layer in layers[1:]:
        out, layer = _apply_mix_rule(out, layer)
        out = OmegaConf.merge(out, layer)
    return out


def _apply_mix_rule(base: DictConfig, layer: DictConfig) -> tuple[DictConfig, DictConfig]:
    """``base`` with each mix that ``layer`` replaces emptied, ``layer`` with its extensions unmarked
    where ``base`` has a mix to extend (copies; the inputs are not changed)."""
    _check_stage_mixes(layer)
    for key in MIX_FIELDS:
        mix = OmegaConf.select(layer, key)
        if not isinstance(mix, DictConfig):
            continue  # unset (or not a mapping: the schema rejects it by name)
        entries, extends = _mix_entries(key, mix)
        below = OmegaConf.select(base, key)
        if extends and (not isinstance(below, DictConfig) or _mix_entries(key, below)[1]):
            continue  # nothing below to extend yet: stays marked
        layer = copy.deepcopy(layer)
        OmegaConf.update(layer, key, entries, merge=False)
        if not extends and isinstance(below, DictConfig):
            base = copy.deepcopy(base)
            OmegaConf.update(base, key, {}, merge=False)
    return base, layer


def _mix_entries(key: str, mix: Any) -> tuple[dict[str, Any], bool]:
    """A mix's entries with the ``EXTEND`` marker dropped, and whether it extends. A key without a
    weight (YAML's ``{my_env:1.0}``) or a mix with some keys marked and some not is a ConfigError."""
    entries = OmegaConf.to_container(mix, resolve=False) if isinstance(mix, DictConfig) else dict(mix)
    for k, w in entries.items():
        if w is None:
            env, _, number = str(k).rpartition(":")
            yaml_slip = env and _is_number(number)  # {my_env:1.0}: no space after the colon
            hint = f" (YAML reads {{{k}}} as one key: write {{{env}: {number}}})" if yaml_slip else ""
            raise ConfigError(f"{key}.{k}: no weight{hint}")
    marked = [str(k).startswith(EXTEND) for k in entries]
    if any(marked) and not all(marked):
        raise ConfigError(f"{key}: every key starts with {EXTEND!r} (extend the inherited mix) or none does "
                          f"(replace it), got {sorted(map(str, entries))}")  # fmt: skip
    extends = bool(entries) and all(marked)
    return ({str(k).removeprefix(EXTEND): w for k, w in entries.items()} if extends else entries), extends


def _is_number(text: str) -> bool:
    return re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text) is not None


def _check_stage_mixes(layer: DictConfig) -> None:
    """A stage mix's spelling is checked where the layer is read (its ``EXTEND`` keys resolve later)."""
    stage_list = OmegaConf.select(layer, "curriculum.stages")
    if isinstance(stage_list, ListConfig):
        for i, s in enumerate(stage_list):
            if isinstance(s, DictConfig) and isinstance(s.get("mix"), DictConfig):
                _mix_entries(f"curriculum.stages[{i}].mix", s.mix)


def _override_layers(overrides: list[str] | tuple[str, ...]) -> list[DictConfig]:
    """One layer per ``key=value`` override, merged in order. An override of one entry of a mix
    (``env.mix.my_env=1.0``) sets that entry: its layer extends the mix rather than replacing it."""
    layers = []
    for o in overrides:
        key = o.split("=", 1)[0]
        layer = OmegaConf.from_dotlist([o])
        for mix_key in MIX_FIELDS:
            mix = OmegaConf.select(layer, mix_key)
            if key.startswith(mix_key + ".") and isinstance(mix, DictConfig):
                marked = {EXTEND + str(k).removeprefix(EXTEND): w for k, w in mix.items()}
                OmegaConf.update(layer, mix_key, marked, merge=False)
        layers.append(layer)
    return layers


def _resolve_stage_mixes(cfg: TrainConfig) -> None:
    """A stage mix with ``EXTEND`` keys becomes ``env.mix`` plus those entries."""
    for i, s in enumerate(cfg.curriculum.stages):
        if s.mix:
            entries, extends = _mix_entries(f"curriculum.stages[{i}].mix", s.mix)
            s.mix = {**cfg.env.mix, **entries} if extends else entries


def _load_default(entry: Any, parent: Path, seen: tuple[Path, ...]) -> DictConfig:
    if isinstance(entry, str):
        p = Path(entry if entry.endswith(".yaml") else entry + ".yaml")
        return _compose(p if p.is_absolute() else parent.parent / p, seen)
    if isinstance(entry, DictConfig | dict) and len(entry) == 1:
        group, name = next(iter(entry.items()))
        if group not in GROUP_TARGETS:
            raise ConfigError(f"{parent}: unknown defaults group {group!r}; known: {sorted(GROUP_TARGETS)}")
        node = _compose(CONFIGS_ROOT / group / f"{name}.yaml", seen)
        target = GROUP_TARGETS[group]
        for key in reversed(target.split(".") if target else []):
            node = OmegaConf.create({key: node})
        return node
    raise ConfigError(f"{parent}: a defaults entry must be 'path' or 'group: name', got {entry!r}")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Schema <- YAML (with defaults) <- ``key=value`` overrides; validated; plain dataclasses out."""
    schema = OmegaConf.structured(TrainConfig)
    layers = [_compose(Path(path))] if path else []
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must be key=value, got {bad}")
    try:
        merged = _merge(schema, *layers)
        for override, layer in zip(overrides, _override_layers(overrides)):
            layers.append(layer)
            try:
                merged = _merge(merged, layer)
            except TypeError as e:  # OmegaConf cannot merge a mapping into a list
                raise ConfigError(f"override {override!r}: {e}; a list (e.g. curriculum.stages) is set "
                                  "as a whole: curriculum.stages=[{name: a, steps: 5}, ...]") from None  # fmt: skip
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path or '<schema>'}: {_explain(e)}") from None
    _resolve_stage_mixes(cfg)
    _derive_seeds(cfg, layers)
    cfg.algorithm = cfg.algorithm.resolved() if cfg.algorithm.name in algorithms.PRESETS else cfg.algorithm
    validate(cfg)
    return cfg


SEEDED_SECTIONS = ("model", "env", "rollout", "learner", "sft")


def _derive_seeds(cfg: TrainConfig, layers: list[DictConfig]) -> None:
    """A section seed no layer sets follows the top-level ``seed``, so ``seed=1`` changes every
    random choice of the run (init, warm-start data and order, sampling), not only the task draw."""
    for section in SEEDED_SECTIONS:
        if all(OmegaConf.select(layer, f"{section}.seed") is None for layer in layers):
            getattr(cfg, section).seed = cfg.seed


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"key '{key}': {msg}" if key else msg


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# --------------------------------------------------------------------------- checks (rl/config_checks.py)


def validate(cfg: TrainConfig) -> None:
    """Cross-field rules the types cannot express; raises ConfigError listing every problem."""
    _raise_if_any(config_errors(cfg))


def check_nested_keys(cfg: TrainConfig) -> None:
    """Reject unknown keys inside ``model.arch`` (``HybridConfig``'s constructor parameters and the
    ``linear_attn_config`` keys), ``rollout.engine`` (``rollout.worker.WorkerConfig`` fields the driver
    does not set) and ``env.kwargs.<Env>`` / ``sft.env_kwargs.<Env>`` (the env constructor's keyword
    parameters), which the schema types only as dicts: a typo there would otherwise load and be ignored
    or fail in an actor minutes later. Imports the model config, the worker and the env registry
    lazily (loading a config stays import-light). Raises ConfigError listing every problem."""
    _raise_if_any(nested_key_errors(cfg))


def _raise_if_any(errors: list[str]) -> None:
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


# --------------------------------------------------------------------------- views of a loaded config


def stages(cfg: TrainConfig) -> list[StageConfig]:
    """The curriculum's stages with every null field filled from the rollout/env config."""
    raw = cfg.curriculum.stages or [StageConfig(name="main", steps=cfg.curriculum.steps)]
    r = cfg.rollout
    return [
        StageConfig(
            name=s.name,
            steps=s.steps,
            max_context_tokens=s.max_context_tokens or r.max_context_tokens,
            mix=dict(s.mix) if s.mix else dict(cfg.env.mix),
            tasks_per_step=s.tasks_per_step or r.tasks_per_step,
            group_size=s.group_size or r.group_size,
            max_tokens_per_turn=s.max_tokens_per_turn or r.max_tokens_per_turn,
        )
        for s in raw
    ]
