"""Reward functions (table-driven), sympy safety, the Rubric (weights, breakdown, short-circuits,
per-turn terms) and the registry."""

import time

import pytest

from envs import protocol
from envs.types import Episode, EpisodeStatus, ToolCall, Turn
from rewards import BUILTIN_REWARDS, RewardError, Rubric, RubricTerm, build_rubric, load_reward, per_turn
from rewards import builtin as rb
from rewards.math_equiv import equivalent

CALC = protocol.tool_spec(
    "calculator",
    "d",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)


def episode(*texts, target="42", status=EpisodeStatus.COMPLETED, info=None, rewards=None, tokens=None):
    turns = []
    for i, text in enumerate(texts):
        toks = list(range(tokens[i])) if tokens else []
        turns.append(Turn([], toks, [0.0] * len(toks), text=text, reward=(rewards or [0.0] * len(texts))[i]))
    return Episode("e0", "t0", "Calculator", tools=[CALC], turns=turns, status=status,
                   info={"target": target, **(info or {})})  # fmt: skip


CALL = protocol.format_tool_call("calculator", {"expression": "6 * 7"})
BAD_CALL = protocol.format_tool_call("calculator", {"expression": 6})


@pytest.mark.parametrize(
    ("fn", "ep", "expected"),
    [
        (rb.exact_match, episode(CALL, "<answer>42</answer>"), 1.0),
        (rb.exact_match, episode("<answer> Paris  City </answer>", target="paris city"), 1.0),
        (rb.exact_match, episode("<answer>42.0</answer>"), 0.0),
        (rb.exact_match, episode("42"), 0.0),
        (rb.answer_equivalence, episode("<answer>42.0</answer>"), 1.0),
        (rb.answer_equivalence, episode("<answer>1,234</answer>", target="1234"), 1.0),
        (rb.answer_equivalence, episode("<answer>84/2</answer>"), 1.0),
        (rb.answer_equivalence, episode("<answer>6*7</answer>"), 1.0),
        (rb.answer_equivalence, episode("<answer>x = 2*(x+1) - x - 2 + x</answer>", target="2x"), 1.0),
        (rb.answer_equivalence, episode("<answer>sqrt(8)</answer>", target="2*sqrt(2)"), 1.0),
        (rb.answer_equivalence, episode("<answer>(x+1)^2</answer>", target="x^2 + 2x + 1"), 1.0),
        (rb.answer_equivalence, episode("<answer>0.3333</answer>", target="1/3"), 0.0),
        (rb.answer_equivalence, episode("<answer>0.3333333</answer>", target="1/3"), 1.0),
        (rb.answer_equivalence, episode("<answer>43</answer>"), 0.0),
        (rb.answer_equivalence, episode("<answer>__import__('os')</answer>"), 0.0),
        (rb.answer_equivalence, episode("no answer"), 0.0),
        (rb.solved, episode("x", info={"solved": True}), 1.0),
        (rb.solved, episode("x"), 0.0),
        (rb.env_reward, episode("a", "b", rewards=[0.25, 1.0]), 1.25),
        (rb.format_compliance, episode(CALL, CALL, "<answer>42</answer>"), 1.0),
        (rb.format_compliance, episode(CALL, "<answer>1</answer><answer>2</answer>"), 0.5),
        (rb.format_compliance, episode(CALL + "<answer>42</answer>", "<answer>42</answer>"), 0.5),
        (rb.format_compliance, episode("<tool_call>{", "<answer>42</answer>"), 0.5),
        (rb.format_compliance, episode(CALL, status=EpisodeStatus.COMPLETED), 1.0),
        (rb.format_compliance, episode(CALL, status=EpisodeStatus.TRUNCATED), 0.0),
        (rb.format_compliance, episode(), 0.0),
        (rb.tool_call_validity, episode(CALL, BAD_CALL, "<answer>42</answer>"), 0.5),
        (rb.tool_call_validity, episode("<answer>42</answer>"), 1.0),
        (rb.tool_call_validity, episode(CALL + protocol.format_tool_call("rm", {}) * 3), 0.25),
        (rb.code_test_pass_rate, episode("x", info={"tests_passed": 3, "tests_total": 4}), 0.75),
        (rb.turn_penalty, episode("a", "b", "c"), -0.15),
        (rb.length_penalty, episode("a", tokens=[100]), 0.0),
        (rb.length_penalty, episode("a", "b", tokens=[500, 268]), -0.25),
        (rb.length_penalty, episode("a", tokens=[5000]), -0.5),
    ],
)
def test_builtin_rewards(fn, ep, expected):
    assert fn(ep) == pytest.approx(expected)


def test_reward_parameters():
    assert rb.turn_penalty(episode("a", "b", "c"), per_turn_cost=0.1, free_turns=2) == pytest.approx(-0.1)
    assert rb.length_penalty(episode("x" * 400), budget=50, coef=1.0) == pytest.approx(
        -1.0
    )  # 100 chars/4 tokens
    with pytest.raises(ValueError, match="budget must be > 0"):
        rb.length_penalty(episode("a"), budget=0)


def test_code_test_pass_rate_runs_the_tests_itself_when_the_env_did_not():
    code = "def solve(xs):\n    return sum(xs) if len(xs) < 3 else 0\n"
    task = {"inputs": [[[1, 2]], [[3]], [[1, 1, 1]], [[]]], "outputs": [3, 3, 3, 0]}
    assert rb.code_test_pass_rate(episode(f"<answer>{code}</answer>", info={"task": task})) == 0.75
    assert rb.code_test_pass_rate(episode("<answer>no code</answer>", info={"task": task})) == 0.0


def test_answer_equivalence_is_safe_on_hostile_strings():
    for hostile in [
        "9^9^9^9",
        "2**(10**10)",
        "x" * 500,
        "exec('1')",
        "a_b",
        "lambda: 1",
        "1e999999",
        "1e99999999999",
    ]:
        t0 = time.monotonic()
        assert not equivalent(hostile, "3")
        assert time.monotonic() - t0 < 2.0, hostile


def test_per_turn_rewards():
    ep = episode(CALL, BAD_CALL, "<answer>42</answer>", rewards=[0.0, 0.0, 1.0])
    ep.turns[1].info["tool_errors"] = ["calculator: bad"]
    assert rb.tool_error_turn_penalty(ep) == [0.0, -0.1, 0.0]
    assert rb.env_turn_rewards(ep) == [0.0, 0.0, 1.0]


def test_rubric_weights_breakdown_and_per_turn_terms():
    rubric = build_rubric(
        [
            {"reward": "exact_match", "weight": 1.0},
            {"reward": "format_compliance", "weight": 0.5},
            {"reward": "turn_penalty", "weight": 1.0, "name": "turns", "params": {"per_turn_cost": 0.1}},
            {"reward": "tool_error_turn_penalty", "weight": 2.0, "params": {"penalty": 0.25}},
        ]
    )
    ep = episode(CALL, BAD_CALL, "<answer>42</answer>", rewards=[0.0, 0.0, 1.0])
    ep.turns[1].info["tool_errors"] = ["calculator: bad"]
    result = rubric.apply(ep)
    assert result.breakdown == pytest.approx(
        {"exact_match": 1.0, "format_compliance": 1.0, "turns": -0.3, "tool_error_turn_penalty": -0.25}
    )
    assert result.total == pytest.approx(1.0 + 0.5 - 0.3 - 0.5)
    assert result.turn_rewards == pytest.approx([0.0, -0.5, 0.0])
    assert ep.reward == pytest.approx(result.total) and ep.reward_breakdown == result.breakdown
    assert [t.reward for t in ep.turns] == pytest.approx([0.0, -0.5, 1.0])  # env reward + per-turn terms
    rubric.apply(ep)  # idempotent: the env's own reward is kept in turn.info
    assert [t.reward for t in ep.turns] == pytest.approx([0.0, -0.5, 1.0])


@pytest.mark.parametrize(
    ("status", "kwargs", "expected", "key"),
    [
        (EpisodeStatus.TRUNCATED, {}, 0.0, "truncated"),
        (EpisodeStatus.TRUNCATED, {"truncated_reward": -0.5}, -0.5, "truncated"),
        (EpisodeStatus.ERROR, {"error_reward": -1.0}, -1.0, "error"),
        (EpisodeStatus.TRUNCATED, {"truncated_reward": None}, 1.0, "exact_match"),
    ],
)
def test_rubric_short_circuits(status, kwargs, expected, key):
    rubric = build_rubric(["exact_match"], **kwargs)
    result = rubric.score(episode(CALL, "<answer>42</answer>", status=status))
    assert result.total == expected and key in result.breakdown


def test_rubric_errors_name_the_reward():
    def broken(ep):
        raise ZeroDivisionError("boom")

    def not_a_number(ep):
        return "high"

    @per_turn
    def wrong_length(ep):
        return [1.0]

    for fn, fragment in [(broken, "failed on episode 'e0': ZeroDivisionError"), (not_a_number, "not a number"),
                         (wrong_length, "one value per turn"), (lambda ep: float("nan"), "non-finite")]:  # fmt: skip
        with pytest.raises(RewardError, match=fragment):
            Rubric([RubricTerm("r", fn)]).score(episode("a", "b"))
    with pytest.raises(ValueError, match="duplicate"):
        Rubric([("a", rb.solved, 1.0), ("a", rb.solved, 1.0)])
    with pytest.raises(ValueError, match="needs 'reward'"):
        build_rubric([{"weight": 1.0}])
    with pytest.raises(KeyError, match="no 'target'"):
        rb.exact_match(Episode("e", "t", "x", turns=[Turn([], [], [], text="<answer>1</answer>")]))


def test_registry_resolves_every_builtin_and_strings():
    for name, path in BUILTIN_REWARDS.items():
        fn = load_reward(name)
        assert callable(fn) and fn.__name__ == path.split(":")[1]
    assert load_reward("rewards.builtin:exact_match") is rb.exact_match
    bound = load_reward("turn_penalty", per_turn_cost=1.0)
    assert bound(episode("a", "b")) == -2.0
    with pytest.raises(ValueError, match="unknown reward"):
        load_reward("not_a_reward")
    with pytest.raises(TypeError, match="not callable"):
        load_reward("rewards.registry:REWARD_GROUP")


def test_tool_call_validity_prefers_parsed_turn_calls():
    ep = episode("text without tags")
    ep.turns[0].tool_calls = [
        ToolCall("calculator", {}, "call_0", error="bad"),
        ToolCall("calculator", {"e": 1}),
    ]
    assert rb.tool_call_validity(ep) == 0.5


def test_catch_errors_gives_the_error_reward_and_keeps_the_other_terms():
    def broken(ep):
        raise ZeroDivisionError("boom")

    rubric = Rubric([("ok", rb.solved, 2.0), ("broken", broken, 1.0)], error_reward=-1.0)
    ep = episode("<answer>42</answer>", info={"solved": True})
    with pytest.raises(RewardError, match="'broken' failed"):
        rubric.apply(ep)
    result = rubric.apply(ep, catch_errors=True)
    assert result.total == -1.0 and result.short_circuit == "reward_error"
    assert result.breakdown == {"ok": 1.0} and set(result.errors) == {"broken"}
    assert ep.reward == -1.0 and "ZeroDivisionError: boom" in ep.info["reward_error"]
    fine = Rubric([("ok", rb.solved, 2.0)], error_reward=None)
    assert fine.apply(ep, catch_errors=True).total == 2.0 and "reward_error" not in ep.info  # cleared
    assert Rubric([("broken", broken, 1.0)], error_reward=None).score(ep, catch_errors=True).total == 0.0


def test_build_rubric_takes_the_config_spelling_and_checks_parameters():
    rubric = build_rubric([{"fn": "turn_penalty", "weight": 2.0, "kwargs": {"per_turn_cost": 0.5}}])
    assert rubric.score(episode("a", "b")).total == -2.0
    with pytest.raises(TypeError, match=r"'per_turn_cst' \(did you mean 'per_turn_cost'\?\)"):
        load_reward("turn_penalty", per_turn_cst=0.5)
    assert load_reward(lambda ep, **kw: 1.0, anything=1)(episode("a")) == 1.0  # **kwargs takes anything
    with pytest.raises(ValueError, match=r"unknown reward 'exact_mach' \(did you mean 'exact_match'\?\)"):
        load_reward("exact_mach")
