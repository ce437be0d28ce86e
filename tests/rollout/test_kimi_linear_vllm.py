"""A converted Kimi Linear checkpoint (``python -m model.convert kimi_linear``) in our vLLM plugin:
greedy tokens equal our learner's ``generate`` and are greedy under transformers'
``KimiLinearForCausalLM`` too; sampled-token logprobs equal the learner's (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import KIMI_TINY, SMALL_ENGINE
from test_vllm_engine import LOGPROB_TOL, _prompt, learner_logprobs

from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, our learner model, our checkpoint dir)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from model.convert import main
    from model.modeling import HybridForCausalLM
    from rollout.tokenizer import load_tokenizer

    torch.manual_seed(0)
    theirs = KimiLinearForCausalLM(KimiLinearConfig(**KIMI_TINY)).eval()
    with torch.no_grad():  # spread router scores so top-k choices are not near-ties
        for name, p in theirs.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(20.0)
    src, dst = tmp_path_factory.mktemp("kl_src"), tmp_path_factory.mktemp("kl_ours")
    theirs.save_pretrained(src)
    assert main(["kimi_linear", str(src), str(dst)]) == 0
    load_tokenizer().save_pretrained(str(dst))
    return theirs, HybridForCausalLM.from_pretrained(dst).eval(), dst


@pytest.fixture(scope="module")
def worker(converted):
    from rollout.worker import RolloutWorker

    w = RolloutWorker(dict(model_path=str(converted[2]), reuse="session", **SMALL_ENGINE))
    yield w
    w.shutdown()


def test_converted_greedy_tokens_equal_learner_and_transformers(worker, converted):
    theirs, ours, _ = converted
    prompts = {"k0": _prompt(0, 40), "k1": _prompt(1, 75)}
    outs = worker.generate([TurnRequest(s, p, max_tokens=12, temperature=0.0) for s, p in prompts.items()])
    for o in outs:
        prompt = prompts[o.session_id]
        assert o.token_ids == ours.generate(torch.tensor([prompt]), max_new_tokens=12)[0, -12:].tolist()
        with torch.no_grad():  # greedy under transformers: each token is its argmax given the prefix
            logits = theirs(torch.tensor([prompt + o.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == o.token_ids
    worker.end_sessions(list(prompts))


def test_converted_sampled_logprobs_equal_learner(worker, converted):
    _, ours, _ = converted
    prompt = _prompt(2, 60)
    o = worker.generate([TurnRequest("kl", prompt, max_tokens=24, temperature=1.0)])[0]
    ref = learner_logprobs(ours, prompt + o.token_ids)[len(prompt) - 1 :]
    diff = (torch.tensor(o.logprobs) - ref).abs().max().item()
    assert diff < LOGPROB_TOL, diff
    worker.end_sessions(["kl"])
