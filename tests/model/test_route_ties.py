"""bench/route_ties.py's gaps read off a real model (CPU): how near a tie each token's expert selection was, the
figure bench/rollout_throughput.py reports where two engines first chose other experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "route_ties.py"


@pytest.fixture(scope="module")
def model():
    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from model.moe import MoEGate

    config = HybridConfig.from_yaml(Path(__file__).resolve().parents[2] / "configs/model/cpu_tiny.yaml")
    torch.manual_seed(0)
    m = HybridForCausalLM(config).eval()
    gates = [g for g in m.modules() if isinstance(g, MoEGate)]
    k = gates[0].top_k
    with torch.no_grad():
        gates[0].weight.zero_()  # every score 0.5: each selection an exact tie
        gates[1].weight.zero_()  # the first k experts ahead by exactly 1 through the selection bias
        gates[1].e_score_correction_bias.zero_()
        gates[1].e_score_correction_bias[:k] = 1.0
    return m


def test_selection_gaps_are_the_kth_against_the_next_score(bench, model):
    from model.moe import MoEGate

    tokens = torch.randint(10, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    gates = [g for g in model.modules() if isinstance(g, MoEGate)]
    before = [(g.top_fn, g.select_fn) for g in gates]
    gaps_TL = bench.selection_gaps(model, tokens)
    assert gaps_TL.shape == (40, len(gates)) and len(gates) >= 3
    assert torch.equal(gaps_TL[:, 0], torch.zeros(40))
    assert torch.equal(gaps_TL[:, 1], torch.ones(40))
    free = gaps_TL[:, 2:]
    assert bool((free >= 0).all()) and bool((free > 0).any()) and float(free.max()) < 1.0
    assert [(g.top_fn, g.select_fn) for g in gates] == before  # the gates as they were


def test_a_flip_gap_is_placed_among_the_sequences_gaps(bench, model):
    tokens = torch.randint(10, 500, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    layers = bench.selection_gaps(model, tokens).shape[1]
    tie = bench.flip_gap(model, tokens, 20, 0)
    assert (tie["gap"], tie["quantile"], tie["token_layers"]) == (0.0, 0.0, 21 * layers)
    wide = bench.flip_gap(model, tokens, 20, 1)
    assert wide["gap"] == 1.0 and wide["quantile"] == (21 * layers - 21) / (21 * layers)  # all but layer 1's below
    with pytest.raises(ValueError, match="position 30 outside"):
        bench.flip_gap(model, tokens, 30, 0)
    with pytest.raises(ValueError, match=f"MoE layer {layers} outside"):
        bench.flip_gap(model, tokens, 5, layers)
