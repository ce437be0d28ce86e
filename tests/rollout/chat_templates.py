"""Chat templates and tokenizers made in the tests (no downloads) for ``TemplateRenderer``.

- ``OURS``: the project's ChatML layout with ``<tool_call>`` / ``<tool_response>`` tags, written as a
  Hugging Face chat template (``ChatRenderer`` renders the same ids piece by piece).
- ``KIMI``: modelled on Kimi K2's / Kimi Linear's template: ``<|im_user|>`` / ``<|im_assistant|>`` /
  ``<|im_system|>`` headers closed by ``<|im_middle|>``, a ``tool_declare`` block, tool calls in
  ``<|tool_calls_section_begin|>`` sections with ``functions.NAME:IDX`` ids, tool results headed
  ``## Return of <id>``, a default system prompt when the conversation has none.
- ``STRIP_THINK``: ``OURS`` that drops ``<think>...</think>`` from every assistant turn but the last
  (as reasoning-model templates do): turn-by-turn ids cannot equal the whole rendering.
"""

from __future__ import annotations

import copy
from pathlib import Path

OURS = r"""
{%- set ns = namespace(tools='') -%}
{%- if tools -%}
  {%- set ns.tools = '\n\n# Tools\n' -%}
  {%- for t in tools -%}{%- set ns.tools = ns.tools + (t | tojson(sort_keys=True)) + ('' if loop.last else '\n') -%}{%- endfor -%}
  {%- if messages[0].role != 'system' -%}{{- '<|im_start|>system\nYou are a helpful assistant.' + ns.tools + '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- for m in messages -%}
  {{- '<|im_start|>' + m.role + '\n' -}}
  {%- if m.role == 'tool' -%}{{- '<tool_response>' + m.content + '</tool_response>' -}}
  {%- else -%}
    {%- set c = m.content -%}
    {#- STRIP -#}
    {{- c -}}
    {%- if m.role == 'system' and loop.first -%}{{- ns.tools -}}{%- endif -%}
    {%- for tc in m.tool_calls or [] -%}
      {{- '<tool_call>' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson) + '</tool_call>' -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

STRIP_THINK = OURS.replace(
    "{#- STRIP -#}",
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}",
)

KIMI = r"""
{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson(separators=(',', ':'))) + '<|im_end|>' -}}{%- endif -%}
{%- for m in messages -%}
  {%- if loop.first and m.role != 'system' -%}
    {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}
  {%- endif -%}
  {%- set role_name = m.name or m.role -%}
  {%- if m.role == 'user' -%}{{- '<|im_user|>' + role_name + '<|im_middle|>' -}}
  {%- elif m.role == 'assistant' -%}{{- '<|im_assistant|>' + role_name + '<|im_middle|>' -}}
  {%- else -%}{{- '<|im_system|>' + role_name + '<|im_middle|>' -}}
  {%- endif -%}
  {%- if m.role == 'assistant' and m.tool_calls -%}
    {{- m.content or '' -}}{{- '<|tool_calls_section_begin|>' -}}
    {%- for tc in m.tool_calls -%}
      {{- '<|tool_call_begin|>' + tc.id + '<|tool_call_argument_begin|>' + (tc.function.arguments | tojson) + '<|tool_call_end|>' -}}
    {%- endfor -%}
    {{- '<|tool_calls_section_end|>' -}}
  {%- elif m.role == 'tool' -%}{{- '## Return of ' + m.tool_call_id + '\n' + m.content -}}
  {%- else -%}{{- m.content or '' -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}
"""

KIMI_SPECIALS = (
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
"""Kimi's structural tokens, added to the project tokenizer (which has <|im_end|> already)."""


def tokenizer_with(template: str, specials: tuple[str, ...] = ()):
    """A copy of the project's tiny tokenizer with ``specials`` added and ``template`` as its chat template."""
    from tokenizers import AddedToken

    from rollout.tokenizer import load_tokenizer

    tok = copy.deepcopy(load_tokenizer())
    if specials:
        tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials], special_tokens=True)
    tok.chat_template = template
    return tok


def kimi_tokenizer():
    return tokenizer_with(KIMI, KIMI_SPECIALS)


def save_kimi_tokenizer(path: Path) -> Path:
    """``kimi_tokenizer()`` saved as a checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja)."""
    kimi_tokenizer().save_pretrained(str(path))
    return path
