"""The project's tiny byte-level BPE tokenizer: loading it, and the script that builds it.

The asset in ``rollout/assets/tokenizer/`` is built by ``python -m rollout.tokenizer`` from a
deterministic corpus: generic English-like text, arithmetic, JSON tool calls and tool responses in the
project's chat format, and (when ``envs`` is importable) the opening messages and scripted-expert turns
of the built-in environments. Digits are split one per token (a tiny model learns arithmetic far more
easily when numbers are not merged into arbitrary chunks). The vocabulary, specials included, is at most
1024 ids so that the CPU model preset (vocab_size 1024) covers it.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
MAX_VOCAB = 1024

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "at",
    "an",
    "which",
    "have",
    "not",
    "but",
    "all",
    "they",
    "were",
    "one",
    "has",
    "their",
    "more",
    "can",
    "when",
    "there",
    "will",
    "would",
    "about",
    "if",
    "what",
    "so",
    "other",
    "into",
    "some",
    "time",
    "number",
    "answer",
    "result",
    "compute",
    "calculate",
    "value",
    "sum",
    "product",
    "total",
    "find",
    "question",
    "search",
    "document",
    "tool",
    "call",
    "response",
    "error",
    "invalid",
    "argument",
    "expression",
    "step",
    "first",
    "then",
    "next",
    "final",
    "check",
    "correct",
    "please",
    "use",
    "the",
    "tools",
    "below",
    "return",
    "only",
    "think",
    "let",
    "me",
    "we",
    "need",
    "add",
    "subtract",
    "multiply",
    "divide",
    "equals",
    "city",
    "river",
    "mountain",
    "year",
    "born",
    "capital",
    "country",
    "population",
    "author",
    "book",
    "written",
    "wrote",
    "famous",
    "python",
    "function",
    "list",
    "string",
    "print",
    "return",
    "def",
    "import",
    "code",
    "test",
    "pass",
    "fail",
    "output",
    "input",
    "file",
    "hello",
    "world",
    "true",
    "false",
    "null",
    "name",
    "arguments",
    "type",
    "object",
    "properties",
    "required",
    "description",
]


def _generic_lines(rng: random.Random, n: int) -> Iterator[str]:
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        line = " ".join(words)
        yield line[0].upper() + line[1:] + rng.choice([".", "?", "!", ":", ","])


def _arith_lines(rng: random.Random, n: int) -> Iterator[str]:
    ops = ["+", "-", "*", "/", "**", "%"]
    for _ in range(n):
        a, b, c = rng.randint(0, 9999), rng.randint(0, 999), rng.randint(1, 99)
        expr = f"({a} {rng.choice(ops)} {b}) {rng.choice(ops)} {c}"
        yield f"What is {expr}? The answer is {rng.uniform(-1e4, 1e4):.4g}."


def _chat_lines(rng: random.Random, n: int) -> Iterator[str]:
    tools = ["calculator", "search", "python", "lookup", "submit", "read_file", "write_file", "answer"]
    for _ in range(n):
        name = rng.choice(tools)
        args = {rng.choice(["expression", "query", "code", "answer", "path"]): rng.choice(_WORDS)}
        call = json.dumps({"name": name, "arguments": args})
        yield (
            "<|im_start|>system\nYou are a helpful assistant. Use the tools.<|im_end|>\n"
            f"<|im_start|>user\n{' '.join(rng.choice(_WORDS) for _ in range(8))}?<|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n"
            f"<|im_start|>tool\n<tool_response>{rng.randint(-999, 99999)}</tool_response><|im_end|>\n"
        )


def _env_lines(max_episodes_per_env: int = 40) -> Iterator[str]:
    """Opening messages and scripted-expert turns of the built-in envs (skipped if envs is absent)."""
    try:
        import gymnasium as gym

        import envs  # noqa: F401  (registers the built-in envs)
    except Exception:
        return
    ids = [i for i in gym.registry if i.startswith("longhorizon/")]
    for env_id in sorted(ids):
        try:
            env = gym.make(env_id).unwrapped
        except Exception:
            continue
        for seed in range(max_episodes_per_env):
            yield from _env_episode_lines(env, seed)


def _env_episode_lines(env, seed: int) -> Iterator[str]:
    try:
        obs, _ = env.reset(seed=seed)
        for m in obs.get("messages", []):
            yield str(m.get("content", ""))
        yield json.dumps(obs.get("tools", []))
        for _ in range(8):
            action = env.expert_action()
            yield action
            obs, _, terminated, truncated, _ = env.step(action)
            for m in obs.get("messages", []):
                yield str(m.get("content", ""))
            if terminated or truncated:
                break
    except Exception:
        return


def build_corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    corpus = list(_generic_lines(rng, 4000)) + list(_arith_lines(rng, 3000)) + list(_chat_lines(rng, 1500))
    corpus += list(_env_lines())
    return corpus


def build_tokenizer(out_dir: Path = TOKENIZER_DIR, vocab_size: int = MAX_VOCAB, seed: int = 0):
    """Train the byte-level BPE on the corpus and save it as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} exceeds the model preset's {MAX_VOCAB}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None):
    """The project tokenizer as a ``PreTrainedTokenizerFast`` (the repo asset unless a path is given)."""
    from transformers import PreTrainedTokenizerFast

    d = Path(path) if path else TOKENIZER_DIR
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}; build it with `python -m rollout.tokenizer`")
    return PreTrainedTokenizerFast.from_pretrained(str(d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    p.add_argument("--vocab-size", type=int, default=MAX_VOCAB)
    args = p.parse_args()
    fast = build_tokenizer(args.out, args.vocab_size)
    print(f"saved tokenizer with {len(fast)} ids to {args.out}")


if __name__ == "__main__":
    main()
