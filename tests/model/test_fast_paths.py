"""Every fast path of model.fast equals its reference on CPU in fp32, forward and backward.

Tolerances are RMS error ratios ||ref - fast|| / ||ref|| (kernels.testing.assert_close): 1e-6 for
outputs, 1e-5 for gradients (fp32 GEMMs summed in another order), on packed sequences of 1, 15, 64,
65 and 300 tokens. FlexAttention refuses backward on CPU by a device check only; its eager form
does have an autograd formula, so the attention test lifts that check to hold our block mask and
plumbing to the loop in both directions (the compiled GPU kernel is checked by bench/learner_mfu.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from model_cases import tiny_config

from kernels.testing import assert_close
from model import fast
from model.fast import FastPaths, use_fast_paths
from model.layers import seq_layout
from model.mla import GatedMLA
from model.moe import SparseMoE

LENGTHS = [1, 15, 64, 65, 300]


def packed_cu(lengths=LENGTHS) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def grads(out: torch.Tensor, wrt: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad(out, wrt, g, allow_unused=True))


class NoHostSync:
    """Raises on the Tensor calls that read device values on the host (item, tolist, bool, int, float)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(*args, **kwargs):
                raise AssertionError(f"host read Tensor.{name} inside the fast path")

            return f

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


# ------------------------------------------------------------------------------------------ MoE
@pytest.mark.parametrize("latent, act", [(None, "situ"), (32, "situ"), (32, "silu")])
def test_grouped_moe_equals_the_expert_loop_fwd_bwd(latent, act):
    moe = SparseMoE(tiny_config(routed_expert_hidden_size=latent, hidden_act=act, num_experts=8)).train()
    x = torch.randn(1, sum(LENGTHS), 64, requires_grad=True)
    params = [x, *moe.parameters()]
    outs = {}
    for mode in ("loop", "grouped"):
        with use_fast_paths("auto", moe=mode):
            y, used = moe(x)
        outs[mode] = (y, used, grads(y, params))
    (y_ref, used_ref, g_ref), (y, used, g) = outs["loop"], outs["grouped"]
    assert torch.equal(used, used_ref)
    assert_close("moe y", y_ref, y, 1e-6)
    for p, a, b in zip(["x", *dict(moe.named_parameters())], g_ref, g):
        if a is None:
            assert b is None or float(b.abs().max()) == 0.0, p
        else:
            assert_close(f"moe d{p}", a, b, 1e-5)


def test_grouped_moe_replay_idle_experts_and_selection_bias_as_the_loop():
    config = tiny_config(routed_expert_hidden_size=32, num_experts=8, num_experts_per_token=2)
    moe = SparseMoE(config).train()
    with torch.no_grad():
        moe.gate.e_score_correction_bias[5] = 3.0  # selection-only bias: expert 5 in every top-2
    x = torch.randn(1, 40, 64)
    replay = torch.randint(0, 3, (40, 2))  # replay onto experts 0..2: the others are idle
    replay[:, 1] = 3 + replay[:, 0]
    for kwargs in ({}, {"replay_TK": replay}):
        with use_fast_paths("auto", moe="loop"):
            y_ref, used_ref = moe(x, **kwargs)
        with use_fast_paths("auto", moe="grouped"):
            y, used = moe(x, **kwargs)
        assert torch.equal(used, used_ref)
        assert_close("y", y_ref, y, 1e-6)
    assert bool((used_ref == replay).all())
    y.sum().backward()
    assert float(moe.gate.weight.grad.abs().sum()) > 0  # the router still learns under replay
    assert float(moe.experts.down_proj.grad[7].abs().max()) == 0.0  # idle expert


def test_grouped_moe_reads_nothing_on_the_host():
    moe = SparseMoE(tiny_config(routed_expert_hidden_size=32)).train()
    x = torch.randn(1, 50, 64, requires_grad=True)
    replay = torch.randint(0, 8, (50, 2))
    with use_fast_paths("auto", moe="grouped"), NoHostSync():
        y, _ = moe(x, replay_TK=replay, replay_checked=True)
        y.sum().backward()
    with use_fast_paths("auto", moe="loop"), pytest.raises(AssertionError, match="host read"), NoHostSync():
        moe(x)  # the reference reads the per-expert counts on the host


# ------------------------------------------------------------------------------------------ MLA
@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *a: None)


def mla_layer(**overrides) -> GatedMLA:
    layer = GatedMLA(tiny_config(**overrides), layer_idx=3)
    for p in layer.parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.2)
    return layer


def _mla_run(layer, x, cu, form):
    layout = seq_layout(x.shape[0], x.shape[1], cu, x.device)
    with use_fast_paths("auto", attention=form):
        y, _ = layer(x, layout, cu)
    return y, grads(y, [x, *layer.parameters()])


@pytest.mark.parametrize("batch", ["packed", "padded"])
def test_flex_attention_equals_per_sequence_sdpa_fwd_bwd(flex_backward_on_cpu, batch):
    layer = mla_layer()
    if batch == "packed":
        x, cu = torch.randn(1, sum(LENGTHS), 64, requires_grad=True), packed_cu()
    else:
        x, cu = torch.randn(3, 70, 64, requires_grad=True), None
    y_ref, g_ref = _mla_run(layer, x, cu, "loop")
    y, g = _mla_run(layer, x, cu, "flex")
    assert_close("mla y", y_ref, y, 1e-6)
    for i, (a, b) in enumerate(zip(g_ref, g)):
        assert_close(f"mla grad {i}", a, b, 1e-5)


def test_document_block_mask_is_exactly_document_causal():
    from model.attention import document_block_mask

    lengths = [1, 15, 64, 65, 300, 0, 3]  # an empty sequence too
    cu = packed_cu(lengths)
    layout = seq_layout(1, int(cu[-1]), cu, torch.device("cpu"))
    mask = document_block_mask(layout, block=32)
    R = int(cu[-1])
    doc = layout.seq_BT[0]
    q, k = torch.arange(R)[:, None], torch.arange(R)[None, :]
    truth = (doc[:, None] == doc[None, :]) & (q >= k)
    # per token pair: block sparsity (partial or full block) and mask_mod inside partial blocks
    dense = mask.to_dense()[0, 0]  # [nq, nk] blocks touched
    nb = dense.shape[0]
    truth_blocks = F.pad(truth, (0, nb * 32 - R, 0, nb * 32 - R)).view(nb, 32, nb, 32).any(3).any(1)
    assert torch.equal(dense.bool(), truth_blocks)
    pairs = mask.mask_mod(0, 0, q, k)
    assert torch.equal(pairs, truth)
    assert 0 < mask.sparsity() < 100


def test_varlen_form_pads_values_and_passes_the_layout(monkeypatch, flex_backward_on_cpu):
    """PyTorch's varlen flash attention is CUDA-only: a per-sequence SDPA stands in for it here, to
    check what our side does (v padded to the q/k head size, causal flag, cu_seqlens, max length);
    bf16 as on the GPU (FA2 has no fp32 kernel: fp32 inputs take flex instead)."""
    import torch.nn.attention.varlen as varlen


    seen = {}

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        seen.update(kw, max_q=max_q, v_dim=v.shape[-1], cu=cu_q, calls=seen.get("calls", 0) + 1)
        cu = cu_q.tolist()
        outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                               scale=scale).transpose(0, 1) for a, b in itertools.pairwise(cu)]  # fmt: skip
        return torch.cat(outs)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    layer = mla_layer().bfloat16()
    x, cu = torch.randn(1, sum(LENGTHS), 64, dtype=torch.bfloat16, requires_grad=True), packed_cu()
    y_ref, g_ref = _mla_run(layer, x, cu, "loop")
    y, g = _mla_run(layer, x, cu, "varlen")
    assert seen["max_q"] == 300 and seen["v_dim"] == 24 and seen["cu"].dtype == torch.int32
    assert seen.get("window_size") == (-1, 0) or seen.get("is_causal") is True
    assert_close("mla y", y_ref.float(), y.float(), 1e-2)
    for i, (a, b) in enumerate(zip(g_ref, g)):
        assert_close(f"mla grad {i}", a.float(), b.float(), 2e-2)
    calls = seen["calls"]
    _mla_run(mla_layer(), x.detach().float().requires_grad_(), cu, "varlen")
    assert seen["calls"] == calls  # fp32: flex, not the flash kernel


def test_shared_attn_res_source_gradients_equal_autograd_bit_for_bit(monkeypatch):
    """op "attn_res_grads" = shared (the later mixes of a completed block add its gradient into one buffer, the
    earliest mix returns it: ``model.attnres.SharedSourceGrads``) against autograd summing every mix's own: the whole
    model's gradients bit for bit on the PyTorch node (the same sums in the same order), with four blocks of sources
    shared by several mixes each."""
    from model import attnres
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config(num_hidden_layers=6, attn_res_block_size=2)).train()
    cu = packed_cu()
    ids = torch.randint(0, 128, (1, int(cu[-1])))
    shared_by = []
    real_register = attnres.SharedSourceGrads.register
    monkeypatch.setattr(attnres.SharedSourceGrads, "register",
                        lambda self, sources: shared_by.append(len(sources)) or real_register(self, sources))  # fmt: skip
    results = {}
    for choice in ("autograd", "shared"):
        shared_by.clear()
        with use_fast_paths("auto", attn_res="fused", attn_res_grads=choice):
            out = model(ids, cu_seqlens=cu, target_ids=ids.roll(-1, 1))
            results[choice] = grads(out.token_logprobs.sum(), list(model.parameters()))
        assert (max(shared_by, default=0) >= 4) == (choice == "shared")  # every mix registered its sources
    for (name, _), a, b in zip(model.named_parameters(), results["autograd"], results["shared"]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


# ------------------------------------------------------------------------------------------ choice
def test_fast_path_choice_parses_resolves_and_names_bad_values():
    assert FastPaths.parse("reference") == FastPaths.reference()
    assert FastPaths.parse("moe=loop,attention=flex") == FastPaths(moe="loop", attention="flex")
    with pytest.raises(ValueError, match="choose one of"):
        FastPaths(moe="fast")
    with pytest.raises(ValueError, match="unknown ops"):
        FastPaths.parse("mo=loop")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with use_fast_paths("auto"):
        assert [fast.pick(op, cpu) for op in ("moe", "attention", "conv", "lm_head")] == [
            "grouped", "loop", "torch", "chunked"]  # fmt: skip
        assert fast.pick("conv", cuda) == "triton_bf16" and fast.pick("lm_head", cuda) == "chunked"
        assert fast.pick("attn_res", cpu) == "fused" and fast.pick("attn_res", cuda) == "triton"  # mix with its norm
        assert fast.pick("attn_res_grads", cpu) == fast.pick("attn_res_grads", cuda) == "shared"
        assert fast.pick("attention", cuda) in ("varlen", "flex")
        assert fast.pick("attention", cuda, torch.bfloat16) in ("varlen", "flex")
        assert fast.pick("attention", cuda, torch.float32) == "loop"  # no fp32 kernel fits an H200
    with use_fast_paths("reference"):
        assert fast.pick("moe", cuda) == "loop" and fast.pick("attention", cuda) == "loop"


def test_the_process_default_comes_from_the_environment():
    """``LONGHORIZON_FAST_PATHS`` sets the default a process starts with (an engine's); a bad value is named."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def run(spec: str) -> subprocess.CompletedProcess:
        code = "from model import fast; print(fast.current())"
        env = {"PATH": "", "PYTHONPATH": str(root), "LONGHORIZON_FAST_PATHS": spec}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    ok = run("attn_res=torch,moe=loop")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == repr(FastPaths(attn_res="torch", moe="loop"))
    bad = run("attn_res=kernel")
    assert bad.returncode != 0 and "LONGHORIZON_FAST_PATHS='attn_res=kernel'" in bad.stderr


# ------------------------------------------------------------------------------------------ LM head
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_lm_head_equals_plain_logits_fwd_bwd(with_entropy):
    from model.lm_head import chunked_logprobs_entropy, logits_entropy
    from model.modeling import token_logprobs

    head = torch.nn.Linear(32, 97, bias=False)
    h = torch.randn(1, 50, 32, requires_grad=True)
    targets = torch.randint(0, 97, (1, 50))
    logits = head(h)
    lp_ref, ent_ref = token_logprobs(logits, targets), logits_entropy(logits)
    lp, ent = chunked_logprobs_entropy(
        head, h, targets, with_entropy=with_entropy, chunk=7
    )  # 7 does not divide 50
    assert_close("logp", lp_ref, lp, 1e-6)
    g_lp = torch.randn(1, 50)
    g_ent = torch.randn(1, 50)
    if with_entropy:
        assert_close("entropy", ent_ref, ent, 1e-6)
        ref = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), (h, head.weight))
        got = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, head.weight))
    else:
        assert ent is None
        ref = torch.autograd.grad((lp_ref * g_lp).sum(), (h, head.weight))
        got = torch.autograd.grad((lp * g_lp).sum(), (h, head.weight))
    assert_close("dh", ref[0], got[0], 1e-5)
    assert_close("dW", ref[1], got[1], 1e-5)


def test_entropy_only_gradient_and_model_outputs_agree():
    from model.lm_head import chunked_logprobs_entropy, logits_entropy
    from model.modeling import HybridForCausalLM

    head = torch.nn.Linear(16, 40, bias=False)
    h = torch.randn(1, 9, 16, requires_grad=True)
    targets = torch.randint(0, 40, (1, 9))
    _, ent = chunked_logprobs_entropy(head, h, targets, with_entropy=True, chunk=4)
    (got,) = torch.autograd.grad(ent.sum(), h)
    (ref,) = torch.autograd.grad(logits_entropy(head(h)).sum(), h)
    assert_close("dh entropy only", ref, got, 1e-5)
    model = HybridForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 128, (1, 20))
    plain = model(ids, target_ids=ids, return_entropy=True)
    lean = model(ids, target_ids=ids, return_logits=False, return_entropy=True)
    assert lean.logits is None
    assert_close("model logp", plain.token_logprobs, lean.token_logprobs, 1e-6)
    assert_close("model entropy", plain.entropy, lean.entropy, 1e-6)


# ------------------------------------------------------------------------------------------ whole model
def test_layout_is_built_once_per_forward_from_a_host_cu_seqlens(monkeypatch):
    from model import modeling
    from model.modeling import HybridForCausalLM

    built = []
    real = modeling.seq_layout
    monkeypatch.setattr(modeling, "seq_layout", lambda *a, **kw: built.append(a[2]) or real(*a, **kw))
    model = HybridForCausalLM(tiny_config()).eval()
    cu = packed_cu([3, 5, 8])
    model(torch.randint(0, 128, (1, 16)), cu_seqlens=cu)
    assert len(built) == 1 and built[0] is cu  # the caller's CPU tensor, read once


def test_whole_model_fast_paths_equal_the_references_fwd_bwd(flex_backward_on_cpu):
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config(routed_expert_hidden_size=32)).train()
    cu = packed_cu()
    ids = torch.randint(0, 128, (1, int(cu[-1])))
    routes = torch.randint(0, 8, (ids.shape[1], len(model.config.moe_layer_indices), 2))
    results = {}
    for name, paths in (
        ("reference", FastPaths.reference()),
        ("fast", FastPaths(moe="grouped", attention="flex", conv="torch", lm_head="chunked")),
    ):
        with use_fast_paths(paths):
            out = model(ids, cu_seqlens=cu, target_ids=ids.roll(-1, 1), routed_experts=routes,
                        return_logits=paths.lm_head == "plain", return_entropy=True)  # fmt: skip
        loss = out.token_logprobs.sum() + 0.1 * out.entropy.sum()
        results[name] = (out.token_logprobs, out.entropy, grads(loss, list(model.parameters())))
    (lp_ref, ent_ref, g_ref), (lp, ent, g) = results["reference"], results["fast"]
    assert_close("logprobs", lp_ref, lp, 1e-6)
    assert_close("entropy", ent_ref, ent, 1e-6)
    for (name, _), a, b in zip(model.named_parameters(), g_ref, g):
        if a is not None:
            assert_close(f"grad {name}", a, b, 1e-5)
