"""Learner invariants on a tiny hybrid model: packing, routing replay, updates, mismatch, resume, LoRA."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from rl_factories import episode, turn

from envs.types import EpisodeGroup
from rl.advantages import compute_advantages
from rl.batching import minibatches, pack, rows_from_groups
from rl.config import load_config
from rl.learner import Learner

ARCH = (
    "model.arch={vocab_size: 128, hidden_size: 32, num_hidden_layers: 4, num_attention_heads: 2, kv_lora_rank: 16,"
    " qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8, num_experts: 4, num_experts_per_token: 2,"
    " moe_intermediate_size: 32, intermediate_size: 64, first_k_dense_replace: 1, routed_expert_hidden_size: 16,"
    " linear_attn_config: {head_dim: 8, num_heads: 2}}"
)


def make_cfg(*overrides):
    return load_config(None, [ARCH, "learner.lr=1e-2", "rollout.group_size=4", *overrides])


def make_group(seed=0, n=4, rewards=None):
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(1, 128, (k,), generator=g).tolist()
    rewards = rewards or [float(i % 2) for i in range(n)]
    eps = [
        episode([turn(rand(6), rand(4)), turn(rand(3), rand(5))], r, eid=f"e{i}")
        for i, r in enumerate(rewards)
    ]
    return EpisodeGroup("t", eps)


def batches_for(learner, cfg, group, fill_rollout=True):
    adv, _ = compute_advantages([group], cfg.algorithm)
    rows = rows_from_groups([group], adv)
    if fill_rollout:  # rollout logprobs = what this policy gives (a perfectly matched engine)
        b = pack(rows, "token_mean", 1)
        lp = learner.logprobs(b)
        for i, r in enumerate(rows):
            r.rollout_logprobs = [x if m else 0.0 for x, m in zip(lp[b.seq_ids_T == i].tolist(), r.loss_mask)]
    a = cfg.algorithm
    return minibatches(rows, a.num_minibatches, a.loss_agg, a.norm_tokens, cfg.learner.micro_batch_tokens)


@pytest.fixture(scope="module")
def cfg():
    return make_cfg()


def test_packed_equals_separate(cfg):
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)
    group = make_group()
    rows = rows_from_groups([group], [[[0.0, 0.0]] * 4])
    packed = learner.logprobs(pack(rows, "token_mean", 1))
    alone = torch.cat([learner.logprobs(pack([r], "token_mean", 1)) for r in rows])
    assert torch.allclose(packed, alone, atol=1e-5)


def test_step0_mismatch_is_logged_and_tiny_when_engine_matches(cfg):
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)
    m = learner.train_step(batches_for(learner, cfg, make_group()))
    assert m["mismatch/tokens"] == 36
    assert m["mismatch/logprob_abs_mean"] < 1e-3 and m["mismatch/kl"] < 1e-6


def test_positive_advantage_raises_its_logprob(cfg):
    c = make_cfg("algorithm.tis_cap=null", "learner.grad_clip=100")
    learner = Learner(c.model, c.learner, c.algorithm)
    group = make_group(rewards=[1.0, 0.0, 0.0, 0.0])
    mbs = batches_for(learner, c, group)
    before = learner.logprobs(mbs[0][0])
    learner.train_step(mbs)
    after = learner.logprobs(mbs[0][0])
    b = mbs[0][0]
    delta = [float((after - before)[(b.seq_ids_T == i) & b.loss_mask_T].sum()) for i in range(4)]
    assert delta[0] > 0 and all(d < delta[0] for d in delta[1:])


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    results = []
    for tokens in (4096, 20):
        c = make_cfg(f"learner.micro_batch_tokens={tokens}", "learner.grad_clip=1e9")
        learner = Learner(c.model, c.learner, c.algorithm)
        # plain SGD: the update is the accumulated gradient itself (Adam's first step is ~sign(g))
        params = [p for g in learner.optimizer.param_groups for p in g["params"]]
        learner.optimizer = torch.optim.SGD(params, lr=c.learner.lr)
        start = torch.cat([p.detach().flatten() for p in params])
        mbs = batches_for(learner, c, make_group())
        assert len(mbs[0]) == (1 if tokens == 4096 else 4)
        learner.train_step(mbs)
        results.append(torch.cat([p.detach().flatten() for p in params]) - start)
    assert results[0].abs().max() > 1e-6
    assert torch.allclose(results[0], results[1], atol=1e-7)


def test_routing_replay_changes_exactly_the_replayed_routes(cfg):
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)
    group = make_group()
    rows = rows_from_groups([group], [[[0.0, 0.0]] * 4])
    b = pack(rows, "token_mean", 1)
    ids, cu = b.input_ids_T[None], b.cu_seqlens_N1
    free = learner.policy(ids, cu_seqlens=cu, output_router_choices=True).router_choices
    base = learner.logprobs(b)
    # replaying the engine's own choices (some left at -1 = route freely) changes nothing
    own = free.clone()
    own[::3] = -1
    assert torch.allclose(learner.logprobs(dataclasses.replace(b, routed_experts_TLK=own)), base, atol=1e-6)
    # a different expert at one token changes that token's successors only, never earlier tokens
    t = 12
    other = free.clone()
    other[t, 0, 0] = next(e for e in range(4) if e not in free[t, 0].tolist())
    changed = learner.logprobs(dataclasses.replace(b, routed_experts_TLK=other))
    seq_end = int(b.cu_seqlens_N1[1])
    assert torch.equal(changed[: t + 1], base[: t + 1])  # logprob of token t depends on tokens < t
    assert not torch.allclose(changed[t + 1 : seq_end], base[t + 1 : seq_end])
    assert torch.equal(changed[seq_end:], base[seq_end:])  # other sequences untouched
    # the router still learns under replay: its weights get a gradient
    learner.policy.zero_grad()
    out = learner.forward(dataclasses.replace(b, routed_experts_TLK=other))
    out.logprobs_T.sum().backward()
    gate = learner.policy.model.layers[1].block_sparse_moe.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_balancer_frozen_by_default_and_updated_when_asked():
    for mode, should_change in (("frozen", False), ("update", True)):
        c = make_cfg(f"learner.balancer={mode}")
        learner = Learner(c.model, c.learner, c.algorithm)
        gate = learner.policy.model.layers[1].block_sparse_moe.gate
        before = gate.e_score_correction_bias.clone()
        learner.train_step(batches_for(learner, c, make_group()))
        assert (not torch.equal(before, gate.e_score_correction_bias)) == should_change
        assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in learner.policy.state_dict()


def test_exact_resume_from_state(tmp_path, cfg):
    a = Learner(cfg.model, cfg.learner, cfg.algorithm)
    a.train_step(batches_for(a, cfg, make_group(0)))
    a.save(str(tmp_path / "learner.pt"))
    m_a = a.train_step(batches_for(a, cfg, make_group(1)))
    b = Learner(cfg.model, cfg.learner, cfg.algorithm)
    b.load(str(tmp_path / "learner.pt"))
    m_b = b.train_step(batches_for(b, cfg, make_group(1)))
    assert m_a == m_b


def test_export_weights_and_reload(tmp_path, cfg):
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)
    learner.train_step(batches_for(learner, cfg, make_group()))
    upd = learner.export_weights(str(tmp_path))
    assert upd.version == 1 and not upd.adapter_only
    c2 = dataclasses.replace(cfg.model, init_from=upd.path)
    other = Learner(c2, cfg.learner, cfg.algorithm)
    b = pack(rows_from_groups([make_group()], [[[0.0, 0.0]] * 4]), "token_mean", 1)
    assert torch.allclose(other.logprobs(b), learner.logprobs(b))


def test_lora_trains_adapters_only_and_exports_them(tmp_path):
    c = make_cfg("learner.lora.enabled=true", "learner.lora.r=4")
    learner = Learner(c.model, c.learner, c.algorithm)
    trainable = [n for n, p in learner.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.clone() for n, p in learner.policy.named_parameters() if not p.requires_grad}
    learner.train_step(batches_for(learner, c, make_group()))
    assert all(
        torch.equal(p, frozen_before[n]) for n, p in learner.policy.named_parameters() if not p.requires_grad
    )
    upd = learner.export_weights(str(tmp_path / "a"), adapter_only=True)
    assert upd.adapter_only
    files = {p.name for p in Path(upd.path).iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    # merged export (what the vLLM worker loads) == the adapted policy
    merged = learner.export_weights(str(tmp_path / "m"))
    assert not merged.adapter_only
    size = lambda d, f: Path(d, f).stat().st_size
    assert size(upd.path, "adapter_model.safetensors") < 0.5 * size(merged.path, "model.safetensors")
    other = Learner(dataclasses.replace(c.model, init_from=merged.path), make_cfg().learner, c.algorithm)
    b = pack(rows_from_groups([make_group()], [[[0.0, 0.0]] * 4]), "token_mean", 1)
    assert torch.allclose(other.logprobs(b), learner.logprobs(b), atol=1e-5)


def test_ppo_value_head_and_several_minibatches():
    c = make_cfg(
        "algorithm.name=ppo", "algorithm.credit=gae", "algorithm.num_minibatches=2", "algorithm.ppo_epochs=2"
    )
    learner = Learner(c.model, c.learner, c.algorithm)
    group = make_group()
    b = pack(rows_from_groups([group], [[[0.0, 0.0]] * 4]), "token_mean", 1)
    values = learner.turn_values(b)
    assert [len(v) for v in values] == [2, 2, 2, 2]
    adv, targets = compute_advantages([group], c.algorithm, values=[values])
    rows = rows_from_groups([group], adv, targets)
    mbs = minibatches(rows, 2, c.algorithm.loss_agg, 1, 4096)
    m = learner.train_step(mbs)
    assert np.isfinite(m["value_loss"]) and m["learner/version"] == 1.0


def test_a_step_of_several_updates_reads_its_metrics_once_and_averages_them(monkeypatch):
    """Each optimizer update's metrics stay device tensors (no read, so no sync, between updates); the step reports
    their mean over the 4 updates (2 mini-batches x 2 epochs) and the maximum of the "_max" ones, as read at the end."""
    from rl.losses import metric_floats

    c = make_cfg("algorithm.num_minibatches=2", "algorithm.ppo_epochs=2")
    learner = Learner(c.model, c.learner, c.algorithm)
    seen, update = [], learner._update

    def spy(*args):
        m = update(*args)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in m.values()), m
        seen.append(metric_floats(m))  # the test's own read, after the update
        return m

    monkeypatch.setattr(learner, "_update", spy)
    m = learner.train_step(batches_for(learner, c, make_group(n=4)))
    assert len(seen) == 4 and any(k.endswith("_max") for k in seen[0])
    for k in seen[0]:
        values = [s[k] for s in seen]
        want = max(values) if k.endswith("_max") else sum(values) / 4
        assert m[k] == pytest.approx(want, rel=1e-6, abs=1e-9), k


def test_activation_checkpointing_gives_the_same_update():
    results = []
    for ac in ("false", "true"):
        c = make_cfg(f"learner.activation_checkpointing={ac}")
        learner = Learner(c.model, c.learner, c.algorithm)
        m = learner.train_step(batches_for(learner, c, make_group()))
        results.append((m["loss"], torch.cat([p.detach().flatten() for p in learner.policy.parameters()])))
    assert results[0][0] == pytest.approx(results[1][0])
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def _one_update(*overrides, sgd=False):
    c = make_cfg(*overrides, "algorithm.entropy_coef=0.01", "learner.grad_clip=1e9")
    learner = Learner(c.model, c.learner, c.algorithm)
    if sgd:  # the update is the gradient itself (Adam's first step is ~sign(g), which hides nothing)
        learner.optimizer = torch.optim.SGD(list(learner.policy.parameters()), lr=c.learner.lr)
    start = torch.cat([p.detach().flatten() for p in learner.policy.parameters()])
    m = learner.train_step(batches_for(learner, c, make_group()))
    return m, torch.cat([p.detach().flatten() for p in learner.policy.parameters()]) - start


def test_fast_paths_give_the_reference_update():
    """Grouped MoE and the chunked LM head (logprob + entropy with its gradient) against the loops."""
    ref_m, ref_d = _one_update("learner.fast_paths=reference", sgd=True)
    fast_m, fast_d = _one_update("learner.fast_paths='moe=grouped,lm_head=chunked'", sgd=True)
    for key in ("loss", "grad_norm", "entropy"):
        assert fast_m[key] == pytest.approx(ref_m[key], rel=1e-5), key
    assert float(ref_d.abs().max()) > 1e-4
    assert float((ref_d - fast_d).norm() / ref_d.norm()) < 1e-5


@pytest.mark.parametrize("scope", ["ffn", "attention"])
def test_selective_checkpointing_gives_the_same_update(scope):
    plain_m, plain_p = _one_update()
    m, p = _one_update("learner.activation_checkpointing=true", f"learner.checkpoint_scope={scope}")
    assert m["loss"] == pytest.approx(plain_m["loss"])
    assert torch.allclose(plain_p, p, atol=1e-6)


def test_bad_learner_kernel_settings_are_named():
    for override, field in (
        ("learner.checkpoint_scope=everything", "learner.checkpoint_scope"),
        ("learner.fast_paths='moe=fastest'", "learner.fast_paths"),
    ):
        c = make_cfg(override)
        with pytest.raises(ValueError, match=field):
            Learner(c.model, c.learner, c.algorithm)


def test_adamw_is_fused_for_a_single_process_learner_on_cuda_only(cfg):
    """One multi-tensor AdamW kernel on CUDA (what bench/learner_mfu.py times), torch's default elsewhere."""
    from rl.learner import fused_adamw

    assert fused_adamw(torch.device("cuda"), None) is True
    assert fused_adamw(torch.device("cuda"), object()) is None  # the sharded learner
    assert fused_adamw(torch.device("cpu"), None) is None
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)  # this machine's CPU learner
    assert learner.optimizer.defaults["fused"] is None


def test_clipping_inside_the_fused_step_gives_the_clipped_update():
    """A fused AdamW clips inside its step (``grad_scale``); the update and the reported norm are those of
    ``clip_grad_norm_`` followed by the step, with the clip engaged (norm far above ``grad_clip``)."""
    c = make_cfg("learner.grad_clip=0.01")
    out = []
    for fused in (True, False):
        learner = Learner(c.model, c.learner, c.algorithm)
        params = [p for g in learner.optimizer.param_groups for p in g["params"]]
        learner.optimizer = torch.optim.AdamW(params, lr=c.learner.lr, fused=fused)  # on CPU too
        metrics = learner.train_step(batches_for(learner, c, make_group()))
        moments = torch.cat([learner.optimizer.state[p]["exp_avg"].flatten() for p in params])
        out.append((metrics["grad_norm"], torch.cat([p.detach().flatten() for p in params]), moments))
        assert (getattr(learner.optimizer, "grad_scale", None) is not None) == fused
    (norm_f, params_f, m_f), (norm_u, params_u, m_u) = out
    assert norm_f == pytest.approx(norm_u, rel=1e-6) and norm_f > 100 * c.learner.grad_clip
    assert torch.allclose(m_f, m_u, rtol=1e-5, atol=1e-12)  # the first moment is the clipped gradient itself
    assert torch.allclose(params_f, params_u, rtol=0, atol=1e-6)


@pytest.mark.parametrize("saved_fused, loaded_fused", [(False, True), (True, False)])
def test_a_resumed_optimizer_keeps_this_learners_kernels(tmp_path, saved_fused, loaded_fused):
    """A checkpoint's optimizer state carries the saving learner's ``fused`` flag; the resumed learner keeps its
    own (a GPU run resuming a CPU or sharded run's checkpoint stays fused, and clips inside the step; a fused
    flag loaded into a learner that clips apart would meet a fused-only grad_scale) and continues the run."""
    c = make_cfg("learner.grad_clip=0.01")

    def learner_with(fused: bool) -> Learner:
        learner = Learner(c.model, c.learner, c.algorithm)
        params = [p for g in learner.optimizer.param_groups for p in g["params"]]
        learner.optimizer = torch.optim.AdamW(params, lr=c.learner.lr, fused=fused)
        return learner

    a = learner_with(saved_fused)
    a.train_step(batches_for(a, c, make_group(0)))
    a.save(str(tmp_path / "learner.pt"))
    m_a = a.train_step(batches_for(a, c, make_group(1)))
    b = learner_with(loaded_fused)
    b.load(str(tmp_path / "learner.pt"))
    assert all(bool(g["fused"]) == loaded_fused for g in b.optimizer.param_groups)
    m_b = b.train_step(batches_for(b, c, make_group(1)))
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-5)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-5, abs=1e-7)
