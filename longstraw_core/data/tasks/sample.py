"""What every task generator builds with: ``Sample``, the seeded keys, numbers, variable
names and needle depths, and ``task_generator``, which turns a task's ``Draft`` (its needles,
question and answer) into the generator every task shares: it fits the prompt to length
(``haystack``) and records what was placed where."""

from __future__ import annotations

import functools
import inspect
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from longstraw_core.data.tasks.haystack import Filler, WordFiller, fit_prompt
from longstraw_core.data.tokenizer import Prompt

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


@dataclass
class Draft:
    """What a task decides from its seed: the prompt's ``intro``, its ``question`` (the
    answer instruction is appended), the ``needles`` as ``(depth, sentence)`` and the answer:
    ``answer``, or ``items`` (the values of the first needles), which the answer lists in
    their order of appearance (``meta["answers"]``). ``meta``: the task's own facts.
    ``filler(seed)``: the text the needles go into (``haystack.Filler``), filler words unless
    the task reads real text."""

    intro: str
    question: str
    needles: Sequence[tuple[float, str]]
    answer: str = ""
    items: Sequence[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    filler: Callable[[int], Filler] = WordFiller


TaskFn = Callable[..., Sample]

# What every generator takes besides its task's own options: (tokenizer, prompt_tokens,
# depth, seed), then these keyword-only rendering options.
_P = inspect.Parameter
_LEADING = (
    _P("tokenizer", _P.POSITIONAL_OR_KEYWORD, annotation="PreTrainedTokenizerBase"),
    _P("prompt_tokens", _P.POSITIONAL_OR_KEYWORD, annotation="int"),
)
_SEED = _P("seed", _P.POSITIONAL_OR_KEYWORD, default=0, annotation="int")
_RENDERING = (
    _P("chat", _P.KEYWORD_ONLY, default=True, annotation="bool"),
    _P(
        "chat_template_kwargs", _P.KEYWORD_ONLY, default=None, annotation="Mapping[str, Any] | None"
    ),
    _P("tolerance", _P.KEYWORD_ONLY, default=0.01, annotation="float"),
    _P("id", _P.KEYWORD_ONLY, default=None, annotation="str | None"),
)


def task_generator(draft: Callable[..., Draft]) -> TaskFn:
    """The generator of a task, from its ``draft(rng, depth=default, *, options) -> Draft``.

    One place for what every task shares: the generator takes ``(tokenizer, prompt_tokens,
    depth, seed, *, options, chat, chat_template_kwargs, tolerance, id)`` (``depth``'s default
    is the draft's), seeds ``rng`` from the task's name (the draft's) and ``seed``, fits the
    prompt to ``prompt_tokens`` and records what was placed where. Its signature lists every
    argument: a config's ``data.task_kwargs`` is checked against it.
    """
    task = draft.__name__
    own = inspect.signature(draft).parameters
    options = [name for name, p in own.items() if p.kind is _P.KEYWORD_ONLY]
    depth = own["depth"].replace(kind=_P.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature(
        [*_LEADING, depth, _SEED, *(own[name] for name in options), *_RENDERING],
        return_annotation="Sample",
    )

    @functools.wraps(draft)
    def generate(*args: Any, **kwargs: Any) -> Sample:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:  # named, as Python names a plain function
            raise TypeError(f"{task}() {error}") from None
        bound.apply_defaults()
        given = bound.arguments
        rng = task_rng(task, given["seed"])
        return _fit(task, draft(rng, given["depth"], **{k: given[k] for k in options}), given)

    generate.__signature__ = signature  # type: ignore[attr-defined]
    return generate


def _fit(task: str, draft: Draft, given: dict[str, Any]) -> Sample:
    """The sample of ``draft``: its prompt fitted to length, and in ``meta`` what was placed
    where, then the draft's own facts."""
    depth, seed, prompt_tokens = given["depth"], given["seed"], given["prompt_tokens"]
    prompt, got, actual = fit_prompt(
        given["tokenizer"], task, draft.intro, f"{draft.question} {ANSWER_INSTRUCTION}",
        draft.needles, prompt_tokens, seed, given["chat"], given["tolerance"],
        given["chat_template_kwargs"], draft.filler,
    )  # fmt: skip
    meta = {
        "task": task,
        "seed": seed,
        "depth": depth if depth is None or isinstance(depth, (int, float)) else list(depth),
        "needle_depths": actual,
        "prompt_tokens": got,
        "target_tokens": prompt_tokens,
        **draft.meta,
    }
    sample = Sample(given["id"] or f"{task}:{seed}", prompt, draft.answer, meta)
    if draft.items is not None:
        answers = _in_order(draft.items, actual[: len(draft.items)])
        sample.answer = ", ".join(answers)
        sample.meta["answers"] = answers
    return sample


def _in_order(items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Items in the order their needles appear (ties keep list order, as placement does)."""
    return [items[k] for k in sorted(range(len(items)), key=lambda k: (depths[k], k))]
