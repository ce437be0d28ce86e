"""Check envs from the command line: gymnasium's ``check_env`` plus the scripted expert's solve rate.

    python -m envs.check                       # every built-in, 20 test tasks per difficulty 1..3
    python -m envs.check Calculator mypkg.envs:MyEnv --tasks 50 --difficulties 1 2

Prints one line per (env, difficulty): solved/total, mean turns, mean tool calls, seconds.
"""

from __future__ import annotations

import argparse
import time
import warnings

from gymnasium.utils.env_checker import check_env

from envs.play import play_episode
from envs.registry import BUILTIN_ENVS, make


def check(spec: str, tasks: int, difficulties: list[int]) -> list[str]:
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any gymnasium checker warning is a failure here
        check_env(make(spec))
    for d in difficulties:
        env = make(spec, difficulty=d)
        t0 = time.monotonic()
        episodes = [play_episode(env, options={"split": "test", "task_index": i}) for i in range(tasks)]
        solved = sum(bool(e.info.get("solved")) for e in episodes)
        turns = sum(len(e.turns) for e in episodes) / tasks
        calls = sum(e.info.get("num_tool_calls", 0) for e in episodes) / tasks
        lines.append(
            f"{spec:<16} d={d}  solved {solved}/{tasks}  turns {turns:.1f}  tool calls {calls:.1f}  "
            f"{time.monotonic() - t0:.1f}s"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("envs", nargs="*", default=list(BUILTIN_ENVS))
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--difficulties", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args(argv)
    for spec in args.envs:
        for line in check(spec, args.tasks, args.difficulties):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
