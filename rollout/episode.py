"""The multi-turn episode loop against the env API, token-in-token-out.

An episode alternates: render -> generate (on its pinned worker) -> parse the tool call -> env.step
-> append the observation tokens -> ... until the env terminates (COMPLETED) or truncates, or a
budget runs out (TRUNCATED: turns, episode tokens, wall time, context), or the env, a tool or the
worker fails (ERROR: kept with the message, never raised). Token ids are never re-derived from text:
turn t+1's prompt ids are the renderer's continuation after turn t's sampled ids.

``EpisodeRun`` is the per-episode state machine; ``drive_episodes`` runs many of them on one worker:
each round sends one turn for every episode that is ready, and env steps run in a thread pool so
an episode waiting on a slow tool does not hold up the others (its resident engine state is bounded
and evicted by the worker under memory pressure).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from envs.tracebacks import exception_info
from envs.types import Episode, EpisodeStatus, Message, Turn
from rollout.renderer import ChatRenderer
from rollout.worker import TurnOutput, TurnRequest


@dataclass
class EpisodeBudget:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_episode_tokens: int = 4096  # prompt + every turn, i.e. the context the episode may reach
    max_wall_s: float = 600.0
    """Wall-clock budget of the episode's own work: env reset and steps, tool calls, rendering. Time
    spent waiting for the engine's turns does not count: the token budgets bound generation, and a
    batch of 128 episodes on a loaded CPU can wait minutes for one turn without anything being stuck."""


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class EpisodeRun:
    """One episode's state between turns (see the module docstring)."""

    def __init__(
        self,
        env,
        renderer: ChatRenderer,
        budget: EpisodeBudget,
        sampling: SamplingConfig,
        episode_id: str | None = None,
        task_id: str = "",
        env_id: str = "",
        reset_options: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> None:
        self.env, self.renderer, self.budget, self.sampling = env, renderer, budget, sampling
        self.episode = Episode(episode_id or uuid.uuid4().hex[:12], task_id, env_id)
        self.t0 = time.monotonic()
        self.engine_wait_s = 0.0
        self._asked_at: float | None = None
        self.pending_ids: list[int] = []
        self.done = False
        self._ended = False
        if env is None:
            return
        try:
            obs, info = env.reset(seed=seed, options=reset_options)
            self.episode.messages = list(obs["messages"])
            self.episode.tools = list(obs.get("tools", []))
            self.episode.info = dict(info)
            self.episode.task_id = task_id or str(info.get("task_id", ""))
            self.pending_ids = renderer.render(
                self.episode.messages, self.episode.tools, add_generation_prompt=True
            )
        except Exception as e:
            self.fail("env.reset", e)

    @classmethod
    def broken(
        cls,
        where: str,
        error: BaseException,
        renderer: ChatRenderer,
        budget: EpisodeBudget,
        sampling: SamplingConfig,
        **kwargs: Any,
    ) -> EpisodeRun:
        """An ERROR episode for an env that could not even be built."""
        run = cls(None, renderer, budget, sampling, **kwargs)
        run.fail(where, error)
        return run

    # --- turn boundary --------------------------------------------------------------------------------
    def context_len(self) -> int:
        return len(self.episode.token_ids) + len(self.pending_ids)

    def next_request(self) -> TurnRequest | None:
        """The next turn to generate, or None after finishing the episode on a budget."""
        b = self.budget
        if len(self.episode.turns) >= b.max_turns:
            return self.finish(EpisodeStatus.TRUNCATED, "max_turns")
        if self.own_time_s() > b.max_wall_s:
            return self.finish(EpisodeStatus.TRUNCATED, "timeout")
        room = b.max_episode_tokens - self.context_len()
        if room < 1:
            return self.finish(EpisodeStatus.TRUNCATED, "max_tokens")
        s = self.sampling
        self._asked_at = time.monotonic()
        return TurnRequest(
            self.episode.episode_id,
            list(self.pending_ids),
            min(b.max_tokens_per_turn, room),
            s.temperature,
            s.top_p,
            s.top_k,
            self.renderer.stop_token_ids,
        )

    def own_time_s(self) -> float:
        """Seconds since the episode started, less the time it waited for the engine's turns."""
        return time.monotonic() - self.t0 - self.engine_wait_s

    def on_output(self, out: TurnOutput) -> str | None:
        """Record the sampled turn; returns the assistant text for env.step (None if the episode ended).

        The turn keeps the engine's routes of its prompt and sampled tokens; the previous turn's last
        sampled token, fed only now, gets its routes from this output (``prev_token_routed_experts``)."""
        if self._asked_at is not None:
            self.engine_wait_s += time.monotonic() - self._asked_at
            self._asked_at = None
        if out.finish_reason == "context" or not out.token_ids:
            return self.finish(EpisodeStatus.TRUNCATED, "context")
        ep = self.episode
        if ep.turns and out.prev_token_routed_experts is not None and ep.turns[-1].routed_experts is not None:
            routes = ep.turns[-1].routed_experts.copy()  # arrays returned by Ray actors are read-only
            routes[-1] = out.prev_token_routed_experts  # known only once it was fed
            ep.turns[-1].routed_experts = routes
        text = self.renderer.assistant_text(out.token_ids)
        finish = "tool_call" if out.stop_token_id == self.renderer.tool_call_end_id else out.finish_reason
        ep.turns.append(
            Turn(
                prompt_token_ids=self.pending_ids,
                token_ids=list(out.token_ids),
                logprobs=list(out.logprobs),
                text=text,
                tool_calls=self.renderer.parse_tool_calls(text, ep.tools),
                routed_experts=out.routed_experts,
                prompt_routed_experts=out.prompt_routed_experts,
                policy_version=out.policy_version,
                finish_reason=finish,
                num_computed_prompt_tokens=out.num_computed_prompt_tokens,
            )
        )
        ep.messages.append({"role": "assistant", "content": text})
        self.pending_ids = []
        return text

    def on_env_result(self, result) -> None:
        obs, reward, terminated, truncated, info = result
        ep, turn = self.episode, self.episode.turns[-1]
        new_msgs: list[Message] = list(obs.get("messages", []))
        turn.observation, turn.reward, turn.info = new_msgs, float(reward), dict(info)
        ep.messages.extend(new_msgs)
        if terminated or truncated:
            ep.info.update(info)
            self.finish(
                EpisodeStatus.COMPLETED if terminated else EpisodeStatus.TRUNCATED,
                "" if terminated else "env_truncated",
            )
            return
        self.pending_ids = self.renderer.continuation_ids(turn.token_ids, new_msgs)

    def env_step(self, text: str):
        return self.env.step(text)

    # --- ending ---------------------------------------------------------------------------------------
    def finish(self, status: EpisodeStatus, detail: str = "") -> None:
        if not self.done:
            self.done = True
            self.episode.status, self.episode.status_detail = status, detail
            self.episode.wall_time_s = time.monotonic() - self.t0
        return None

    def fail(self, where: str, e: BaseException) -> None:
        """An ERROR episode. ``status_detail`` is "<where>: Type: message"; ``info`` keeps ``error_where``
        and, from the exception as it was caught, ``error_type``, ``error_location`` (the user's file and
        line where there is one, envs/tracebacks.py), ``error_code`` (that line) and ``error_traceback``."""
        x = exception_info(e)
        self.episode.info.update(error_where=where, error_type=x["error_type"], error_location=x["location"],
                                 error_code=x["code"], error_traceback=x["traceback"])  # fmt: skip
        self.finish(EpisodeStatus.ERROR, f"{where}: {x['error']}")


GenerateFn = Callable[[list[TurnRequest]], list[TurnOutput]]
EndFn = Callable[[list[str]], None]


def drive_episodes(
    runs: list[EpisodeRun],
    generate: GenerateFn,
    end_sessions: EndFn | None = None,
    pool: ThreadPoolExecutor | None = None,
    gather_window_s: float = 0.002,
) -> list[Episode]:
    """Run episodes pinned to one worker to the end; returns their records in input order."""
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, min(8, len(runs))))
    ready = [r for r in runs if not r.done]
    stepping: dict[Future, EpisodeRun] = {}
    try:
        while ready or stepping:
            if ready:
                _generate_round(ready, generate, stepping, pool)
                _end_finished(ready, end_sessions)
            ready = _collect_env_steps(stepping, gather_window_s)
    finally:
        if own_pool:
            pool.shutdown(wait=True)
    _end_finished(runs, end_sessions)
    return [r.episode for r in runs]


def _generate_round(ready: list[EpisodeRun], generate: GenerateFn, stepping: dict, pool) -> None:
    batch = [(r, req) for r in ready if (req := r.next_request()) is not None]
    if not batch:
        return
    try:
        outs = generate([req for _, req in batch])
    except Exception as e:  # the worker failed: every episode of the round is an ERROR, none is lost
        for r, _ in batch:
            r.fail("worker.generate", e)
        return
    for (r, _), out in zip(batch, outs):
        text = r.on_output(out)
        if text is not None and not r.done:
            stepping[pool.submit(r.env_step, text)] = r


def _collect_env_steps(stepping: dict, window_s: float) -> list[EpisodeRun]:
    if not stepping:
        return []
    done, _ = wait(list(stepping), return_when=FIRST_COMPLETED)
    time.sleep(window_s)  # let near-simultaneous tool results join the same generate round
    done |= {f for f in stepping if f.done()}
    ready = []
    for f in done:
        r = stepping.pop(f)
        try:
            r.on_env_result(f.result())
        except Exception as e:
            r.fail("env.step", e)
        if not r.done:
            ready.append(r)
    return ready


def _end_finished(runs: list[EpisodeRun], end_sessions: EndFn | None) -> None:
    finished = [r for r in runs if r.done and not r._ended]
    for r in finished:
        r._ended = True
    if end_sessions is not None and finished:
        # freeing engine state is best effort; the episodes are already recorded
        with contextlib.suppress(Exception):
            end_sessions([r.episode.episode_id for r in finished])


def run_episode(
    env,
    worker,
    renderer: ChatRenderer | None = None,
    budget: EpisodeBudget | None = None,
    sampling: SamplingConfig | None = None,
    **run_kwargs: Any,
) -> Episode:
    """One episode on a plain ``RolloutWorker`` (see ``rollout.manager`` for groups and Ray)."""
    run = EpisodeRun(
        env, renderer or ChatRenderer(), budget or EpisodeBudget(), sampling or SamplingConfig(), **run_kwargs
    )
    return drive_episodes([run], worker.generate, worker.end_sessions)[0]
