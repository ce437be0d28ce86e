"""Built-in reward functions over ``envs.types.Episode`` (see rewards/base.py for the protocol).

Outcome rewards are in [0, 1]; penalties are <= 0. Answers are read from the last assistant turn's
``<answer>...</answer>`` block and compared with ``episode.info["target"]``.
"""

from __future__ import annotations

import re

from envs import protocol
from envs.types import Episode, EpisodeStatus
from rewards.base import per_turn
from rewards.math_equiv import equivalent


def _answer(episode: Episode) -> str | None:
    return protocol.extract_answer(episode.final_text)


def _target(episode: Episode) -> str:
    if "target" not in episode.info:
        raise KeyError("episode.info has no 'target' (fill Episode.info from the env's reset/step info)")
    return str(episode.info["target"])


def _norm(text: str) -> str:
    return " ".join(text.strip().casefold().split())


def exact_match(episode: Episode) -> float:
    """1 if the answer equals the target after whitespace/case normalisation."""
    answer = _answer(episode)
    return float(answer is not None and _norm(answer) == _norm(_target(episode)))


def answer_equivalence(episode: Episode, tol: float = 1e-6) -> float:
    """1 if the answer equals the target numerically (within ``tol``) or symbolically (sympy)."""
    answer = _answer(episode)
    return float(answer is not None and equivalent(answer, _target(episode), tol))


def solved(episode: Episode) -> float:
    """The env's own verdict (``info["solved"]``)."""
    return float(bool(episode.info.get("solved", False)))


def env_reward(episode: Episode) -> float:
    """The sum of the env's per-turn rewards (as the env returned them)."""
    return float(sum(t.info.get("env_reward", t.reward) for t in episode.turns))


_CALL_RE = re.compile(
    re.escape(protocol.TOOL_CALL_START) + r".*?" + re.escape(protocol.TOOL_CALL_END), re.DOTALL
)


def _turn_compliant(text: str, is_last: bool, env_ended: bool) -> bool:
    n_open, n_close = text.count(protocol.TOOL_CALL_START), text.count(protocol.TOOL_CALL_END)
    n_answers = text.count(protocol.ANSWER_START)
    if n_open != n_close or n_open != len(_CALL_RE.findall(text)):
        return False
    if n_open:  # a tool-call turn; it may be the last one only when the env ended the episode on it
        return n_answers == 0 and (not is_last or env_ended)
    return is_last and n_answers == 1 and protocol.extract_answer(text) is not None


def format_compliance(episode: Episode) -> float:
    """Fraction of turns in the expected shape: tool-call turns (balanced tags, no answer) and a
    last turn with exactly one ``<answer>`` and no calls (or, when the env ended the episode on a
    tool call, e.g. a game over, a last tool-call turn)."""
    turns = episode.turns
    if not turns:
        return 0.0
    ended = episode.status == EpisodeStatus.COMPLETED
    ok = [_turn_compliant(t.text, i == len(turns) - 1, ended) for i, t in enumerate(turns)]
    return sum(ok) / len(ok)


def _calls(episode: Episode, turn) -> list:
    return turn.tool_calls or protocol.parse_tool_calls(turn.text, episode.tools or None)


def tool_call_validity(episode: Episode) -> float:
    """Fraction of tool calls that parsed and validated against the tool specs (1.0 when none)."""
    calls = [c for t in episode.turns for c in _calls(episode, t)]
    if not calls:
        return 1.0
    return sum(c.error is None for c in calls) / len(calls)


def code_test_pass_rate(episode: Episode) -> float:
    """Passed / total hidden tests of a code answer. Uses the env's counts (``tests_passed``,
    ``tests_total``) when present, otherwise runs ``info["task"]``'s tests in the sandbox itself."""
    info = episode.info
    if "tests_passed" in info and info.get("tests_total"):
        return float(info["tests_passed"]) / float(info["tests_total"])
    task = info.get("task") or {}
    if "inputs" not in task or "outputs" not in task:
        raise KeyError("code_test_pass_rate needs info tests_passed/tests_total or task inputs/outputs")
    from envs.python_env import extract_code, run_tests  # the sandbox is only needed here
    from envs.sandbox import Sandbox

    code = extract_code(_answer(episode))
    if code is None or not task["inputs"]:
        return 0.0
    return run_tests(Sandbox(), code, task["inputs"], task["outputs"]) / len(task["inputs"])


def _num_tokens(episode: Episode) -> int:
    """Sampled tokens; for text-only episodes (no token ids) about 4 characters per token."""
    n = episode.num_sampled_tokens
    return n if n > 0 else sum(len(t.text) for t in episode.turns) // 4


def turn_penalty(episode: Episode, per_turn_cost: float = 0.05, free_turns: int = 0) -> float:
    """``-per_turn_cost`` for each assistant turn beyond ``free_turns``."""
    return -per_turn_cost * max(0, len(episode.turns) - free_turns)


def length_penalty(episode: Episode, budget: int = 512, coef: float = 0.5) -> float:
    """``-coef * min(1, overflow / budget)`` where overflow is the sampled tokens beyond ``budget``."""
    if budget <= 0:
        raise ValueError(f"length_penalty budget must be > 0, got {budget}")
    return -coef * min(1.0, max(0, _num_tokens(episode) - budget) / budget)


@per_turn
def env_turn_rewards(episode: Episode) -> list[float]:
    """Per turn: the env's reward for that turn."""
    return [float(t.info.get("env_reward", t.reward)) for t in episode.turns]


@per_turn
def tool_error_turn_penalty(episode: Episode, penalty: float = 0.1) -> list[float]:
    """Per turn: ``-penalty`` for each malformed or failed tool call in that turn."""
    out = []
    for t in episode.turns:
        errors = (
            len(t.info["tool_errors"])
            if "tool_errors" in t.info
            else sum(c.error is not None for c in t.tool_calls)
        )
        out.append(-penalty * errors)
    return out
