"""The model learns: a few optimizer steps on a fixed batch cut the loss, every parameter
(gate A_log/dt_bias, conv weights, AttnRes queries, router) gets a gradient."""

from __future__ import annotations

import torch
from model_cases import tiny_config

from model.balancing import ExpertBalancer
from model.modeling import HybridForCausalLM


def test_loss_drops_with_quantile_balancing_on():
    model = HybridForCausalLM(tiny_config(vocab_size=64)).train()
    balancer = ExpertBalancer(model, mode="quantile")
    pattern = torch.arange(48) % 12  # a periodic sequence: learnable from context
    ids = torch.stack([pattern, (pattern + 5) % 64])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if step == 0:
            no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            # with zero pseudo-queries the AttnRes key norms' gains have an exactly-zero gradient
            assert [n for n in no_grad if not n.endswith("_res.norm.weight")] == []
        opt.step()
        opt.zero_grad()
        metrics = balancer.step()
        losses.append(float(loss.detach()))
    assert len(metrics) == len(model.config.moe_layer_indices)
    assert losses[-1] < 0.5 * losses[0], losses
