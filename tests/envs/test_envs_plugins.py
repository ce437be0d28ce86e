"""A third-party env and reward defined only here, plugged in by "module:attr" string and by entry
point (a tiny dist-info on sys.path, discovered by importlib.metadata as an installed package would
be), then run end to end: reset, step, expert, text-level episode loop, rubric."""

import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs import protocol
from envs.base import Task, Tool, ToolEnv
from envs.play import play_episode
from envs.registry import register_entry_points
from envs.types import Episode
from rewards import build_rubric, load_reward


class ReverseWordEnv(ToolEnv):
    """Reverse a word using a ``reverse`` tool."""

    env_name = "ReverseWord"

    def make_tools(self):
        params = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
        return [Tool("reverse", "Reverse a word.", params, lambda word: word[::-1])]

    def generate_task(self, rng, difficulty):
        word = "".join(rng.choice(list("abcdefgh"), size=3 + difficulty))
        return Task(word, [{"role": "user", "content": f"Reverse {word}."}], word[::-1], {"word": word})

    def expert_action(self):
        if self.turn == 0:
            return protocol.format_tool_call("reverse", {"word": self.task.data["word"]})
        return protocol.format_answer(self.task.target)


def reversed_answer_reward(episode: Episode, bonus: float = 0.0) -> float:
    answer = protocol.extract_answer(episode.final_text)
    return float(answer == episode.info["target"]) + bonus


def _run_end_to_end(env, reward_spec, **params):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    rubric = build_rubric([{"reward": reward_spec, "name": "plugin", "params": params}, "format_compliance"])
    for i in range(5):
        ep = play_episode(env, options={"split": "test", "task_index": i})
        result = rubric.apply(ep)
        assert ep.info["solved"] and result.breakdown == {
            "plugin": 1.0 + params.get("bonus", 0.0),
            "format_compliance": 1.0,
        }
        assert ep.reward == result.total


def test_plugin_by_module_string():
    env = envs.make("test_envs_plugins:ReverseWordEnv", difficulty=2)
    assert isinstance(env, ReverseWordEnv) and env.difficulty == 2
    assert load_reward("test_envs_plugins:reversed_answer_reward") is reversed_answer_reward
    _run_end_to_end(env, "test_envs_plugins:reversed_answer_reward", bonus=0.5)


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    dist = tmp_path / "thirdparty_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[longhorizon.envs]\nreverseword = test_envs_plugins:ReverseWordEnv\n\n"
        "[longhorizon.rewards]\nreversed_answer = test_envs_plugins:reversed_answer_reward\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    gymnasium.registry.pop("longhorizon/reverseword-v0", None)


def test_plugin_by_entry_point(fake_distribution):
    env = envs.make("reverseword")
    assert isinstance(env, ReverseWordEnv)
    assert load_reward("reversed_answer") is reversed_answer_reward
    _run_end_to_end(env, "reversed_answer")
    assert register_entry_points() == ["longhorizon/reverseword-v0"]
    gym_env = gymnasium.make("longhorizon/reverseword-v0", difficulty=3).unwrapped
    assert isinstance(gym_env, ReverseWordEnv) and gym_env.difficulty == 3


def test_unknown_plugin_names_fail_clearly():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        load_reward("nope")
    with pytest.raises(AttributeError, match="has no attribute 'Missing'"):
        envs.make("test_envs_plugins:Missing")
    with pytest.raises(TypeError, match=r"not a gymnasium\.Env"):
        envs.make("envs.base:Task")


def test_pyproject_entry_points_list_exactly_the_builtins():
    import tomllib
    from pathlib import Path

    from rewards import BUILTIN_REWARDS

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["longhorizon.envs"] == envs.BUILTIN_ENVS
    assert project["entry-points"]["longhorizon.rewards"] == BUILTIN_REWARDS
