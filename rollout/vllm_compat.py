"""What a session under vLLM's async scheduler needs from the scheduler, on the vLLM versions we run.

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
