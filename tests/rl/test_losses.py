"""The clipped policy-gradient loss against hand-computed values and gradients."""

import math

import pytest
import torch
from rl_factories import group

from rl.advantages import compute_advantages
from rl.batching import pack, rows_from_groups
from rl.config import AlgorithmConfig
from rl.losses import LossInputs, kl_penalty, policy_loss, token_weights


def cfg(name="grpo", **kw) -> AlgorithmConfig:
    return AlgorithmConfig(name=name, **kw).resolved()


def inputs(lp, old, adv, mask=None, seq=None, rollout=None, mode="token_mean", **kw) -> LossInputs:
    lp_T = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    mask_T = torch.tensor(mask if mask is not None else [True] * len(lp))
    seq_T = torch.tensor(seq if seq is not None else [0] * len(lp))
    return LossInputs(
        logprobs_T=lp_T, old_logprobs_T=torch.tensor(old, dtype=torch.float64),
        rollout_logprobs_T=torch.tensor(rollout if rollout is not None else old, dtype=torch.float64),
        advantages_T=torch.tensor(adv, dtype=torch.float64),
        token_weights_T=token_weights(mask_T, seq_T, mode, 4).double(), loss_mask_T=mask_T, seq_ids_T=seq_T, **kw,
    )  # fmt: skip


def test_unclipped_is_vanilla_pg():
    inp = inputs([-1.0, -2.0], [-1.0, -2.0], [1.0, -2.0])
    loss, _ = policy_loss(inp, cfg("dapo", tis_cap=None))
    loss.backward()
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2)
    assert inp.logprobs_T.grad.tolist() == pytest.approx([-0.5, 1.0])


def test_clipping_active_and_inactive():
    # ratios e^0.4 (A>0, clipped at 1.2), e^-0.7 (A<0, clipped at 0.8), e^0.05 (inside)
    inp = inputs([0.4, -0.7, 0.05], [0.0, 0.0, 0.0], [1.0, -1.0, 1.0])
    loss, m = policy_loss(inp, cfg("grpo", tis_cap=None, loss_agg="token_mean"))
    loss.backward()
    expected = (-1.2 + 0.8 - math.exp(0.05)) / 3
    assert loss.item() == pytest.approx(expected)
    assert inp.logprobs_T.grad.tolist() == pytest.approx([0.0, 0.0, -math.exp(0.05) / 3])
    assert m["clip_frac"] == pytest.approx(2 / 3)


def test_asymmetric_clip_high():
    inp = inputs([0.25], [0.0], [1.0])
    loss, _ = policy_loss(inp, cfg("dapo", tis_cap=None))  # clip_high 0.28 > e^0.25 - 1 = 0.284? no: clipped
    assert loss.item() == pytest.approx(-1.28)
    inp = inputs([0.2], [0.0], [1.0])
    loss, _ = policy_loss(inp, cfg("dapo", tis_cap=None))
    assert loss.item() == pytest.approx(-math.exp(0.2))


def test_dual_clip_bounds_negative_advantage():
    inp = inputs([math.log(5.0)], [0.0], [-1.0])
    loss, _ = policy_loss(inp, cfg("grpo", tis_cap=None, dual_clip=3.0))
    assert loss.item() == pytest.approx(3.0)


def test_masked_tokens_get_exactly_zero_gradient_even_with_garbage():
    inp = inputs([-1.0, 50.0, -1.0], [-1.0, -1e9, -1.0], [1.0, 1e6, 1.0], mask=[True, False, True],
                 rollout=[-1.0, float("inf"), -1.0])  # fmt: skip
    loss, _ = policy_loss(
        inp,
        cfg("grpo", kl_coef=0.1),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert inp.logprobs_T.grad[1].item() == 0.0
    assert inp.logprobs_T.grad[0].item() != 0.0


def test_tis_scales_each_token_by_its_capped_weight_only():
    base = inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0])
    policy_loss(base, cfg("dapo", tis_cap=None))[0].backward()
    # token 0: pi_old/pi_rollout = e^1 capped at 2; token 1: e^-0.5 (below the cap, kept)
    tis = inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], rollout=[-2.0, -0.5])
    loss, m = policy_loss(tis, cfg("dapo", tis_cap=2.0))
    loss.backward()
    w = torch.tensor([2.0, math.exp(-0.5)], dtype=torch.float64)
    assert torch.allclose(tis.logprobs_T.grad, base.logprobs_T.grad * w)
    assert m["tis_weight"] == pytest.approx(w.mean().item())
    # no mismatch -> TIS changes nothing
    same = inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0])
    policy_loss(same, cfg("dapo", tis_cap=2.0))[0].backward()
    assert torch.equal(same.logprobs_T.grad, base.logprobs_T.grad)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    inp = inputs([-1.0], [-1.0], [0.0], ref_logprobs_T=torch.tensor([-1.5], dtype=torch.float64))
    loss, m = policy_loss(inp, cfg("dapo", kl_coef=0.1, kl_estimator="k3"))
    assert loss.item() == pytest.approx(0.1 * (math.exp(-0.5) - 0.5))
    assert m["kl_ref"] == pytest.approx(math.exp(-0.5) - 0.5)


def test_entropy_bonus():
    inp = inputs(
        [-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], entropy_T=torch.tensor([2.0, 4.0], dtype=torch.float64)
    )
    loss, m = policy_loss(inp, cfg("dapo", entropy_coef=0.01))
    assert loss.item() == pytest.approx(-0.03) and m["entropy"] == pytest.approx(3.0)


@pytest.mark.parametrize("num_seqs", [None, 2])  # read from the ids (a device sync) or given by the learner's host
def test_gspo_sequence_ratio_and_gradient(num_seqs):
    # seq 0: log-ratios 0.1, 0.3 (mean 0.2); seq 1: 0.0
    inp = inputs(
        [0.1, 0.3, -1.0], [0.0, 0.0, -1.0], [1.0, 1.0, 2.0], seq=[0, 0, 1], mode="seq_mean_token_mean",
        num_seqs=num_seqs,
    )
    c = cfg("gspo", tis_cap=None, clip_low=0.5, clip_high=0.5)
    loss, _ = policy_loss(inp, c)
    loss.backward()
    s0 = math.exp(0.2)
    assert loss.item() == pytest.approx(-(s0 * 1.0) / 2 - 2.0 / 2)
    # d/dl_t = -A s_i / (N |y_i|): the sequence ratio flows to every token of its episode
    assert inp.logprobs_T.grad.tolist() == pytest.approx([-s0 / 4, -s0 / 4, -2.0 / 2])


def test_token_weight_modes():
    mask = torch.tensor([False, True, True, False, True])
    seq = torch.tensor([0, 0, 0, 1, 1])
    assert token_weights(mask, seq, "token_mean", 8).tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3])
    assert token_weights(mask, seq, "seq_mean_token_mean", 8).tolist() == pytest.approx(
        [0, 0.25, 0.25, 0, 0.5]
    )
    assert token_weights(mask, seq, "constant", 8).tolist() == pytest.approx([0, 1 / 16, 1 / 16, 0, 1 / 16])


def test_value_loss_clipped():
    v = torch.tensor([0.0, 1.5], dtype=torch.float64, requires_grad=True)
    inp = inputs([-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], values_T=v,
                 old_values_T=torch.tensor([0.0, 1.0], dtype=torch.float64),
                 value_targets_T=torch.tensor([1.0, 1.0], dtype=torch.float64),
                 value_weights_T=torch.tensor([0.5, 0.5], dtype=torch.float64))  # fmt: skip
    loss, m = policy_loss(inp, cfg("ppo", value_clip=0.2))
    # token 0: (0-1)^2 = 1 (clip gives the same); token 1: max((0.5)^2, (1.2-1)^2) = 0.25
    assert m["value_loss"] == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * 0.25))
    assert loss.item() == pytest.approx(0.5 * m["value_loss"])


def test_grpo_equals_clipped_loss_with_group_baseline():
    """GRPO through the whole pipeline == the textbook formula written out by hand."""
    rewards = [1.0, 0.0, 0.0, 0.5]
    g = group(rewards, tokens=3)
    c = cfg("grpo", tis_cap=None, adv_eps=0.0)
    adv, _ = compute_advantages([g], c)
    batch = pack(rows_from_groups([g], adv), c.loss_agg, c.norm_tokens)
    torch.manual_seed(0)
    lp = (-torch.rand(batch.num_tokens, dtype=torch.float64)).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(batch.num_tokens, dtype=torch.float64)
    inp = LossInputs(lp, old, old, batch.advantages_T.double(), batch.token_weights_T.double(), batch.loss_mask_T,
                     batch.seq_ids_T)  # fmt: skip
    loss, _ = policy_loss(inp, c)
    mean, std = sum(rewards) / 4, torch.tensor(rewards).std(unbiased=False).item()
    by_hand = 0.0
    for i, r in enumerate(rewards):
        a = (r - mean) / std
        toks = [t for t in range(batch.num_tokens) if batch.seq_ids_T[t] == i and batch.loss_mask_T[t]]
        terms = []
        for t in toks:
            ratio = torch.exp(lp[t] - old[t])
            terms.append(-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a))
        by_hand = by_hand + sum(terms) / len(terms) / 4
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)  # advantages are float32
    (g1,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (g2,) = torch.autograd.grad(by_hand, lp)
    assert torch.allclose(g1, g2)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops that read a tensor's values back to the host (a device sync on a GPU): item/bool/float, nonzero,
    boolean-mask indexing."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "index"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in self.READS and (name != "index" or any(getattr(i, "dtype", None) == torch.bool for i in args[1])):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_loss_stats_and_the_mismatch_meter_read_nothing_back_and_match_the_floats():
    """Between a micro-batch's forward and backward the learner reads nothing back to the host: the loss's
    metrics stay 0-dim device tensors (``policy_loss_stats``) and the mismatch meter masks instead of indexing;
    their values equal ``policy_loss``'s floats and the indexed formulas, an all-masked micro-batch included."""
    from rl.learner import _MismatchMeter
    from rl.losses import metric_floats, policy_loss_stats

    inp = inputs([-1.0, -2.5, -0.3, -4.0], [-1.2, -2.0, -0.3, -3.0], [1.0, -2.0, 0.5, 1.5],
                 mask=[True, True, False, True], rollout=[-1.1, -2.2, -0.5, -3.5])  # fmt: skip
    c = cfg("dapo", tis_cap=2.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    inp.ref_logprobs_T = torch.tensor([-1.0, -2.0, -0.4, -3.8], dtype=torch.float64)
    inp.entropy_T = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64)
    meter = _MismatchMeter()
    reads = _HostReads()
    with reads:
        loss, stats = policy_loss_stats(inp, c)
        for mask in (inp.loss_mask_T, torch.zeros(4, dtype=torch.bool)):
            meter.add(inp.old_logprobs_T, inp.rollout_logprobs_T, mask)
    assert reads.seen == []
    loss_f, floats = policy_loss(inp, c)
    assert metric_floats(stats) == pytest.approx(floats, rel=1e-12) and float(loss.detach()) == float(loss_f.detach())
    d_T = (inp.old_logprobs_T - inp.rollout_logprobs_T)[inp.loss_mask_T]
    got = meter.result()
    assert got["mismatch/tokens"] == 3
    assert got["mismatch/logprob_abs_mean"] == pytest.approx(float(d_T.abs().mean()))
    assert got["mismatch/logprob_abs_max"] == pytest.approx(float(d_T.abs().max()))
    assert got["mismatch/kl"] == pytest.approx(float((d_T.exp() - d_T - 1).mean()))
    none = _MismatchMeter()
    none.add(inp.old_logprobs_T, inp.rollout_logprobs_T, torch.zeros(4, dtype=torch.bool))
    assert none.result()["mismatch/tokens"] == 0 and none.result()["mismatch/logprob_abs_max"] == 0.0
