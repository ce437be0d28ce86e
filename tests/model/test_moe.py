"""MoE: router math, replay, SiTU-GLU, expert loop against a per-token reference."""

from __future__ import annotations

import pytest
import torch
from model_cases import tiny_config

from model.layers import situ_glu
from model.moe import MoEGate, SparseMoE, top_experts


def test_router_selects_with_bias_but_weighs_with_unbiased_scores():
    config = tiny_config(num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.5)
    gate = MoEGate(config).eval()
    x = torch.randn(10, 64)
    with torch.no_grad():
        gate.e_score_correction_bias[3] = 10.0  # forces expert 3 into every token's top-2
    route = gate(x)
    scores = torch.sigmoid(x @ gate.weight.detach().T)
    assert bool((route.experts_TK == 3).any(-1).all())
    chosen = scores.gather(-1, route.experts_TK)
    torch.testing.assert_close(route.weights_TK, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert route.weights_TK.dtype == torch.float32


def test_no_renormalize_keeps_raw_scores():
    gate = MoEGate(tiny_config(moe_renormalize=False)).eval()
    x = torch.randn(5, 64)
    route = gate(x)
    scores = torch.sigmoid(x @ gate.weight.detach().T)
    torch.testing.assert_close(route.weights_TK, scores.gather(-1, route.experts_TK))
    torch.testing.assert_close(route.experts_TK, scores.topk(2, -1).indices)


def test_a_set_select_fn_gives_the_gates_routes_and_is_left_out_where_it_cannot_apply():
    """``MoEGate.select_fn`` (the CUDA engine's one-launch selection; here its op off CUDA, the gate's own steps):
    the same experts and weights as without it; not called with replayed routes, group-limited routing or while
    training statistics are collected (those need the scores the function does not return)."""
    from kernels.moe.triton import select_experts_engine

    config = tiny_config(num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.5)
    gate = MoEGate(config).eval()
    x = torch.randn(10, 64)
    with torch.no_grad():
        want = gate(x)
        calls = []
        gate.select_fn = lambda *a: calls.append(a) or select_experts_engine(*a)
        got = gate(x)
        assert len(calls) == 1 and calls[0][2:] == (2, True, 2.5)
        assert torch.equal(got.experts_TK, want.experts_TK) and torch.equal(got.weights_TK, want.weights_TK)
        gate.select_fn = None
        replayed = gate(x, replay_TK=torch.zeros(10, 2, dtype=torch.long) + torch.tensor([0, 1]))
        gate.select_fn = lambda *a: pytest.fail("select_fn with replayed routes")
        assert torch.equal(gate(x, replay_TK=replayed.experts_TK).experts_TK, replayed.experts_TK)
        gate.num_groups, gate.topk_groups = 2, 1
        gate(x)  # group-limited: the steps
        gate.num_groups = 1
    gate.train()
    gate.set_balancing("quantile", 16)  # collecting statistics
    gate(x)
    assert gate.pop_stats() is not None


@pytest.mark.parametrize("T, E, n", [(1, 4, 1), (64, 128, 8), (300, 16, 3), (5, 128, 9)])
def test_top_experts_is_topk_with_ties_to_the_lower_expert(T, E, n):
    scores = torch.rand(T, E, generator=torch.Generator().manual_seed(T + E))
    vals, idx = top_experts(scores, n)
    ref = scores.topk(n, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)
    tied = torch.zeros(T, E)
    tied[:, E // 2 :] = 1.0  # the upper half ties at the top: the lowest ids of it win, in id order
    vals, idx = top_experts(tied, n)
    assert torch.equal(idx, torch.arange(E // 2, E // 2 + n).expand(T, n)) and bool((vals == 1).all())



def test_compiled_top_experts_calls_the_sort_op_and_equals_eager():
    """Under ``torch.compile`` the sort is the opaque ``longhorizon::sort_expert_scores`` (inductor generated
    a Triton sort for it, 30 s to compile on an H200), with eager's results, ties included."""
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward

    compiled = torch.compile(top_experts, backend=backend, dynamic=False, fullgraph=True)
    scores = torch.rand(37, 128, generator=torch.Generator().manual_seed(0))
    scores[:, 64:72] = 2.0  # a tie at the top
    for got, want in zip(compiled(scores, 9), top_experts(scores, 9)):
        assert torch.equal(got, want)
    assert any("sort_expert_scores" in op for op in ops), ops
    assert not any(op.endswith("sort") and "sort_expert_scores" not in op for op in ops), ops
    torch.library.opcheck(torch.ops.longhorizon.sort_expert_scores.default, (scores,))

def test_replay_uses_given_experts_and_router_still_learns():
    moe = SparseMoE(tiny_config()).train()
    x = torch.randn(1, 6, 64)
    given = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0], [1, 6]])
    y, used = moe(x, replay_TK=given)
    assert torch.equal(used, given)
    y.sum().backward()
    assert moe.gate.weight.grad is not None and float(moe.gate.weight.grad.abs().sum()) > 0
    assert float(moe.experts.down_proj.grad[5].abs().sum()) > 0  # replayed expert 5 ran
    with pytest.raises(ValueError, match="top_k"):
        moe(x, replay_TK=given[:, :1])
    with pytest.raises(ValueError, match="expert ids"):
        moe(x, replay_TK=given + 8)


def reference_expert(moe: SparseMoE, e: int, z: torch.Tensor) -> torch.Tensor:
    """Expert e from its rows of the stacked weights: gate rows, then up rows, then down."""
    ex = moe.experts
    gate, up = ex.gate_up_proj[e, : ex.intermediate], ex.gate_up_proj[e, ex.intermediate :]
    return ex.down_proj[e] @ ex.glu_torch(gate @ z, up @ z)


def reference_moe(moe: SparseMoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the formulas."""
    route = moe.gate(x_TD)
    rows = []
    for t in range(x_TD.shape[0]):
        z = moe.routed_expert_down_proj(x_TD[t]) if moe.latent else x_TD[t]
        u = sum(route.weights_TK[t, j] * reference_expert(moe, int(e), z) for j, e in enumerate(route.experts_TK[t]))
        y = moe.routed_expert_up_proj(moe.routed_expert_norm(u)) if moe.latent else u
        rows.append(y + moe.shared_experts(x_TD[t]))
    return torch.stack(rows)


@pytest.mark.parametrize("latent, act", [(None, "situ"), (32, "situ"), (32, "silu")])
def test_moe_matches_per_token_reference(latent, act):
    moe = SparseMoE(tiny_config(routed_expert_hidden_size=latent, hidden_act=act)).double().eval()
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    y, _ = moe(x)
    torch.testing.assert_close(y.view(10, 64), reference_moe(moe, x.view(10, 64)), rtol=1e-10, atol=1e-12)


def test_situ_glu_formula_and_bound():
    g, u = torch.randn(1000) * 30, torch.randn(1000) * 300
    h = situ_glu(g, u)
    torch.testing.assert_close(h, 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25))
    assert float(h.abs().max()) <= 100.0
    small_g, small_u = torch.randn(10) * 1e-3, torch.randn(10) * 1e-3
    swiglu = torch.nn.functional.silu(small_g) * small_u  # SiTU == SwiGLU to first order near 0
    torch.testing.assert_close(situ_glu(small_g, small_u), swiglu, rtol=1e-2, atol=1e-9)
    assert situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16


def test_grouped_experts_draw_like_the_per_expert_linears_they_replace():
    """A seed gives the stacked experts the weights 3E nn.Linear modules (gate, up, down per expert) had:
    runs and recipes measured before the experts were stacked keep their initial weights."""
    from torch import nn

    from model.moe import GroupedExperts

    E, Z, I = 4, 12, 6
    torch.manual_seed(3)
    experts = GroupedExperts(E, Z, I)
    torch.manual_seed(3)
    linears = [nn.Linear(a, b, bias=False) for _ in range(E) for a, b in ((Z, I), (Z, I), (I, Z))]
    for e in range(E):
        gate, up, down = (m.weight for m in linears[3 * e : 3 * e + 3])
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[e], down)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_replay_id_check_takes_whole_free_rows_and_refuses_the_rest(dtype):
    """``check_replay_ids`` on a learner-sized table of any integer width: ids in [0, E) or a whole row of -1
    pass; an id of E or below -1, and a row with -1 beside a real id, are refused wherever they sit."""
    from model.moe import check_replay_ids

    E, K = 16, 4
    ok = torch.stack([torch.randperm(E)[:K] for _ in range(600)]).view(200, 3, K).to(dtype)
    ok[::7] = -1
    check_replay_ids(ok, E)
    check_replay_ids(ok[1:7], E)  # no free row at all
    check_replay_ids(torch.full((3, 2, K), -1, dtype=dtype), E)
    for value, pos, match in ((E, (150, 2, 3), "must lie in"), (-2, (3, 0, 1), "must lie in"),
                              (-1, (199, 1, 2), "all -1"), (-1, (1, 0, 0), "all -1")):  # fmt: skip
        bad = ok.clone()
        bad[pos] = value
        with pytest.raises(ValueError, match=match):
            check_replay_ids(bad, E)
