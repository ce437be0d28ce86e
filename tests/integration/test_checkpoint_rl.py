"""RL from a converted checkpoint with its own tokenizer and chat template, end to end: a tiny random
transformers ``KimiLinearForCausalLM`` and a local tokenizer with a Kimi-style template are saved as a
Hugging Face checkpoint, converted (``python -m model.convert kimi_linear``), and ``python -m rl.train
--config configs/exp/from_checkpoint.yaml model.init_from=DST`` runs one GRPO step on it (local Ray, a
vLLM rollout worker on the converted weights, the Kimi-style renderer, evaluation, checkpoint)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import CONFIGS_ROOT
from rl.metrics import read_metrics

# the tiny Kimi Linear config and the chat templates of the rollout tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
import rollout_cases
from chat_templates import KIMI, save_kimi_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ROOT = CONFIGS_ROOT.parent
KIMI_TINY = {**rollout_cases.KIMI_TINY, "vocab_size": 1088}
"""Vocab 1088 covers the tokenizer: the project's 1024 ids plus the 9 Kimi-style specials."""
TINY_RUN = (
    "rollout.group_size=2", "rollout.tasks_per_step=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=16",
    "rollout.max_context_tokens=512", "rollout.engine.kv_cache_memory_bytes=67108864", "rollout.engine.max_num_seqs=8",
    "env.kwargs.Calculator.difficulty=1", "env.num_eval_tasks=2", "curriculum.steps=1", "run.eval_every=0",
    "run.progress_bar=false", "run.transcripts_per_step=2", "ray.num_cpus=2",
)  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from model.convert import main

    torch.manual_seed(0)
    src, dst = tmp_path_factory.mktemp("kimi_src"), tmp_path_factory.mktemp("kimi_converted")
    KimiLinearForCausalLM(KimiLinearConfig(**KIMI_TINY)).save_pretrained(src)
    save_kimi_tokenizer(src)  # the checkpoint's own tokenizer files and chat template
    assert main(["kimi_linear", str(src), str(dst)]) == 0
    assert (dst / "chat_template.jinja").read_text() == KIMI  # copied beside the converted weights
    return dst


def test_rl_step_from_a_converted_checkpoint_with_its_own_template(converted, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "rl.train", "--config", str(CONFIGS_ROOT / "exp" / "from_checkpoint.yaml"),
           f"model.init_from={converted}", f"run.dir={run}", *TINY_RUN]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert f"tokenizer and chat template: {converted} (checkpoint)" in out.stdout
    (row,) = [r for r in read_metrics(run / "metrics.jsonl") if "learner/version" in r]
    assert row["step"] == 1 and row["mismatch/tokens"] > 0
    assert row["mismatch/logprob_abs_mean"] < 1e-3  # the engine and the learner agree on the converted model
    episode = json.loads((run / "transcripts" / "step_000001.jsonl").read_text().splitlines()[0])
    prompt = episode["turns"][0]["prompt_text"]  # the rollouts rendered through the checkpoint's template
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[{") and '"name":"calculator"' in prompt
    assert prompt.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    weights = min((run / "weights").iterdir())  # what the engines started from: the checkpoint's tokenizer
    assert (weights / "chat_template.jinja").read_text() == KIMI
    assert (run / "checkpoints" / "step_000001").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert {"held_out_success_before", "held_out_success_after"} <= set(summary)
