"""Every built-in env: gymnasium conformance, seeded determinism, splits, experts, async steps."""

import asyncio
import json
import subprocess
import sys
import time
import warnings

import gymnasium
import pytest
from envs_helpers import ENV_NAMES, make_env
from gymnasium.utils.env_checker import check_env

import envs
from envs import protocol
from envs.base import Task, Tool, ToolEnv, gather_steps, step_concurrently
from envs.play import play_episode
from rewards import build_rubric

# which reward must agree with the env's verdict, per env
AGREEING_REWARD = {
    "Calculator": "answer_equivalence",
    "Countdown": "answer_equivalence",
    "Python": "code_test_pass_rate",
    "RetrievalQA": "exact_match",
    "NeedleHaystack": "answer_equivalence",
    "FrozenLake": "solved",
}


def test_every_builtin_is_registered_with_gymnasium():
    ids = {i for i in gymnasium.registry if i.startswith("longhorizon/")}
    assert {f"longhorizon/{n}-v0" for n in envs.BUILTIN_ENVS} <= ids
    assert set(AGREEING_REWARD) == set(envs.BUILTIN_ENVS)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_check_env_passes_without_warnings(name):
    env = make_env(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    assert isinstance(env, ToolEnv)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_seeded_resets_are_deterministic(name):
    a, b = make_env(name), make_env(name)
    for options in (None, {"split": "test"}, {"split": "train", "difficulty": 2}):
        obs_a, info_a = a.reset(seed=7, options=options)
        obs_b, info_b = b.reset(seed=7, options=options)
        assert obs_a == obs_b and info_a == info_b
    seen = {a.reset(seed=s)[1]["task_id"] for s in range(5)}
    assert len(seen) == 5, "different seeds should give different tasks"
    obs, info = a.reset(options={"split": "test", "task_index": 3})
    again, info2 = b.reset(seed=123, options={"task_id": info["task_id"]})
    assert obs == again and info2["task_id"] == info["task_id"] and info2["split"] == "test"


@pytest.mark.parametrize("name", ENV_NAMES)
def test_train_and_test_splits_are_disjoint(name):
    env = make_env(name)
    train = {env.task_for("train", 1, i).key for i in range(25)}
    test = {env.task_for("test", 1, i).key for i in range(25)}
    assert not train & test
    assert all(env.split_of(k) == "test" for k in test)


def test_reset_rejects_bad_options_clearly():
    env = make_env("Calculator")
    for options, fragment in [
        ({"split": "dev"}, "split must be one of"),
        ({"difficulty": 0}, "difficulty must be an int >= 1"),
        ({"task_index": -1}, "task_index must be an int >= 0"),
        ({"task_id": "Countdown/test/d1/3"}, "bad task_id"),
        ({"bogus": 1}, "unknown reset option"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            env.reset(options=options)


def test_difficulty_and_context_knobs():
    calc = make_env("Calculator")
    calc.reset(options={"difficulty": 1, "task_index": 0})
    easy = len(calc.task.data["steps"])
    calc.reset(options={"difficulty": 4, "task_index": 0})
    assert (easy, len(calc.task.data["steps"])) == (1, 4)
    short, long = (
        make_env("NeedleHaystack", context_chars=1000),
        make_env("NeedleHaystack", context_chars=20_000),
    )
    (o1, i1), (o2, i2) = short.reset(options={"task_index": 5}), long.reset(options={"task_index": 5})
    assert i1["target"] == i2["target"] and i1["task"]["question"] == i2["task"]["question"]
    assert len(o2["messages"][1]["content"]) > 15 * len(o1["messages"][1]["content"]) / 2
    for code in map(str, long.task.data["codes"]):
        assert code in o2["messages"][1]["content"]


def test_calculator_ops_pick_the_operators():
    both = envs.make("Calculator", difficulty=3, ops="+*")
    ops = {step.split()[1] for i in range(200) for step in both.task_for("train", 3, i).data["steps"]}
    assert ops == {"+", "*"}
    minus = envs.make("Calculator", ops="-")
    assert all(" - " in minus.task_for("test", 1, i).key for i in range(20))
    default = [envs.make("Calculator").task_for("train", 2, i).key for i in range(50)]
    assert default == [envs.make("Calculator", ops="+-*").task_for("train", 2, i).key for i in range(50)]
    for bad in ("", "+/", "++", ["+"]):
        with pytest.raises(ValueError, match="Calculator ops"):
            envs.make("Calculator", ops=bad)


def test_calculator_operand_ranges_shape_the_tasks():
    shaped = envs.make("Calculator", operand_ranges={"-": [[100, 999], [10, 99]]})
    steps = [shaped.task_for("train", 1, i).data["steps"][0].split() for i in range(300)]
    by_op = {op: [(int(a), int(b)) for a, o, b in steps if o == op] for op in "+-*"}
    assert all(100 <= a <= 999 and 10 <= b <= 99 for a, b in by_op["-"]) and by_op["-"]
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in by_op["+"]) and by_op["+"]
    assert all(10 <= a <= 99 and 2 <= b <= 9 for a, b in by_op["*"]) and by_op["*"]
    # later operations chain the running value, not the first operand's range
    chained = shaped.task_for("train", 3, 0).data["steps"]
    assert [int(s.split()[0]) for s in chained[1:]] == [eval(s) for s in chained[:-1]]
    # tasks without an overridden operator are the default stream's, draw for draw
    default = [envs.make("Calculator").task_for("test", 1, i).key for i in range(50)]
    same = [
        envs.make("Calculator", operand_ranges={"+": [[10, 99], [10, 99]]}).task_for("test", 1, i).key
        for i in range(50)
    ]
    assert same == default
    for bad in (
        {"/": [[1, 2], [1, 2]]},
        {"-": [[5, 1], [1, 2]]},
        {"-": [[1, 2]]},
        {"+": [[1.5, 2], [1, 2]]},
        [1],
    ):
        with pytest.raises(ValueError, match="Calculator operand_ranges"):
            envs.make("Calculator", operand_ranges=bad)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_expert_solves_test_tasks_and_rewards_agree(name):
    env = make_env(name, difficulty=2)
    rubric = build_rubric([AGREEING_REWARD[name], "format_compliance", "tool_call_validity"])
    n = 6 if name == "Python" else 20
    solved = 0
    for i in range(n):
        ep = play_episode(env, options={"split": "test", "task_index": i})
        result = rubric.score(ep)
        assert len(ep.turns) >= 2, "experts make at least one tool call"
        solved += ep.info["solved"]
        assert result.breakdown[AGREEING_REWARD[name]] == float(ep.info["solved"]) == ep.env_reward
        assert result.breakdown["format_compliance"] == 1.0
        assert result.breakdown["tool_call_validity"] == 1.0
    assert solved / n >= 0.95


@pytest.mark.parametrize("name", ["Calculator", "Countdown", "RetrievalQA", "NeedleHaystack"])
def test_wrong_answers_score_zero_in_env_and_reward(name):
    env = make_env(name)
    rubric = build_rubric([AGREEING_REWARD[name]])

    def wrong(env, messages):
        return protocol.format_answer("definitely wrong 999999")

    ep = play_episode(env, wrong, options={"task_index": 1})
    assert ep.info["solved"] is False and ep.env_reward == 0.0 and rubric(ep) == 0.0


@pytest.mark.parametrize("answer", ["1e99999999999", "9" * 5000, "9**9**9**9", "\x00", "<answer>"])
def test_hostile_final_answers_score_zero_quickly(answer):
    for name in ("Calculator", "Countdown", "NeedleHaystack"):
        env = make_env(name)
        env.reset(seed=0)
        t0 = time.monotonic()
        r = env.step(protocol.format_answer(answer))
        assert r.terminated and r.reward == 0.0 and time.monotonic() - t0 < 1.0


def test_chat_message_actions_match_text_actions():
    a, b = make_env("Calculator"), make_env("Calculator")
    a.reset(seed=1)
    b.reset(seed=1)
    text = a.expert_action()
    call = protocol.parse_tool_calls(text)[0]
    fn = {"name": call.name, "arguments": json.dumps(call.arguments)}  # chat-API style: arguments as a string
    msg = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]}
    ra, rb = a.step(text), b.step(msg)
    assert ra.obs == rb.obs and ra.reward == rb.reward


def test_render_ansi_shows_the_conversation():
    env = make_env("Calculator", render_mode="ansi")
    env.reset(seed=0)
    env.step(env.expert_action())
    text = env.render()
    assert "[user] What is" in text and "[tool]" in text


class SlowEcho(ToolEnv):
    """An echo tool that returns only once ``together`` of its calls (over all instances) are in flight at once:
    async steps over many episodes must overlap their tool calls, or the first call waits out its timeout."""

    env_name = "SlowEcho"
    together, in_flight = 1, 0

    def make_tools(self):
        async def echo(text: str) -> str:
            SlowEcho.in_flight += 1
            while SlowEcho.in_flight < SlowEcho.together:
                await asyncio.sleep(0.01)
            return text

        params = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        return [Tool("echo", "Echo after a delay.", params, echo, timeout_s=5)]

    def generate_task(self, rng, difficulty):
        word = f"w{int(rng.integers(1000))}"
        return Task(word, [{"role": "user", "content": f"echo {word}"}], word)

    def expert_action(self):
        if self.turn == 0:
            return protocol.format_tool_call("echo", {"text": self.task.target})
        return protocol.format_answer(self.task.target)


def test_gather_steps_overlaps_tool_latency_across_episodes(monkeypatch):
    group = [SlowEcho() for _ in range(8)]
    for i, e in enumerate(group):
        e.reset(seed=i)
    # every call waits until all 8 are in flight (no clock involved): steps one after another never get there
    monkeypatch.setattr(SlowEcho, "together", 8)
    monkeypatch.setattr(SlowEcho, "in_flight", 0)
    results = step_concurrently(group, [e.expert_action() for e in group])
    assert [r.obs["messages"][0]["content"] for r in results] == [e.task.target for e in group]
    monkeypatch.setattr(SlowEcho, "together", 1)
    sync = SlowEcho()
    sync.reset(seed=0)
    assert sync.step(sync.expert_action()).obs == results[0].obs  # sync step runs async tools too


def test_astep_equals_step_for_builtin_env():
    a, b = make_env("Countdown"), make_env("Countdown")
    a.reset(seed=4)
    b.reset(seed=4)
    while not a.done:
        act = a.expert_action()
        ra, rb = a.step(act), asyncio.run(b.astep(act))
        assert ra == rb


def test_gather_steps_rejects_mismatched_inputs():
    e = make_env("Calculator")
    with pytest.raises(ValueError, match="actions"):
        asyncio.run(gather_steps([e], []))
    with pytest.raises(ValueError, match="only once"):
        asyncio.run(gather_steps([e, e], ["a", "b"]))


def test_envs_make_accepts_every_kind_of_name():
    from envs.calculator import CalculatorEnv

    for spec in ("Calculator", "longhorizon/Calculator-v0", "envs.calculator:CalculatorEnv", CalculatorEnv):
        env = envs.make(spec, difficulty=2)
        assert isinstance(env, CalculatorEnv) and env.difficulty == 2
    with pytest.raises(ValueError, match="unknown env 'NoSuchEnv'"):
        envs.make("NoSuchEnv")
    with pytest.raises(ImportError, match="cannot import module"):
        envs.make("no_such_module_xyz:Env")


def test_gymnasium_make_without_importing_envs_first():
    code = (
        "import gymnasium, sys\n"
        "env = gymnasium.make('envs:longhorizon/Calculator-v0').unwrapped\n"
        "obs, info = env.reset(seed=0)\n"
        "assert obs['tools'][0]['function']['name'] == 'calculator'\n"
        "env2 = gymnasium.make('longhorizon/FrozenLake-v0')\n"  # registered by the import above
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_sandboxed_tool_calls_of_many_episodes_run_concurrently():
    group = [make_env("Python") for _ in range(4)]
    for i, e in enumerate(group):
        e.reset(seed=i)
    # each program prints when it started and ended its 1.5 s (the host's clock): all four ran at one moment
    # when the last start came before the first end; a sandbox's own start-up and teardown do not count
    code = "import time\nt0 = time.time()\ntime.sleep(1.5)\nprint(t0, time.time())"
    results = step_concurrently(group, [protocol.format_tool_call("python", {"code": code})] * 4)
    spans = [tuple(map(float, r.obs["messages"][0]["content"].split())) for r in results]
    assert len(spans) == 4 and max(a for a, _ in spans) < min(b for _, b in spans), f"not concurrent: {spans}"
