"""Bucket padding of the learner's micro-batches (``learner.token_buckets``, what ``learner.cuda_graphs`` runs on):
the filler sequence changes no logprob, loss, gradient, metric or routing statistic of the batch's own tokens."""

import dataclasses

import numpy as np
import pytest
import torch
from test_learner import batches_for, make_cfg, make_group

from model.moe import MoEGate
from rl.config import ConfigError
from rl.config_checks import config_errors
from rl.learner import Learner, _with_filler


def _pair(*overrides):
    """Two learners of the same initial weights, the second padding every micro-batch to a multiple of 64."""
    plain = make_cfg(*overrides)
    padded = make_cfg(*overrides, "learner.token_buckets=64")  # 4096 / 64: multiples of 64 tokens
    return (plain, Learner(plain.model, plain.learner, plain.algorithm)), (
        padded, Learner(padded.model, padded.learner, padded.algorithm))  # fmt: skip


def _with_routes(group, seed=0):
    """Engine-recorded experts on every sampled token (prompt tokens route freely); the filler routes freely."""
    rng = np.random.default_rng(seed)
    for ep in group.episodes:
        for t in ep.turns:
            t.routed_experts = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(3)])
                                         for _ in t.token_ids]).astype(np.uint16)  # fmt: skip
    return group


def test_the_filler_is_one_sequence_of_free_routes_up_to_the_bucket():
    (c, learner), _ = _pair()
    batch = batches_for(learner, c, _with_routes(make_group()))[0][0]
    T = batch.num_tokens
    ids, cu, routes, filler = _with_filler(batch, 64, replay=True)
    assert filler == 64 - T % 64 and ids.numel() == T + filler and (ids[T:] == 0).all()
    assert cu.tolist() == [*batch.cu_seqlens_N1.tolist(), T + filler]
    assert routes is batch.routed_experts_TLK  # the model adds the filler's -1 rows on the device
    assert _with_filler(batch, 0, replay=True)[3] == 0 and _with_filler(batch, T, replay=False)[2:] == (None, 0)
    # a static layout's sequence bucket: empty sequences after the filler, up to a power of two
    n = len(cu) - 1
    _, cu_pow2, _, _ = _with_filler(batch, 64, replay=True, seqs_pow2=True)
    want = 1 << (n - 1).bit_length()
    assert len(cu_pow2) - 1 == want and cu_pow2[: n + 1].tolist() == cu.tolist()
    assert (cu_pow2[n:] == T + filler).all() and (want > n or n & (n - 1) == 0)


@pytest.mark.parametrize("balancing,static", [("quantile", False), ("quantile_histogram", False), ("quantile", True)])
def test_a_padded_step_equals_the_unpadded_one(balancing, static):
    """Logprobs and entropy of the batch's tokens, the step's metrics, every parameter after the AdamW step and the
    balancer's new biases (statistics over the batch's own tokens only) agree to fp32 rounding, with routing replay
    (-1 filler routes) and the balancer updating. The histogram mode's biases within one bin's width: a score that
    rounds differently in a longer GEMM may cross a bin edge there (the exact mode is continuous in the scores).
    ``static``: the layout ``learner.cuda_graphs`` runs on (empty sequences up to a power of two, varlen attention's
    longest length the token count, the KDA plan padded), set here on the CPU learner by hand."""
    (c, a), (_, b) = _pair("learner.balancer=update", f"model.arch.moe_balancing={balancing}")
    if static:
        b.cfg = dataclasses.replace(b.cfg, cuda_graphs=True)
        assert b.static_layout
    group = _with_routes(make_group(3))
    mbs = batches_for(a, c, group)
    assert any(mb.num_tokens % 64 for mbs_i in mbs for mb in mbs_i)  # the padding is exercised
    if static:  # and the empty sequences
        assert len(_with_filler(mbs[0][0], 64, False, seqs_pow2=True)[1]) > len(_with_filler(mbs[0][0], 64, False)[1])
    fa, fb = a.forward(mbs[0][0], need_entropy=True), b.forward(mbs[0][0], need_entropy=True)
    torch.testing.assert_close(fb.logprobs_T, fa.logprobs_T, rtol=0, atol=1e-5)
    torch.testing.assert_close(fb.entropy_T, fa.entropy_T, rtol=0, atol=1e-5)
    ma, mb = a.train_step(mbs), b.train_step(mbs)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6), k
    for (name, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        torch.testing.assert_close(pb, pa, rtol=0, atol=1e-5, msg=name)
    gates = [m for m in a.policy.modules() if isinstance(m, MoEGate)]
    width = 2.0 / gates[0].balancing_bins  # the histogram's range is [min - 1, max + 1] of a zero bias
    moved = False
    for ga, gb in zip(gates, [m for m in b.policy.modules() if isinstance(m, MoEGate)]):
        atol = 1e-5 if balancing == "quantile" else width
        torch.testing.assert_close(gb.e_score_correction_bias, ga.e_score_correction_bias, rtol=0, atol=atol)
        moved |= bool(ga.e_score_correction_bias.abs().sum() > 0)
        assert gb.uncounted_tokens == 0  # reset after every forward
    assert moved


def test_counting_the_filler_would_move_the_biases():
    """The routers' exclusion is what keeps the biases equal: the same padded forwards with the filler counted
    give other statistics (a check that the test above can fail)."""
    (c, a), (_, b) = _pair("learner.balancer=update", "model.arch.moe_balancing=quantile")
    mbs = batches_for(a, c, make_group(3))
    real = MoEGate._record

    def counting_all(self, *args):
        saved, self.uncounted_tokens = self.uncounted_tokens, 0
        try:
            return real(self, *args)
        finally:
            self.uncounted_tokens = saved

    a.train_step(mbs)
    MoEGate._record = counting_all
    try:
        b.train_step(mbs)
    finally:
        MoEGate._record = real
    gates = zip(*([m for m in learner.policy.modules() if isinstance(m, MoEGate)] for learner in (a, b)))
    assert any(not torch.allclose(ga.e_score_correction_bias, gb.e_score_correction_bias, atol=1e-5)
               for ga, gb in gates)  # fmt: skip


def test_cuda_graphs_settings_are_checked():
    bad = make_cfg()
    bad.learner.cuda_graphs, bad.learner.device, bad.learner.token_buckets = True, "cpu", 0
    errors = config_errors(bad)
    assert any("learner.cuda_graphs: replays compiled blocks: needs learner.compile=true" in e for e in errors)
    assert any("learner.cuda_graphs: needs a CUDA device" in e for e in errors)
    assert any("learner.token_buckets: must be >= 1" in e for e in errors)
    with pytest.raises(ConfigError, match=r"learner\.cuda_graphs"):
        make_cfg("learner.cuda_graphs=true")
    c = make_cfg("learner.cuda_graphs=true", "learner.compile=true")  # device auto: the CPU here
    with pytest.raises(ValueError, match=r"learner\.cuda_graphs needs the single-process learner on a CUDA device"):
        Learner(c.model, c.learner, c.algorithm)
    learner = Learner(*(lambda k: (k.model, dataclasses.replace(k.learner, micro_batch_tokens=1000), k.algorithm))(
        make_cfg("learner.token_buckets=8")))  # fmt: skip
    assert learner.bucket_tokens == 125
