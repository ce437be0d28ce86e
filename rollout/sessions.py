"""Engine-level plumbing for requests that stay alive between turns (vLLM streaming-input sessions).

vLLM 0.32's ``AsyncLLM.generate`` accepts a stream of inputs for one request: the request is
``resumable``, so when a turn stops the scheduler parks it (``WAITING_FOR_STREAMING_REQ``) with its
KV blocks and its recurrent-state slot intact, and the next input chunk is appended and prefilled
alone. ``SessionEngine`` drives the same mechanism on the synchronous in-process ``LLMEngine``
(what ``AsyncLLM._add_streaming_input_request`` does, without an event loop), so a rollout worker
can be a plain class and a Ray actor alike.

Facts of the mechanism this code relies on (vllm/v1/core/sched/scheduler.py
``_update_request_as_session``): the token sampled last in a turn has not been fed through the
model and is dropped when the next chunk arrives, so the next chunk starts with it; outputs of a
resumable request are never ``finished``, a turn ends when its ``finish_reason`` is set.

Under vLLM's async scheduler a turn that ends on a stop token has run one decode step past it; the
model's stale-step guard (``rollout.vllm_layers.StaleStepGuard``) keeps the parked recurrent state at the
turn's end, given the ids that end the running turns. ``SessionEngine`` installs them from the first request
of each batch (``begin_batch``; as vLLM's input processor completed its sampling parameters: stop ids and
EOS), and every request of the batch must end on the same ids: the guard would miss another's stale step, or
freeze a token it feeds. Changing them between batches is safe: the batch before has launched its stale steps
already, and the ids' copy is ordered after them on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from vllm import SamplingParams
from vllm.inputs import TokensPrompt


class SessionEngine:
    """add_request / add_chunk / close on a ``vllm.LLMEngine``; ``step`` returns RequestOutputs."""

    def __init__(self, llm_engine, install_turn_ends: Callable[[list[int]], None] | None = None) -> None:
        """``install_turn_ends``: sets the model's stale-step guard (None: the engine schedules synchronously
        and has none)."""
        self.engine = llm_engine
        self._tasks = llm_engine.get_supported_tasks()
        self._install_turn_ends = install_turn_ends
        self.turn_ends: frozenset[int] | None = None  # what the model's guard holds
        self._batch_ends: frozenset[int] | None = None  # what the current batch's turns end on
        self.core_outputs = 0  # requests the engine core reported on in the last step (see ``step``)
        self._count_core_outputs(llm_engine.engine_core)

    def _count_core_outputs(self, core) -> None:
        get_output = core.get_output

        def counted():
            outputs = get_output()
            self.core_outputs = len(outputs.outputs)
            return outputs

        core.get_output = counted

    def begin_batch(self) -> None:
        """The requests added from now on may end on other ids than the last batch's (see the module doc)."""
        self._batch_ends = None

    def _prompt(self, token_ids: list[int], cache_salt: str | None) -> TokensPrompt:
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))  # vLLM extends prompt lists in place
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt

    def add_request(
        self, external_id: str, token_ids: list[int], params: SamplingParams, resumable: bool, cache_salt=None
    ) -> str:
        """Start a request; returns vLLM's internal request id."""
        if not resumable and self._install_turn_ends is None:
            return self.engine.add_request(external_id, self._prompt(token_ids, cache_salt), params)
        proc = self.engine.input_processor
        req = proc.process_inputs(
            external_id,
            self._prompt(token_ids, cache_salt),
            params,
            supported_tasks=self._tasks,
            resumable=resumable,
        )
        self._check_turn_ends(req.sampling_params)
        proc.assign_request_id(req)
        self._submit(req)
        return req.request_id

    def add_chunk(
        self,
        external_id: str,
        internal_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt=None,
    ) -> None:
        """Append the next input chunk to a parked resumable request."""
        proc = self.engine.input_processor
        req = proc.process_inputs(
            internal_id,
            self._prompt(token_ids, cache_salt),
            params,
            supported_tasks=self._tasks,
            resumable=True,
        )
        req.external_req_id = external_id
        self._check_turn_ends(req.sampling_params)
        self._submit(req)

    def _check_turn_ends(self, params) -> None:
        if self._install_turn_ends is None:
            return
        ends = turn_end_ids(params)
        if self._batch_ends is None:
            if ends != self.turn_ends:
                self._install_turn_ends(sorted(ends))
                self.turn_ends = ends
            self._batch_ends = ends
        elif ends != self._batch_ends:
            raise ValueError(
                f"with async sessions the turns of one batch must end on the same ids: this batch's are "
                f"{sorted(self._batch_ends)}, this request's {sorted(ends)} (stop_token_ids and EOS)"
            )

    def _submit(self, req) -> None:
        # In-process engines share objects with the output processor: both extend the session's
        # prompt list on resume, so each side gets its own list (a separate engine process gets a
        # copy by serialisation anyway).
        self.engine.output_processor.add_request(req, None, None, 0)
        core_req = msgspec.structs.replace(req, prompt_token_ids=list(req.prompt_token_ids))
        self.engine.engine_core.add_request(core_req)

    def close(self, internal_ids: list[str]) -> None:
        """End requests (parked sessions included); frees their KV blocks and state slots."""
        if internal_ids:
            self.engine.abort_request(list(internal_ids), internal=True)

    def step(self):
        """One engine step: its RequestOutputs. A step that advanced requests returns none when their outputs are
        ``FINAL_ONLY`` and no turn ended; ``core_outputs`` says whether the engine core reported on any request
        (sampled tokens, ends): the progress a caller waiting on turns can check."""
        self.core_outputs = 0
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()


def turn_end_ids(params) -> frozenset[int]:
    """The ids that end a request's turn once sampled: its EOS (None when ignored) and its stop ids, as vLLM's
    input processor completed them (the generation config's EOS ids join the stop ids there)."""
    ids = set(params.stop_token_ids or ())
    if params.eos_token_id is not None:
        ids.add(params.eos_token_id)
    return frozenset(ids)
