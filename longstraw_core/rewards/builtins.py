"""The built-in reward functions (``BUILTIN_REWARDS``, named in a run config by these
names) and the text helpers they and custom rewards use to read a completion."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Any

from longstraw_core.rewards.inputs import Completion, RewardFn

__all__ = [
    "BUILTIN_REWARDS",
    "answer_char_recall",
    "answer_token_f1",
    "answer_tokens",
    "completion_text",
    "contains",
    "exact_match",
    "extract_answer",
    "extract_regex",
    "extract_tag",
    "format_reward",
    "make_format_reward",
    "make_numeric_match",
    "normalize",
    "numeric_match",
    "parse_number",
]

# --------------------------------------------------------------------------- text helpers


def completion_text(completion: Completion | None) -> str:
    """A completion as text: a string as is, chat messages as the last message's content
    (TRL's conversational completions), anything missing as ``""``."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    messages = list(completion)
    return str(messages[-1].get("content", "")) if messages else ""


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize(text: str) -> str:
    """Lower case, punctuation as spaces, whitespace collapsed: what ``contains`` compares."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` (stripped), or None if there is none."""
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def extract_regex(text: str, pattern: str | re.Pattern[str]) -> str | None:
    """Last match of ``pattern``: its first group if it has one, else the whole match."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def extract_answer(
    completion: Completion | None, *, tag: str | None = "answer", pattern: str | None = None
) -> str:
    """The answer part of a completion: by ``pattern`` if given, else the last ``<tag>``
    content, else (no match) the whole stripped completion."""
    text = completion_text(completion)
    found = extract_regex(text, pattern) if pattern else extract_tag(text, tag) if tag else None
    return found if found is not None else text.strip()


_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?"
)


def parse_number(text: str) -> float | None:
    """The last number in ``text`` ("1,234.5", "-3e-4", ".5"), thousands commas allowed."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    value = float(matches[-1].replace(",", ""))
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- built-in rewards
# TRL's convention: keyword arguments, the reference from the ``answer`` column, ``**kwargs``
# for the rest. ``strict=True`` zips: a column of another length is a caller's bug.


def exact_match(
    completions: list[Completion], answer: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 when the extracted answer equals the reference (surrounding and repeated
    whitespace ignored), else 0.0; None for a sample without a reference."""
    out: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        ref = " ".join(str(reference).split())
        got = " ".join(extract_answer(completion).split())
        out.append(None if not ref else float(got == ref))
    return out


def contains(
    completions: list[Completion],
    answer: list[str],
    answers: list[list[str] | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Normalised containment (case, punctuation, whitespace ignored; whole words only).

    A sample with several required answers (an ``answers`` column, which the multi-answer
    tasks have) scores the fraction found, RULER's ``string_match_all``. None for a sample
    without a reference.
    """
    several = answers if answers is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, reference, listed in zip(completions, answer, several, strict=True):
        refs = [normalize(str(r)) for r in (listed or [reference])]
        if not all(refs):
            out.append(None)
            continue
        text = f" {normalize(extract_answer(completion))} "
        out.append(sum(f" {r} " in text for r in refs) / len(refs))
    return out


_ARTICLES = frozenset(("a", "an", "the"))


def answer_tokens(text: str) -> list[str]:
    """SQuAD's normalised words: ``normalize``'s, without the articles a, an, the."""
    return [w for w in normalize(text).split() if w not in _ARTICLES]


def answer_token_f1(
    completions: list[Completion], answer: list[str], **kwargs: Any
) -> list[float | None]:
    """SQuAD's token F1 between the extracted answer and the reference: partial credit for a
    part of the answer ("Varga" for "Ilse Varga": 0.67) or the answer among other words,
    1.0 for the answer itself (case, punctuation, articles ignored). None without a
    reference."""
    out: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        ref = answer_tokens(str(reference))
        if not ref:
            out.append(None)
            continue
        got = answer_tokens(extract_answer(completion))
        common = sum((Counter(got) & Counter(ref)).values())
        out.append(0.0 if not common else 2 * common / (len(got) + len(ref)))
    return out


def answer_char_recall(
    completions: list[Completion], answer: list[str], **kwargs: Any
) -> list[float | None]:
    """The fraction of the answer's distinct characters that the completion contains.

    Partial credit a random policy already earns sometimes: the signal that lets a tiny model
    learn something (the answer's alphabet) by GRPO alone in the CPU demos. It does not
    require retrieval; pair it with ``exact_match`` for real tasks. None without a reference.
    """
    out: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        wanted = set(str(reference).strip())
        text = completion_text(completion)
        out.append(None if not wanted else sum(c in text for c in wanted) / len(wanted))
    return out


def make_numeric_match(rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> RewardFn:
    """A ``numeric_match`` with other tolerances (``math.isclose`` semantics)."""

    def numeric_match(
        completions: list[Completion], answer: list[str], **kwargs: Any
    ) -> list[float | None]:
        """1.0 when the last number of the extracted answer equals the reference number;
        None when the reference is not a number (the reward does not apply)."""
        out: list[float | None] = []
        for completion, reference in zip(completions, answer, strict=True):
            ref = parse_number(str(reference))
            if ref is None:
                out.append(None)
                continue
            got = parse_number(extract_answer(completion))
            ok = got is not None and math.isclose(got, ref, rel_tol=rel_tol, abs_tol=abs_tol)
            out.append(float(ok))
        return out

    return numeric_match


numeric_match = make_numeric_match()


def make_format_reward(tag: str = "answer") -> RewardFn:
    """A ``format_reward`` for another tag name."""

    def format_reward(completions: list[Completion], **kwargs: Any) -> list[float | None]:
        """1.0 when the completion has exactly one ``<tag>...</tag>`` pair, opened before it
        is closed, with non-empty content; else 0.0."""
        out: list[float | None] = []
        for completion in completions:
            text = completion_text(completion)
            opens, closes = text.count(f"<{tag}>"), text.count(f"</{tag}>")
            inner = extract_tag(text, tag)
            out.append(float(opens == 1 and closes == 1 and bool(inner)))
        return out

    return format_reward


format_reward = make_format_reward()

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "contains": contains,
    "numeric_match": numeric_match,
    "format_reward": format_reward,
    "format": format_reward,
    "answer_char_recall": answer_char_recall,
    "answer_token_f1": answer_token_f1,
}
