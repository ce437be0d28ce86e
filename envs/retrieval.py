"""RetrievalQA: multi-hop questions over a generated document collection, through a ``search`` tool.

The world (people, companies, cities, countries; all names synthetic so no model knows them) is a
pure function of ``world_seed``; each entity has one short document. ``search`` ranks documents
with BM25 (rank_bm25's Okapi variant) and returns the top ``top_k``. Difficulty d asks a
min(d, 3)-hop question (person -> company -> city -> country); the expert searches each entity on
the chain in turn, then answers.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from rank_bm25 import BM25Okapi

from envs import protocol
from envs.base import Task, Tool, ToolEnv

SYSTEM = "Answer the question. Use the search tool to find facts. Reply with <answer>...</answer>."
_SYL = ["ka", "lo", "mi", "ra", "ven", "tor", "sa", "bel", "dri", "no", "qua", "zen", "fa", "ris", "ul", "mo"]


def _tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _names(rng: np.random.Generator, n: int, parts: int, suffix: str = "") -> list[str]:
    out: set[str] = set()
    while len(out) < n:
        words = ["".join(rng.choice(_SYL, size=int(rng.integers(2, 4)))).capitalize() for _ in range(parts)]
        out.add(" ".join(words) + suffix)
    return sorted(out)


def build_world(seed: int, num_people: int = 60) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 7])
    countries = _names(rng, 6, 1, "ia")
    cities = _names(rng, 12, 1)
    companies = _names(rng, 20, 1, " Labs")
    people = _names(rng, num_people, 2)
    city_country = {c: countries[int(rng.integers(len(countries)))] for c in cities}
    company = {
        c: {"city": cities[int(rng.integers(len(cities)))], "year": int(rng.integers(1900, 2020))}
        for c in companies
    }
    person = {
        p: {"company": companies[int(rng.integers(len(companies)))], "born": int(rng.integers(1940, 2005))}
        for p in people
    }
    docs = [f"{p} works at {v['company']}. {p} was born in {v['born']}." for p, v in person.items()]
    docs += [f"{c} was founded in {v['year']}. {c} is based in {v['city']}." for c, v in company.items()]
    docs += [f"{c} is a city in {k}." for c, k in city_country.items()]
    return {"people": person, "companies": company, "cities": city_country, "docs": docs}


class RetrievalQAEnv(ToolEnv):
    env_name = "RetrievalQA"
    default_max_turns = 8

    def __init__(self, *args: Any, world_seed: int = 0, top_k: int = 3, **kwargs: Any):
        self.world = build_world(world_seed)
        self.top_k = top_k
        self.bm25 = BM25Okapi([_tokens(d) for d in self.world["docs"]])
        super().__init__(*args, **kwargs)

    def make_tools(self) -> list[Tool]:
        params = {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 300}},
            "required": ["query"],
        }
        return [Tool("search", "Search the document collection.", params, self.search)]

    def search(self, query: str) -> str:
        terms = _tokens(query)
        if not terms:
            return "no results (empty query)"
        scores = self.bm25.get_scores(terms)
        best = [int(i) for i in np.argsort(-scores, kind="stable")[: self.top_k] if scores[i] > 0]
        if not best:
            return "no results"
        return "\n".join(f"[{i}] {self.world['docs'][i]}" for i in best)

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        people = sorted(self.world["people"])
        p = people[int(rng.integers(len(people)))]
        info = self.world["people"][p]
        comp = info["company"]
        city = self.world["companies"][comp]["city"]
        hops = min(difficulty, 3)
        ask_year = bool(rng.integers(2))
        if hops == 1:
            q, a, chain = (f"In which year was {p} born?", str(info["born"]), [p]) if ask_year else (
                f"Where does {p} work?", comp, [p])  # fmt: skip
        elif hops == 2:
            q, a, chain = (
                (
                    f"In which year was the company where {p} works founded?",
                    str(self.world["companies"][comp]["year"]),
                    [p, comp],
                )
                if ask_year
                else (f"In which city is the company where {p} works based?", city, [p, comp])
            )
        else:
            q, a, chain = (
                f"In which country is the company where {p} works based?",
                self.world["cities"][city],
                [p, comp, city],
            )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        return Task(key=q, messages=messages, target=a, data={"question": q, "chain": chain})

    def score_answer(self, answer: str | None) -> bool:
        return answer is not None and self.task is not None and _norm(answer) == _norm(self.task.target)

    def expert_action(self) -> str:
        chain = self.task.data["chain"]
        if self.turn < len(chain):
            return protocol.format_tool_call("search", {"query": chain[self.turn]})
        return protocol.format_answer(self.task.target)


def _norm(text: str) -> str:
    return " ".join(_tokens(text))
