"""Tokenizer asset and chat renderer: specials, round trips, incremental == full rendering."""

from __future__ import annotations

import pytest

from envs.protocol import format_tool_call
from rollout.renderer import ChatRenderer
from rollout.tokenizer import MAX_VOCAB, SPECIAL_TOKENS, load_tokenizer


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer()


def test_tokenizer_asset_has_specials_and_fits_the_model_vocab():
    tok = load_tokenizer()
    assert len(tok) <= MAX_VOCAB
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(len(SPECIAL_TOKENS)))
    text = 'Compute 12345 * 678 with <tool_call>{"name": "calculator"}</tool_call> ünïcode ✓'
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc) == text
    assert tok.convert_tokens_to_ids("<tool_call>") in enc  # specials are single tokens
    digits = tok.encode("12345", add_special_tokens=False)
    assert len(digits) == 5  # one token per digit


def test_render_places_tools_in_system_and_adds_generation_prompt(renderer):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    ids = renderer.render([{"role": "user", "content": "hi"}], tools, add_generation_prompt=True)
    text = renderer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert '"name": "calculator"' in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_incremental_turns_equal_full_rendering(renderer):
    """Token-in-token-out: prompt + sampled ids + continuation == rendering the whole history."""
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12*34?"}]
    ids = renderer.render(history, add_generation_prompt=True)
    call = format_tool_call("calculator", {"expression": "12*34"})
    sampled = renderer._text(call)  # what the policy sampled, stopping at </tool_call>
    assert sampled[-1] == renderer.tool_call_end_id
    obs = [{"role": "tool", "content": "408"}]
    ids2 = ids + sampled + renderer.continuation_ids(sampled, obs)
    full = renderer.render(
        [*history, {"role": "assistant", "content": call}, *obs], add_generation_prompt=True
    )
    assert ids2 == full
    # a turn that ended with <|im_end|> is not closed twice
    answer = [*renderer._text("<answer>408</answer>"), renderer.im_end_id]
    ids3 = ids2 + answer + renderer.continuation_ids(answer, [{"role": "user", "content": "ok"}])
    full3 = renderer.render(
        [
            *history,
            {"role": "assistant", "content": call},
            *obs,
            {"role": "assistant", "content": "<answer>408</answer>"},
            {"role": "user", "content": "ok"},
        ],
        add_generation_prompt=True,
    )
    assert ids3 == full3


def test_mask_covers_assistant_bodies_only(renderer):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a b"},
        {"role": "tool", "content": "r"},
    ]
    rc = renderer.render_with_mask(msgs)
    masked = [t for t, m in zip(rc.token_ids, rc.loss_mask) if m]
    assert renderer.decode(masked) == "a b<|im_end|>"


def test_tool_calls_field_and_parsing(renderer):
    msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
    }
    text = renderer.decode(renderer.message_body(msg))
    assert text == format_tool_call("f", {"x": 1})
    calls = renderer.parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("f", {"x": 1}, None)]
    assert renderer.parse_tool_calls("<tool_call>{bad")[0].error


def test_bad_input_is_named(renderer):
    with pytest.raises(ValueError, match="role"):
        renderer.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        renderer.render([{"role": "user", "content": 3}])


def test_package_is_import_light_and_plugin_registers():
    import subprocess
    import sys

    code = (
        "import sys, rollout, rollout.vllm_plugin\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)\n"
        "print(rollout.vllm_plugin.padded_head_size(type('C', (), dict(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "64"  # 48 rounded up to a CPU paged-attention head size


@pytest.mark.vllm
def test_plugin_registers_the_model_class_itself():
    """Registered as a class, vLLM inspects the model in this process: a "module:Class" string is inspected
    in a fresh Python subprocess whenever vLLM's model-info cache misses (11 s on a 2-core CPU)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    from rollout.vllm_model import VllmHybridForCausalLM
    from rollout.vllm_plugin import ARCHITECTURE, register

    register()
    registered = ModelRegistry.models[ARCHITECTURE]
    assert not isinstance(registered, _LazyRegisteredModel)
    assert registered.load_model_cls() is VllmHybridForCausalLM
    info = registered.inspect_model_cls()
    assert info.is_hybrid and info.has_inner_state
