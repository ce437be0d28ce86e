"""Functions that run inside vLLM's model-runner process (sent with ``collective_rpc``).

They are module-level so they pickle by reference when the engine core is another process
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is then needed for callables).

``install_step_recorder`` wraps the model runner so that after every real forward it knows, per
request, how many tokens were computed and which experts each token was routed to. Tokens of a
step are laid out request by request in the runner's ``input_batch.req_ids`` order, with
``scheduler_output.num_scheduled_tokens[req_id]`` tokens each; that is how the first rows of our
model's ``routed_experts_TLK`` buffer are split per request. The recorder is the ground truth
for "prefill tokens actually computed" in the reuse benchmark, for every caching mode alike, and the
source of the routing replay records: ``RolloutWorker`` looks each turn's prompt and sampled tokens
up by position (a position with no record was not computed, e.g. a prefix-cache hit).

``install_sampled_logprobs`` makes the same records carry the sampled tokens' logprobs: the runner's
sampler computes them as vLLM's own ``logprobs=0`` path does (the engine's ``logprobs_mode``, so the
same tensor vLLM would gather from), and the values go to the host with the step's routes instead of
through vLLM's per-request logprob outputs, whose host work (ranks, lists per request and step, the
output processor's appends) made a 64-sequence decode step on an H100 0.8-1 ms longer (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What the engine computed for one (internal) request id since the last fetch."""

    num_computed_tokens: int = 0
    positions: list[np.ndarray] = field(default_factory=list)  # [n] absolute positions per step
    routed: list[np.ndarray] = field(default_factory=list)  # [n, L, K] int16 per step
    # the sampled tokens' logprobs by the position the token was sampled for (install_sampled_logprobs)
    sampled: dict[int, float] = field(default_factory=dict)

    def sampled_logprobs(self, first: int, n: int) -> list[float]:
        """The logprobs of the tokens sampled for positions first .. first + n - 1 (a request's turn: first
        is its prompt length). A position with no record is an error: its token was not sampled by a step
        this record saw."""
        missing = [q for q in range(first, first + n) if q not in self.sampled]
        if missing:
            raise RuntimeError(
                f"no sampled logprob recorded for positions {missing[:8]}{'...' if len(missing) > 8 else ''} "
                f"(recorded: {len(self.sampled)} positions)"
            )
        return [self.sampled[q] for q in range(first, first + n)]


@dataclass
class _Step:
    """One forward's host copies (still in flight on a GPU until ``done`` is synchronised) and its layout:
    (request id, first row, rows) per request with scheduled tokens, in the runner's batch order."""

    spans: list[tuple[str, int, int]]
    positions_T: torch.Tensor | None
    routed_TLK: torch.Tensor | None
    done: torch.cuda.Event | None
    sampled_R: torch.Tensor | None = None  # [requests] fp32, the logprob of each span's sampled token


class StepRecorder:
    """Per-request records of the forwards since the last ``pop``.

    A step's positions and routes are copied device -> host asynchronously (pinned memory, one CUDA event
    per step) and split per request only when records are popped: a blocking copy after every forward
    would stall the host until the GPU finished that forward, which undoes vLLM's async scheduling (the
    next step's scheduling and input preparation overlapping this step's GPU work)."""

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = defaultdict(RequestRecord)
        self.steps: list[_Step] = []
        self.scheduler_output = None
        self.unsampled: _Step | None = None  # the last real forward, until its tokens are sampled

    def record(self, runner, positions: torch.Tensor | None, routed_TLK: torch.Tensor | None) -> None:
        sched = self.scheduler_output
        if sched is None:  # a dummy / profiling forward
            return
        spans, offset = [], 0
        for req_id in runner.input_batch.req_ids:
            n = int(sched.num_scheduled_tokens.get(req_id, 0))
            if n:
                spans.append((req_id, offset, n))
                offset += n
        if not spans:
            return
        pos_T = routed = done = None
        if positions is not None:
            pos_T = _host_copy(positions[:offset])
            if routed_TLK is not None:  # a copy: the model's buffer is rewritten by the next forward
                routed = _host_copy(routed_TLK[:offset], torch.int16)
            if positions.is_cuda:
                done = torch.cuda.Event()
                done.record()  # after both copies, on the forward's stream
        self.steps.append(_Step(spans, pos_T, routed, done))
        self.unsampled = self.steps[-1] if pos_T is not None else None

    def record_sampled(self, logprobs_R: torch.Tensor) -> None:
        """The sampled tokens' logprobs of the last recorded forward, one a request in the batch's order (the
        sampler's rows: the runner's batch holds only the requests scheduled in the step). A sampler call
        with no recorded forward before it (a dummy run) records nothing."""
        step, self.unsampled = self.unsampled, None
        if step is None:
            return
        if logprobs_R.shape[0] != len(step.spans):  # not raised here: that would stop the engine for every request
            logger.warning("sampler rows %d != requests of the step %d: no logprobs recorded for this step",
                           logprobs_R.shape[0], len(step.spans))  # fmt: skip
            return
        step.sampled_R = _host_copy(logprobs_R, torch.float32)
        if step.done is not None:
            step.done.record()  # after this copy too

    def _drain(self) -> None:
        """Split the recorded steps into per-request records (waiting for their copies first)."""
        steps, self.steps = self.steps, []
        for step in steps:
            if step.done is not None:
                step.done.synchronize()
            pos_np = step.positions_T.numpy() if step.positions_T is not None else None
            routed_np = step.routed_TLK.numpy() if step.routed_TLK is not None else None
            sampled = step.sampled_R.tolist() if step.sampled_R is not None else None
            for i, (req_id, first, n) in enumerate(step.spans):
                rec = self.records[req_id]
                rec.num_computed_tokens += n
                if pos_np is not None:
                    rec.positions.append(pos_np[first : first + n])
                    if routed_np is not None:
                        rec.routed.append(routed_np[first : first + n])
                    if sampled is not None:  # the token sampled after the span's last position
                        rec.sampled[int(pos_np[first + n - 1]) + 1] = sampled[i]

    def pop(self, req_id: str) -> RequestRecord:
        if self.steps:
            self._drain()
        return self.records.pop(req_id, RequestRecord())


def _host_copy(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``x`` that owns its memory; from a GPU, into pinned memory without waiting."""
    dtype = dtype or x.dtype
    if not x.is_cuda:
        return x.to(dtype, copy=True)
    out = torch.empty(x.shape, dtype=dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    return out


def install_step_recorder(worker) -> bool:
    runner = worker.model_runner
    if getattr(runner, "_lh_recorder", None) is not None:
        return True
    recorder = StepRecorder()
    runner._lh_recorder = recorder
    orig_execute, orig_forward = runner.execute_model, runner._model_forward

    def execute_model(scheduler_output, *args, **kwargs):
        recorder.scheduler_output = scheduler_output
        try:
            return orig_execute(scheduler_output, *args, **kwargs)
        finally:
            recorder.scheduler_output = None

    def _model_forward(*args, **kwargs):
        out = orig_forward(*args, **kwargs)
        model = runner.get_model()
        recorder.record(runner, kwargs.get("positions"), getattr(model, "routed_experts_TLK", None))
        return out

    runner.execute_model = execute_model
    runner._model_forward = _model_forward
    return True


def install_sampled_logprobs(worker) -> bool:
    """Record the sampled tokens' logprobs with the step records (``RequestRecord.sampled``) for requests that
    ask vLLM for none (``SamplingParams.logprobs=None``). The runner's sampler is asked for the sampled tokens'
    logprobs (``max_num_logprobs=0``) as if a request wanted them, and its gather is replaced for that call by
    one that keeps the sampled tokens' values on the device and returns nothing to vLLM, so vLLM's host side
    sees no logprobs. When a request of the batch does want vLLM's logprobs, vLLM's gather runs as well and
    its output goes out as usual. Needs ``install_step_recorder`` first; returns True when installed."""
    runner = worker.model_runner
    recorder: StepRecorder | None = getattr(runner, "_lh_recorder", None)
    if recorder is None:
        raise RuntimeError("install_step_recorder must run before install_sampled_logprobs")
    sampler = runner.sampler
    if getattr(sampler, "_lh_sampled_logprobs", False):
        return True
    orig_forward = sampler.forward

    def forward(logits, sampling_metadata, *args, **kwargs):
        wanted = sampling_metadata.max_num_logprobs
        if wanted is not None and wanted < 0:  # the whole vocabulary's logprobs: vLLM's path alone
            return orig_forward(logits, sampling_metadata, *args, **kwargs)
        orig_gather = sampler.gather_logprobs

        def gather(logprobs, num_logprobs, token_ids):
            recorder.record_sampled(logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))
            return None if wanted is None else orig_gather(logprobs, num_logprobs, token_ids)

        sampling_metadata.max_num_logprobs = 0 if wanted is None else wanted
        sampler.gather_logprobs = gather
        try:
            return orig_forward(logits, sampling_metadata, *args, **kwargs)
        finally:
            sampling_metadata.max_num_logprobs = wanted
            del sampler.gather_logprobs  # back to the class's

    sampler.forward = forward
    sampler._lh_sampled_logprobs = True
    return True


def pop_request_records(worker, req_ids: list[str]) -> dict[str, RequestRecord]:
    recorder: StepRecorder = worker.model_runner._lh_recorder
    return {r: recorder.pop(r) for r in req_ids}


def set_turn_end_ids(worker, ids: list[int]) -> None:
    """The model's stale-step guard: the ids that end every turn (``rollout.vllm_layers.StaleStepGuard``)."""
    worker.model_runner.get_model().set_turn_end_ids(ids)


def load_weights_inplace(worker, path: str) -> int:
    """Copy the tensors of a safetensors file into the running model; returns how many were copied."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    return _copied(worker.model_runner.get_model().load_weights(tensors.items()))


def load_state_dict_inplace(worker, state_dict: dict[str, torch.Tensor]) -> int:
    return _copied(worker.model_runner.get_model().load_weights(state_dict.items()))


def _copied(loaded: set[str]) -> int:
    """Model tensors a ``load_weights`` call copied (its answer also names the paged-attention bookkeeping
    tensors, which no checkpoint carries; per-expert checkpoint tensors count as the stacked weights they
    fill)."""
    return sum(1 for n in loaded if not n.startswith("paged_mixers."))
