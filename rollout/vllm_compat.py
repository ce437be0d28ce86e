"""What our engines need from vLLM's scheduler and model runner, on the vLLM versions we run: a session's rollback
under the async scheduler, a decode step's KV-cache slots without vLLM's walk over its cache groups (the second part
of this module, ``install_decode_allocation``), and an async step's input ids without vLLM's loop over the batch
(the third, ``install_input_ids``). The plugin applies all three at registration.

The async scheduler plans step N+1 before step N's tokens are known. When a resumable request (a session,
``rollout.sessions``) stops at step N, step N+1 is already in flight for it: it feeds the stop token and
samples one more, stale, token. What must happen then, and what each version does:

* vLLM 0.31 and later (0.32 here; ``Scheduler._handle_stopped_request``) rolls the session back to its
  turn's end: its computed count drops by the in-flight tokens (the stop token counts as not fed, as under
  synchronous scheduling, and the next chunk starts with it) and the stale step's output is dropped when it
  returns (``drop_stale_output``).
* vLLM 0.26 to 0.30 do not: the stop token counts as fed, and 0.26 appends the stale token to the parked
  session, which, when it is a stop token again, queues the session twice (``Invalid request status:
  RUNNING``, seen on an H200). Each has the other half of the machinery, though: 0.27-0.30 the very
  ``drop_stale_output`` / ``num_stale_output_tokens`` that 0.31 uses (there for preemption), 0.26
  ``Request.async_tokens_to_discard`` (which its ``reset_prefix_cache`` uses to drop a preempted request's
  in-flight outputs).

``backport_session_rollback`` gives such a scheduler the 0.31 rollback with what it has; the plugin applies it
at registration (``rollout.vllm_plugin.register``), in every process that loads vLLM's plugins, the engine
core's included. It changes only resumable requests that stop with steps in flight, which only an async
scheduler has. The recurrent state of the stale step is the model's part (``rollout.vllm_layers.StaleStepGuard``).
"""

from __future__ import annotations

from collections.abc import Callable

NATIVE, BACKPORT, MISSING = "native", "backport", "missing"


def session_rollback() -> str:
    """How this vLLM's scheduler rolls a stopped session back: NATIVE (it does), BACKPORT (it can with
    ``backport_session_rollback``) or MISSING (neither: async sessions cannot run on it)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    handle = Scheduler._handle_stopped_request
    if getattr(handle, "rolls_back_sessions", False):  # backported already
        return BACKPORT
    if "num_output_placeholders" in handle.__code__.co_names:  # 0.31's rollback
        return NATIVE
    names = set(Request.__init__.__code__.co_names)  # the attributes a request sets
    return BACKPORT if names & {"drop_stale_output", "async_tokens_to_discard"} else MISSING


def roll_back_stopped(handle: Callable) -> Callable:
    """``Scheduler._handle_stopped_request`` wrapped: a resumable request that stops with async steps in flight
    first goes back to the frontier its outputs reached, and those steps' outputs are dropped on return (0.31's
    way where the request has ``drop_stale_output``, else 0.26's discard counter)."""

    def handle_stopped(self, request) -> bool:
        in_flight = request.num_output_placeholders
        if request.resumable and in_flight > 0:
            request.num_computed_tokens -= in_flight
            if hasattr(request, "drop_stale_output"):
                request.drop_stale_output = True
                request.num_stale_output_tokens = request.num_in_flight_tokens
            else:
                request.async_tokens_to_discard += in_flight
            request.num_output_placeholders = 0
        return handle(self, request)

    handle_stopped.rolls_back_sessions = True
    return handle_stopped


def backport_session_rollback() -> bool:
    """Patch this vLLM's scheduler when it is BACKPORT (once); True when the patch is in place."""
    if session_rollback() != BACKPORT:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    if not getattr(Scheduler._handle_stopped_request, "rolls_back_sessions", False):
        Scheduler._handle_stopped_request = roll_back_stopped(Scheduler._handle_stopped_request)
    return True


# --- a decode step's KV-cache slots ----------------------------------------------------------------------------
# Every step the scheduler asks ``KVCacheManager.allocate_slots`` for each running request's slots; for a decode
# token whose blocks already hold it that is a dozen calls per cache group that end in "nothing to allocate"
# (8 us a request on an H100 host's CPU, 0.5 ms of a 64-sequence decode step: bench/RESULTS.md). The fast path
# answers that case from the block tables alone and hands every other case to vLLM. It applies where nothing else
# can happen in the call: prefix caching off (nothing to cache), a running request with no prefix hit, lookahead,
# external or encoder tokens, every cache group a full-attention group or a recurrent-state group outside vLLM's
# "align" mode with no speculative blocks, and no copy-on-write pending. A recurrent-state group frees no block
# while the request's tokens fit its one block (vLLM keeps the last state only, and counts the tokens before it
# as skipped: none of a block is skipped until the tokens pass its size).
DECODE_ALLOC_ENV = "LONGHORIZON_DECODE_ALLOC"
DECODE_ALLOC_MODES = ("fast", "off", "check")  # check: take the fast answer, run vLLM's too, and compare
DECODE_ALLOC_COUNTS = {"fast": 0, "vllm": 0}


def decode_alloc_mode() -> str:
    import os

    mode = os.environ.get(DECODE_ALLOC_ENV, "fast")
    if mode not in DECODE_ALLOC_MODES:
        raise ValueError(f"{DECODE_ALLOC_ENV} must be one of {DECODE_ALLOC_MODES}, got {mode!r}")
    return mode


def _decode_groups(manager) -> tuple | None:
    """(group manager, the most tokens its block may hold and free nothing, its pending copy-on-write requests) per
    cache group when every group is of a kind the fast path knows and prefix caching is off; else None (also for a
    vLLM whose manager lacks what the fast path reads: its own path then, always)."""
    try:
        if manager.enable_caching:
            return None
        groups = []
        for m in manager.coordinator.single_type_managers:
            kind = type(m).__name__
            _ = (m.block_size, m.req_to_blocks)  # what every call reads: missing, this is another vLLM's manager
            if kind == "FullAttentionManager":
                most = float("inf")
            elif kind == "MambaManager" and m.mamba_cache_mode != "align" and not m.num_speculative_blocks:
                most = m.block_size
            else:
                return None
            groups.append((m, most, getattr(m, "_partial_hit_reqs", {})))  # no such dict: no copy-on-write either
        return tuple(groups)
    except AttributeError:
        return None


def _has_slots(manager, request, num_new_tokens: int, running) -> bool:
    """Whether the running ``request``'s blocks already hold ``num_new_tokens`` more tokens in every group, with
    nothing for vLLM to free or copy (the conditions above)."""
    groups = manager.__dict__.get("_decode_groups", False)
    if groups is False:
        groups = manager._decode_groups = _decode_groups(manager)
    if groups is None or request.status != running:
        return False
    need = request.num_computed_tokens + num_new_tokens
    if need > manager.max_model_len:
        return False
    rid = request.request_id
    for m, most, copies in groups:
        blocks = m.req_to_blocks.get(rid)
        if not blocks or need > len(blocks) * m.block_size or need > most or rid in copies:
            return False
    return True


def fast_decode_allocate(allocate: Callable, mode: str = "fast") -> Callable:
    """``KVCacheManager.allocate_slots`` wrapped with the fast path above (``mode`` "check": vLLM's answer is
    computed too, and a different one, or a changed block table, raises)."""
    from vllm.v1.request import RequestStatus

    running = RequestStatus.RUNNING

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        plain = not args and (not kwargs or (len(kwargs) == 1 and kwargs.get("num_lookahead_tokens", 1) == 0))
        if not (plain and _has_slots(self, request, num_new_tokens, running)):
            DECODE_ALLOC_COUNTS["vllm"] += 1
            return allocate(self, request, num_new_tokens, *args, **kwargs)
        DECODE_ALLOC_COUNTS["fast"] += 1
        if mode == "check":
            before = _table_lengths(self, request.request_id)
            blocks = allocate(self, request, num_new_tokens, *args, **kwargs)
            _check_same(request.request_id, blocks, before, _table_lengths(self, request.request_id))
        return self.empty_kv_cache_blocks

    allocate_slots.decode_fast_path = mode
    return allocate_slots


def _table_lengths(manager, rid: str) -> list[int]:
    return [len(m.req_to_blocks.get(rid, ())) for m, *_ in manager._decode_groups]


def _check_same(rid: str, blocks, before: list[int], after: list[int]) -> None:
    if blocks is None or any(blocks.blocks):
        raise AssertionError(f"decode fast path: vLLM answered {blocks} for {rid} where the fast path had room")
    if before != after:
        raise AssertionError(f"decode fast path: vLLM changed {rid}'s block tables {before} -> {after}")


def rewrap(owner: type, name: str, wrap: Callable[[Callable], Callable] | None) -> None:
    """Put ``wrap(vLLM's method)`` in ``owner.<name>`` (``__wrapped__``: vLLM's), or vLLM's own back for ``wrap``
    None: a second install replaces the fast path, never wraps it again."""
    current = getattr(owner, name)
    original = getattr(current, "__wrapped__", current)
    if wrap is None:
        setattr(owner, name, original)
        return
    fast = wrap(original)
    fast.__wrapped__ = original
    setattr(owner, name, fast)


def install_decode_allocation(mode: str | None = None) -> str:
    """Wrap this vLLM's ``KVCacheManager.allocate_slots`` with the decode fast path (once; ``mode`` None: the
    ``LONGHORIZON_DECODE_ALLOC`` environment variable, "fast" by default). Returns the mode in place."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    mode = decode_alloc_mode() if mode is None else mode
    if mode not in DECODE_ALLOC_MODES:
        raise ValueError(f"decode allocation mode must be one of {DECODE_ALLOC_MODES}, got {mode!r}")
    rewrap(KVCacheManager, "allocate_slots", None if mode == "off" else lambda vllm: fast_decode_allocate(vllm, mode))
    return mode


# --- a step's input ids under the async scheduler --------------------------------------------------------------
# Under async scheduling the tokens a running request sampled in the step before are still on the device, and
# ``GPUModelRunner._prepare_input_ids`` finds which requests of this step ran in that one with a Python loop over
# the batch, every decode step (60 us for 64 requests on our CPU machine: bench/input_ids.py). Without speculative
# tokens, prompt embeddings or a pipeline's pending receive, that loop's lists are selections of the step's arrays:
# the fast path takes them with numpy and issues the same copies (one slice copy when the batch kept its order, else
# the same scatter); every other case goes to vLLM's method. ``LONGHORIZON_INPUT_IDS=off`` leaves vLLM's in place.
INPUT_IDS_ENV = "LONGHORIZON_INPUT_IDS"
INPUT_IDS_MODES = ("fast", "off")
INPUT_IDS_COUNTS = {"fast": 0, "vllm": 0}  # steps each path prepared (tests read them)


def fast_prepare_input_ids(prepare: Callable) -> Callable:
    """``GPUModelRunner._prepare_input_ids`` wrapped with the vectorised path above (``prepare``: vLLM's)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu_model_runner import PIN_MEMORY as pin

    def _prepare_input_ids(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens) -> None:
        prev = self.input_batch.prev_sampled_token_ids
        if (prev is None or scheduler_output.scheduled_spec_decode_tokens or self.enable_prompt_embeds
                or getattr(self, "_pp_recv_work", None) is not None):  # fmt: skip
            INPUT_IDS_COUNTS["vllm"] += 1
            return prepare(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
        INPUT_IDS_COUNTS["fast"] += 1
        prev_positions = self.prev_positions.np[:num_reqs]
        common = prev_positions >= 0
        rows = prev_positions[common]  # each common request's row in the step before
        n = len(rows)
        if n < total_num_scheduled_tokens:  # new requests or prefill chunks: their ids come from the host
            self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        if n == 0:
            return
        last = np.asarray(cu_num_tokens[:num_reqs])[common] - 1  # each common request's last token in this step
        if last.max() == n - 1 and np.array_equal(rows, last):  # the batch kept its order: one slice
            self.input_ids.gpu[:n].copy_(prev[:n, 0], non_blocking=True)
            return
        index = torch.tensor(last, dtype=torch.int64, pin_memory=pin).to(self.device, non_blocking=True)
        src = torch.tensor(rows, dtype=torch.int64, pin_memory=pin).to(self.device, non_blocking=True)
        self.input_ids.gpu.scatter_(dim=0, index=index, src=prev[src, 0])

    return _prepare_input_ids


def install_input_ids(mode: str | None = None) -> str:
    """Put the fast path above in ``GPUModelRunner._prepare_input_ids`` (once; ``mode`` None: the
    ``LONGHORIZON_INPUT_IDS`` environment variable, "fast" by default), or take it out ("off"). Returns the mode."""
    import os

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    mode = os.environ.get(INPUT_IDS_ENV, "fast") if mode is None else mode
    if mode not in INPUT_IDS_MODES:
        raise ValueError(f"{INPUT_IDS_ENV} must be one of {INPUT_IDS_MODES}, got {mode!r}")
    rewrap(GPUModelRunner, "_prepare_input_ids", None if mode == "off" else fast_prepare_input_ids)
    return mode
