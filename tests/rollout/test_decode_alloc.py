"""rollout.vllm_compat's decode fast path for ``KVCacheManager.allocate_slots``: in a real vLLM engine (CPU) every
answer it gives is the one vLLM gives (checked call by call), the engine's tokens and logprobs are the same with it
off, and on engine-shaped fakes each case it must leave to vLLM goes to vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm_engine import LOGPROB_TOL, _prompt

from rollout import vllm_compat
from rollout.vllm_compat import DECODE_ALLOC_COUNTS, fast_decode_allocate, install_decode_allocation
from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm


@pytest.fixture
def alloc_mode():
    """Sets the fast path's mode for a test, and puts the default back after it."""
    yield install_decode_allocation
    install_decode_allocation("fast")


def _turns(worker, tag: str, lengths: list[int], gen: int = 40):
    """Two turns of concurrent sessions; the prompts put some decodes across a KV block boundary (128 tokens)."""
    first = worker.generate([TurnRequest(f"{tag}{i}", _prompt(40 + i, n), max_tokens=gen, temperature=0.0)
                             for i, n in enumerate(lengths)])  # fmt: skip
    second = worker.generate([TurnRequest(f"{tag}{i}", _prompt(60 + i, 30), max_tokens=gen, temperature=0.0)
                              for i in range(len(lengths))])  # fmt: skip
    worker.end_sessions([f"{tag}{i}" for i in range(len(lengths))])
    return first + second


LENGTHS = [50, 100, 120, 170]  # decoding 40 tokens: 100 and 120 cross 128, and the second turn crosses 256


def test_the_plugin_installs_the_fast_path(session_worker):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert KVCacheManager.allocate_slots.decode_fast_path == "fast"
    km = session_worker.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    groups = vllm_compat._decode_groups(km)  # the tiny model: a recurrent-state group and an MLA group
    assert sorted(type(m).__name__ for m, *_ in groups) == ["FullAttentionManager", "MambaManager"]


def test_every_fast_answer_is_vllm_s_own(session_worker, alloc_mode):
    """Check mode runs vLLM's allocation beside each fast answer and raises on any difference."""
    alloc_mode("check")
    before = dict(DECODE_ALLOC_COUNTS)
    _turns(session_worker, "chk", LENGTHS)
    fast, full = (DECODE_ALLOC_COUNTS[k] - before[k] for k in ("fast", "vllm"))
    assert fast > 200  # ~4 x 2 x 40 decode steps
    assert full >= 8 + 3  # the new requests, the resumed chunks, the block-boundary decodes


def test_tokens_and_logprobs_unchanged_with_the_fast_path_off(session_worker, alloc_mode):
    alloc_mode("off")
    off = _turns(session_worker, "off", LENGTHS)
    alloc_mode("fast")
    fast = _turns(session_worker, "fast", LENGTHS)
    for a, b in zip(off, fast):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)


# --- engine-shaped fakes ------------------------------------------------------------------------------------


def _group(kind: str, block_size: int, blocks: int, **extra):
    m = type(kind, (), {})()
    m.block_size, m.req_to_blocks, m._partial_hit_reqs = block_size, {"r": [object()] * blocks}, {}
    m.mamba_cache_mode, m.num_speculative_blocks = "none", 0
    vars(m).update(extra)
    return m


def _manager(*groups, caching: bool = False):
    return SimpleNamespace(enable_caching=caching, coordinator=SimpleNamespace(single_type_managers=list(groups)),
                           max_model_len=4096, empty_kv_cache_blocks=SimpleNamespace(blocks=((),) * len(groups)))  # fmt: skip


def _request(computed: int, running: bool = True):
    from vllm.v1.request import RequestStatus

    status = RequestStatus.RUNNING if running else RequestStatus.WAITING
    return SimpleNamespace(request_id="r", num_computed_tokens=computed, status=status)


def _calls(manager, request, new: int = 1, **kwargs):
    """Which path answered one call: "fast" (the manager's empty answer, vLLM's method not called) or "vllm"."""
    seen = []

    def vllm_allocate(self, req, n, *args, **kw):
        seen.append(n)
        return SimpleNamespace(blocks=((),) * len(self.coordinator.single_type_managers))

    out = fast_decode_allocate(vllm_allocate)(manager, request, new, **kwargs)
    if seen:
        return "vllm"
    assert out is manager.empty_kv_cache_blocks
    return "fast"


def test_a_decode_token_inside_its_blocks_is_answered_without_vllm():
    m = _manager(_group("MambaManager", 1024, 1), _group("FullAttentionManager", 128, 4))
    assert _calls(m, _request(511)) == "fast"
    assert _calls(m, _request(511), num_lookahead_tokens=0) == "fast"
    older = _group("FullAttentionManager", 128, 4)
    del older._partial_hit_reqs  # a vLLM without copy-on-write of partial hits
    assert _calls(_manager(older), _request(511)) == "fast"


@pytest.mark.parametrize("case", ["block full", "state block passed", "caching on", "other kind", "align mode",
                                  "speculative blocks", "copy-on-write pending", "waiting request", "lookahead",
                                  "prefix hit", "positional", "unknown request", "past max_model_len",
                                  "a manager of another vLLM"])  # fmt: skip
def test_every_other_case_goes_to_vllm(case):
    state = dict(mamba_cache_mode="align") if case == "align mode" else {}
    state |= dict(num_speculative_blocks=1) if case == "speculative blocks" else {}
    groups = [_group("MambaManager", 1024 if case != "state block passed" else 256, 1, **state),
              _group("SlidingWindowManager" if case == "other kind" else "FullAttentionManager", 128, 4)]  # fmt: skip
    if case == "copy-on-write pending":
        groups[1]._partial_hit_reqs["r"] = (3, object())
    if case == "a manager of another vLLM":
        del groups[0].mamba_cache_mode
    m = _manager(*groups, caching=case == "caching on")
    request = _request(512 if case == "block full" else 300, running=case != "waiting request")
    if case == "unknown request":
        request.request_id = "other"
    if case == "past max_model_len":
        m.max_model_len = 300
    kwargs = {"lookahead": dict(num_lookahead_tokens=2), "prefix hit": dict(num_new_computed_tokens=128)}.get(case, {})
    if case == "positional":
        assert fast_decode_allocate(lambda *a: "vllm")(m, request, 1, 0) == "vllm"
    else:
        assert _calls(m, request, **kwargs) == "vllm"


def test_check_mode_raises_where_vllm_would_allocate():
    m = _manager(_group("FullAttentionManager", 128, 4))
    grown = fast_decode_allocate(lambda self, req, n: SimpleNamespace(blocks=([object()],)), "check")
    with pytest.raises(AssertionError, match="vLLM answered"):
        grown(m, _request(100), 1)

    def extends(self, req, n):
        self.coordinator.single_type_managers[0].req_to_blocks["r"].append(object())
        return SimpleNamespace(blocks=((),))

    with pytest.raises(AssertionError, match="changed r's block tables"):
        fast_decode_allocate(extends, "check")(m, _request(100), 1)


def test_modes_install_and_bad_ones_are_refused(alloc_mode, monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert alloc_mode("off") == "off" and not hasattr(KVCacheManager.allocate_slots, "decode_fast_path")
    assert alloc_mode("check") == "check" and KVCacheManager.allocate_slots.decode_fast_path == "check"
    original = KVCacheManager.allocate_slots.__wrapped__
    assert alloc_mode("fast") == "fast" and KVCacheManager.allocate_slots.__wrapped__ is original  # not nested
    with pytest.raises(ValueError, match="decode allocation mode"):
        alloc_mode("quick")
    monkeypatch.setenv("LONGHORIZON_DECODE_ALLOC", "quick")
    with pytest.raises(ValueError, match="LONGHORIZON_DECODE_ALLOC must be one of"):
        alloc_mode()
