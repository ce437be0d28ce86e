import torch
from model_cases import PRESETS

from model import HybridConfig, HybridForCausalLM


def test_cpu_tiny_forward_backward():
    config = HybridConfig.from_yaml(PRESETS / "cpu_tiny.yaml")
    model = HybridForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    out = model(ids, labels=ids, output_router_choices=True)
    assert out.logits.shape == (2, 24, config.vocab_size)
    assert torch.isfinite(out.loss)
    n_moe = len(config.moe_layer_indices)
    assert out.router_choices.shape == (48, n_moe, config.num_experts_per_token)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
