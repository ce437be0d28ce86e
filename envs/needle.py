"""NeedleHaystack: facts hidden in a long distractor context, combined with a calculator tool.

The user message is ``context_chars`` characters of generated filler with 2 + 2*difficulty
"door code" facts scattered through it; the question asks for the sum of two of the codes, so the
model must retrieve both facts from far apart and call ``calculator``. ``context_chars`` is the
long-context curriculum knob (a constructor argument; it does not change task ids, only the
filler length, and the needles' relative positions stay fixed).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from envs import protocol
from envs.arith import calculator_tool, numbers_match
from envs.base import Task, Tool, ToolEnv

SYSTEM = "Find the facts in the text. Use the calculator tool. Reply with <answer>N</answer>."
COLORS = [
    "red",
    "blue",
    "green",
    "amber",
    "white",
    "black",
    "violet",
    "silver",
    "orange",
    "brown",
    "grey",
    "pink",
]
_ADJ = ["quiet", "old", "narrow", "bright", "cold", "distant", "small", "wide", "dusty", "calm"]
_NOUN = ["river", "market", "garden", "bridge", "tower", "village", "harbor", "forest", "road", "valley"]
_VERB = ["overlooks", "follows", "surrounds", "faces", "crosses", "borders", "hides", "reaches"]


def _filler_sentence(rng: random.Random) -> str:
    a, n1, v, n2 = rng.choice(_ADJ), rng.choice(_NOUN), rng.choice(_VERB), rng.choice(_NOUN)
    return f"The {a} {n1} {v} the {n2}."


class NeedleHaystackEnv(ToolEnv):
    env_name = "NeedleHaystack"
    default_max_turns = 4

    def __init__(self, *args: Any, context_chars: int = 4000, **kwargs: Any):
        if not isinstance(context_chars, int) or context_chars < 200:
            raise ValueError(f"context_chars must be an int >= 200, got {context_chars!r}")
        self.context_chars = context_chars
        super().__init__(*args, **kwargs)

    def make_tools(self) -> list[Tool]:
        return [calculator_tool()]

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        n_doors = min(2 + 2 * difficulty, len(COLORS))
        colors = [str(c) for c in rng.choice(COLORS, size=n_doors, replace=False)]
        codes = [int(v) for v in rng.integers(100, 1000, size=n_doors)]
        asked = sorted(int(i) for i in rng.choice(n_doors, size=2, replace=False))
        positions = sorted(float(p) for p in rng.uniform(0.02, 0.98, size=n_doors))
        needles = [f"The code of the {c} door is {v}." for c, v in zip(colors, codes)]
        context = self._haystack(rng, needles, positions)
        c1, c2 = colors[asked[0]], colors[asked[1]]
        question = f"What is the sum of the codes of the {c1} door and the {c2} door?"
        target = codes[asked[0]] + codes[asked[1]]
        key = f"{question}|{list(zip(colors, codes))}"
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{context}\n\n{question}"},
        ]
        data = {"codes": [codes[asked[0]], codes[asked[1]]], "question": question, "num_needles": n_doors}
        return Task(key=key, messages=messages, target=str(target), data=data)

    def _haystack(self, rng: np.random.Generator, needles: list[str], positions: list[float]) -> str:
        filler_seed = int(rng.integers(2**31))
        filler_rng = random.Random(filler_seed)  # stdlib: ~50x faster per draw than numpy here
        sentences: list[str] = []
        size = 0
        while size < self.context_chars:
            s = _filler_sentence(filler_rng)
            sentences.append(s)
            size += len(s) + 1
        for needle, pos in sorted(zip(needles, positions), key=lambda x: -x[1]):
            sentences.insert(int(pos * len(sentences)), needle)
        return " ".join(sentences)

    def score_answer(self, answer: str | None) -> bool:
        return self.task is not None and numbers_match(answer, self.task.target)

    def expert_action(self) -> str:
        if self.turn == 0:
            a, b = self.task.data["codes"]
            return protocol.format_tool_call("calculator", {"expression": f"{a} + {b}"})
        return protocol.format_answer(self.task.target)
