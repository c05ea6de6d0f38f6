"""What every task generator builds with: ``Sample``, the seeded keys, numbers, variable
names and needle depths, and ``make_sample``/``fit_multi``, which fit the prompt to length
(``haystack``) and record what was placed where."""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.tasks.haystack import fit_prompt
from longstraw_core.tokenizer import Prompt

ANSWER_INSTRUCTION = "Give only the answer, inside <answer></answer> tags."
Depth = float | Sequence[float]


@dataclass
class Sample:
    """One prompt with its reference answer.

    ``prompt`` is plain text or chat messages (``[{"role": ..., "content": ...}]``).
    ``answer`` is the canonical answer string (``""`` when the data has none); tasks with
    several required answers (all the values of a key, every variable of a chain) also list
    them in ``meta["answers"]``, which the ``contains`` reward scores as the fraction found.
    ``columns``: a dataset row's every column exactly as ``datasets`` returned it (``prompt``,
    ``solution``, ``ground_truth``..., what TRL passes its reward functions); empty for a
    generated task sample.
    """

    id: str
    prompt: Prompt
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)


# Words for keys; none of them occurs in the filler.
_KEY_TEXT = """
    amber azure cobalt coral crimson ebony indigo ivory jade lilac magenta maroon ochre olive
    scarlet sepia teal umber violet fuchsia badger beaver bison falcon ferret gecko heron
    jackal lemur lynx marmot narwhal ocelot otter panda puffin quokka raven salmon tapir
    walrus weasel wombat yak zebra condor dingo ibis koala
"""
KEY_WORDS = tuple(_KEY_TEXT.split())


def task_rng(task: str, seed: int) -> random.Random:
    return random.Random(f"longstraw-task:{task}:{seed}")


def needle_depths(depth: Depth | None, n: int, task: str) -> list[float]:
    """One depth per needle: a float repeats, a sequence must have one per needle,
    ``None`` spreads them evenly from 0 to 1."""
    if depth is None:
        out = [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
    elif isinstance(depth, (int, float)):
        out = [float(depth)] * n
    else:
        out = [float(d) for d in depth]
        if len(out) != n:
            raise ValueError(f"{task}: depth has {len(out)} entries, expected {n} (one per needle)")
    for d in out:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"{task}: depth must be in [0, 1], got {d}")
    return out


def two_word_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct two-word keys such as ``"teal-otter"``."""
    pairs = [f"{a}-{b}" for a in KEY_WORDS for b in KEY_WORDS if a != b]
    return rng.sample(pairs, n)


def numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` distinct numbers with exactly ``digits`` digits."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    lo = 10 ** (digits - 1) if digits > 1 else 0
    return [str(v) for v in rng.sample(range(lo, 10**digits), n)]


def var_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    return rng.sample(sorted(names), n)


def make_sample(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    intro: str,
    question: str,
    needles: Sequence[tuple[float, str]],
    answer: str,
    prompt_tokens: int,
    depth: Depth | None,
    seed: int,
    chat: bool,
    tolerance: float,
    id: str | None,
    meta: dict[str, Any],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Sample:
    prompt, got, actual = fit_prompt(
        tokenizer, task, intro, question, needles, prompt_tokens, seed, chat, tolerance,
        chat_template_kwargs,
    )  # fmt: skip
    meta = {
        "task": task,
        "seed": seed,
        "depth": depth if depth is None or isinstance(depth, (int, float)) else list(depth),
        "needle_depths": actual,
        "prompt_tokens": got,
        "target_tokens": prompt_tokens,
        **meta,
    }
    return Sample(id=id or f"{task}:{seed}", prompt=prompt, answer=answer, meta=meta)


def _in_order(items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Items in the order their needles appear (ties keep list order, as placement does)."""
    return [items[k] for k in sorted(range(len(items)), key=lambda k: (depths[k], k))]


def fit_multi(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    needles: Sequence[tuple[float, str]],
    items: Sequence[str],
    **kw: Any,
) -> Sample:
    """A sample whose answer is ``items`` (the first needles) joined in order of appearance."""
    sample = make_sample(task, tokenizer, needles=needles, answer="", **kw)
    answers = _in_order(items, sample.meta["needle_depths"][: len(items)])
    sample.answer = ", ".join(answers)
    sample.meta["answers"] = answers
    return sample
