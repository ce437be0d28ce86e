"""Expert balancing: K3 Quantile Balancing on a skewed router, the alternatives, bias hygiene."""

from __future__ import annotations

import pytest
import torch
from model_cases import tiny_config
from torch import nn

from model.balancing import (
    ExpertBalancer,
    histogram_quantile_bias,
    histogram_range,
    load_metrics,
    quantile_bias,
    required_bias_histogram,
)
from model.config import HybridConfig
from model.moe import MoEGate

E, K, D = 64, 8, 16


def skewed_router() -> nn.Module:
    """64 experts, top-8, with a strong per-expert offset (expert 63 far more attractive than 0)."""
    holder = nn.Module()
    holder.gate = MoEGate(HybridConfig(hidden_size=D, num_experts=E, num_experts_per_token=K))
    with torch.no_grad():
        holder.gate.weight.normal_(std=0.5)
        holder.gate.weight[:, 0] = torch.linspace(-3, 3, E)  # x[:, 0] == 1: a fixed skew per expert
    return holder.train()


def simulate(mode: str, steps: int = 20, tokens: int = 131072, rate: float | None = None) -> list[float]:
    """MaxVio_batch per step, each step routing a fresh batch with the bias from the previous steps."""
    holder, gen = skewed_router(), torch.Generator().manual_seed(1)
    balancer = ExpertBalancer(holder, mode=mode, rate=rate)
    max_vio = []
    for _ in range(steps):
        x = torch.randn(tokens, D, generator=gen)
        x[:, 0] = 1.0
        holder.gate(x)
        max_vio.append(balancer.step()[0].max_vio)
    return max_vio


@pytest.mark.slow  # ~25 s of CPU: 2 x 20 routing steps over 131072 tokens
def test_quantile_balancing_reaches_balance_within_20_steps_and_beats_sign_rule():
    # 131072 tokens x top-8 / 64 experts = 16384 assignments per expert. A bias estimated on one
    # batch and applied to the next leaves a sampling-noise floor of MaxVio_batch ~0.03 (0.05 at
    # half this batch, which made the threshold a coin toss); measured over 5 seeds QB is below
    # 0.05 from step 6-9 on and at most 0.039 over steps 10-19.
    qb = simulate("quantile")
    assert qb[0] > 1.0  # the router really is skewed
    assert max(qb[10:]) < 0.05, qb
    sign = simulate("sign", rate=1e-2)
    assert min(sign) > 0.2 and qb[-1] < sign[-1], (qb[-1], sign)


def test_quantile_bias_matches_definition():
    m = 40
    margins = torch.randn(m, 8)
    b = quantile_bias(margins, k=2)  # q = 40 * 2 / 8 = 10
    tenth_plus_one = margins.sort(dim=0, descending=True).values[10]
    torch.testing.assert_close(b, -tenth_plus_one + tenth_plus_one.mean())
    assert abs(float(b.mean())) < 1e-6
    # with this bias exactly q tokens per expert have a margin above -b (before centring)
    assert bool(((margins > tenth_plus_one).sum(0) == 10).all())


def test_histogram_estimator_within_one_bin_of_exact():
    m = 20000
    scores = torch.rand(m, E)
    bias = torch.randn(E) * 0.2
    cutoff = (scores + bias).topk(K + 1, dim=-1).values[:, K]
    lo, hi = histogram_range(bias)
    hist = required_bias_histogram(cutoff[:, None] - scores, lo, hi, 1000)
    assert hist.dtype == torch.long and int(hist.sum()) == m * E
    approx = histogram_quantile_bias(hist, lo, hi, m, K)
    exact = quantile_bias(scores - cutoff[:, None], K)
    assert float((approx - exact).abs().max()) <= (hi - lo) / 1000


def test_load_metrics():
    met = load_metrics(torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert met.max_vio == pytest.approx(1.0)
    assert met.dead_experts == 1 and met.min_load_frac == 0.0
    assert met.load_cv == pytest.approx(torch.tensor([0.0, 2, 4, 6]).std(unbiased=False).item() / 3)


def test_bias_has_no_gradient_and_is_applied_from_next_step():
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config()).train()
    balancer = ExpertBalancer(model)
    gates = balancer.gates
    assert all(not g.e_score_correction_bias.requires_grad for g in gates)
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids, labels=ids, output_router_choices=True)
    out.loss.backward()
    assert all(g.e_score_correction_bias.grad is None for g in gates)
    assert all(g.weight.grad is not None for g in gates)  # the router itself learns
    before = [g.e_score_correction_bias.clone() for g in gates]
    again = model(ids, output_router_choices=True)  # second micro-batch, same step: same bias
    torch.testing.assert_close(again.router_choices, out.router_choices)
    metrics = balancer.step()
    assert len(metrics) == len(gates)
    assert any(not torch.equal(b, g.e_score_correction_bias) for b, g in zip(before, gates))


def test_frozen_mode_and_state_dict_round_trip():
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config()).train()
    balancer = ExpertBalancer(model, mode="quantile_histogram")
    model(torch.randint(0, 128, (1, 12)))
    balancer.step()
    state = balancer.state_dict()
    other = HybridForCausalLM(tiny_config())
    restored = ExpertBalancer(other, mode="frozen")
    restored.load_state_dict(state)
    assert restored.mode == "quantile_histogram" and restored.num_steps == 1
    for a, b in zip(balancer.gates, restored.gates):
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
    frozen = ExpertBalancer(model, mode="frozen")
    before = [g.e_score_correction_bias.clone() for g in frozen.gates]
    model(torch.randint(0, 128, (1, 12)))
    assert frozen.step() == []
    assert all(torch.equal(b, g.e_score_correction_bias) for b, g in zip(before, frozen.gates))


def test_statistics_only_with_a_balancer_and_gradients():
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config()).train()
    gate = next(m for m in model.modules() if isinstance(m, MoEGate))
    ids = torch.randint(0, 128, (1, 12))
    model(ids)
    assert gate.pop_stats() is None  # no balancer attached: nothing accumulates
    ExpertBalancer(model)
    with torch.no_grad():
        model(ids)
    assert gate.pop_stats() is None  # no-grad forwards are not training tokens
    model(ids)
    assert gate.pop_stats().tokens == 12


def test_unknown_mode_is_rejected():
    from model.modeling import HybridForCausalLM

    with pytest.raises(ValueError, match="balancing mode"):
        ExpertBalancer(HybridForCausalLM(tiny_config()), mode="aux_loss")


def test_histogram_mode_all_reduce_over_ranks_equals_one_big_batch():
    """Two "ranks" each route half a batch; summing their integer statistics gives exactly the
    bias a single process computes from the whole batch."""
    ranks = [skewed_router() for _ in range(3)]
    for r in ranks[1:]:
        r.load_state_dict(ranks[0].state_dict())
    balancers = [ExpertBalancer(r, mode="quantile_histogram") for r in ranks]
    x = torch.randn(4096, D)
    x[:, 0] = 1.0
    ranks[0].gate(x[:2048])
    ranks[1].gate(x[2048:])
    ranks[2].gate(x)  # the single-process reference
    other = ranks[1].gate.pop_stats()
    peer = iter([other.load_E.round().long(), torch.tensor([other.tokens]), other.hist_EB])
    metrics = balancers[0].step(all_reduce=lambda t: t + next(peer))
    reference = balancers[2].step()
    assert metrics[0].max_vio == pytest.approx(reference[0].max_vio)
    torch.testing.assert_close(ranks[0].gate.e_score_correction_bias, ranks[2].gate.e_score_correction_bias)
    with pytest.raises(ValueError, match="quantile_histogram"):
        ExpertBalancer(ranks[0], mode="quantile").step(all_reduce=lambda t: t)


def test_step_size_rules_move_bias_toward_underloaded_experts():
    from model.balancing import load_quantile_update, sign_update

    load = torch.tensor([10.0, 20.0, 30.0, 40.0])
    bias = torch.zeros(4)
    s = sign_update(bias, load, gamma=0.1)
    torch.testing.assert_close(s, torch.tensor([0.1, 0.1, -0.1, -0.1]))
    q = load_quantile_update(bias, load, eta=0.5, p=0.5)  # median relative load 1.0
    torch.testing.assert_close(q, 0.5 * (1.0 - load / 25.0))
