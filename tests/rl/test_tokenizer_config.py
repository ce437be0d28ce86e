"""``model.tokenizer`` (project | checkpoint | PATH) and ``model.template_check``: validated before the run
with errors naming the problem; the driver's renderer, engine tokenizer files and managers follow it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# the templates written for the renderer tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from chat_templates import KIMI, STRIP_THINK, save_kimi_tokenizer, tokenizer_with

from rl.config import CONFIGS_ROOT, ConfigError, load_config
from rl.preflight import check_tokenizer, plan_lines
from rl.rollouts import make_manager, make_renderer, prepare_model_dir
from rollout.renderer import ChatRenderer
from rollout.template_renderer import TemplateRenderer


def checkpoint_dir(path: Path, vocab_size: int = 1088, tokenizer=None) -> Path:
    """A directory standing for a converted checkpoint: config.json (its vocab_size) + tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "hybrid_k3", "vocab_size": vocab_size}))
    if tokenizer == "kimi":
        save_kimi_tokenizer(path)
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def test_default_is_the_project_tokenizer():
    cfg = load_config(None)
    assert (cfg.model.tokenizer, cfg.model.template_check, cfg.model.tokenizer_dir()) == (
        "project",
        "error",
        None,
    )
    assert isinstance(make_renderer(cfg.model), ChatRenderer)


def test_checkpoint_needs_init_from_and_template_check_is_a_choice(tmp_path):
    unset = load_config(CONFIGS_ROOT / "exp" / "from_checkpoint.yaml")  # init_from left to the command line
    with pytest.raises(
        ConfigError, match=r"model.tokenizer: checkpoint takes the tokenizer from model.init_from"
    ):
        check_tokenizer(unset)  # the run does not start (rl.train: exit 2)
    with pytest.raises(ConfigError, match=r"model.template_check: must be one of \['error', 'warn'\]"):
        load_config(None, ["model.template_check=maybe"])
    ckpt = checkpoint_dir(tmp_path / "ckpt", tokenizer="kimi")
    cfg = load_config(None, ["model.tokenizer=checkpoint", f"model.init_from={ckpt}"])
    assert cfg.model.tokenizer_dir() == str(ckpt)
    check_tokenizer(cfg)
    assert f"tokenizer and chat template: {ckpt} (checkpoint)" in "\n".join(plan_lines(cfg))


@pytest.mark.parametrize("tokenizer,why", [
    (None, "no tokenizer files"),
    ("no_template", "no chat template"),
    ("no_tools", "ignores `tools`"),
    ("strip_think", "cannot keep token-in-token-out exactness"),
])  # fmt: skip
def test_unusable_checkpoint_tokenizers_are_named(tmp_path, tokenizer, why):
    tok = {
        None: None,
        "no_template": tokenizer_with(None),
        "no_tools": tokenizer_with(
            "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
        ),
        "strip_think": tokenizer_with(STRIP_THINK),
    }[tokenizer]
    ckpt = checkpoint_dir(tmp_path / "ckpt", tokenizer=tok)
    cfg = load_config(None, ["model.tokenizer=checkpoint", f"model.init_from={ckpt}"])
    with pytest.raises(ConfigError, match=rf"model.tokenizer=checkpoint \({ckpt}\): .*{why}"):
        check_tokenizer(cfg)


def test_warn_accepts_a_template_that_breaks_exactness(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "ckpt", tokenizer=tokenizer_with(STRIP_THINK))
    cfg = load_config(None, [f"model.tokenizer={ckpt}", "model.template_check=warn"])
    with pytest.warns(RuntimeWarning, match="strips earlier reasoning"):
        check_tokenizer(cfg)


def test_a_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "ckpt", vocab_size=1024, tokenizer="kimi")  # 1024 + 9 Kimi specials
    cfg = load_config(None, ["model.tokenizer=checkpoint", f"model.init_from={ckpt}"])
    with pytest.raises(ConfigError, match="the tokenizer has 1033 ids but the model's vocab_size is 1024"):
        check_tokenizer(cfg)
    cfg = load_config(None, [f"model.tokenizer={ckpt}", "model.arch.vocab_size=2048"])  # random init, larger
    check_tokenizer(cfg)


def test_engines_get_the_renderers_tokenizer_and_managers_render_with_it(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "ckpt", tokenizer="kimi")
    cfg = load_config(None, ["model.tokenizer=checkpoint", f"model.init_from={ckpt}"])
    renderer = make_renderer(cfg.model)
    assert isinstance(renderer, TemplateRenderer) and make_renderer(cfg.model) is renderer  # loaded once
    weights = tmp_path / "weights"
    weights.mkdir()
    prepare_model_dir(str(weights), renderer)
    assert (weights / "chat_template.jinja").read_text() == KIMI  # what vLLM loads beside the weights
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(weights)).get_vocab() == renderer.tokenizer.get_vocab()
    project = tmp_path / "project"
    project.mkdir()
    prepare_model_dir(str(project))
    assert not (project / "chat_template.jinja").exists() and (project / "tokenizer.json").is_file()
    pool = SimpleNamespace(workers=[object()], renderer=renderer)
    from rl.config import stages

    assert make_manager(pool, cfg.rollout, stages(cfg)[0], 1.0).renderer is renderer
    assert isinstance(make_manager(SimpleNamespace(workers=[object()]), cfg.rollout, stages(cfg)[0], 1.0).renderer,
                      ChatRenderer)  # fmt: skip
