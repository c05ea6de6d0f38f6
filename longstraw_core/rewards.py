"""Reward functions and their weighted combination, with TRL's semantics.

A reward function takes the batch and returns one value per completion:

    def my_reward(completions: list[str], samples: list[Sample]) -> list[float | None]

``None`` (or NaN) means "not applicable to this sample", as in TRL. ``RewardSet`` calls each
function, stacks the columns into ``rewards_per_func`` ([N, F], None -> NaN) and sums
``weight * reward`` across functions ignoring NaN (TRL's ``nansum``).

Where LongStraw differs from TRL, on purpose:

- A row where every function gave NaN is *unscorable*. TRL keeps NaN there and zeroes that
  completion's advantage; our GRPO step refuses non-finite rewards, so ``RewardSet`` sets
  the final reward to 0.0, logs a warning and counts it (``RewardResult.unscorable``), or
  raises with ``unscorable="raise"``. ``rewards_per_func`` keeps the NaN for logging.
- A function that raises (or returns the wrong number of values, or a non-number) is logged
  with the ids of the samples in that batch, and its column becomes NaN, so one bad custom
  reward does not kill a long run; ``raise_errors=True`` re-raises instead. An infinite
  value is treated as invalid (NaN), logged with the sample id.
- A finite value larger in magnitude than ``MAX_ABS_REWARD`` counts as a failure of that
  function: the group's mean and std of such values overflow, and every advantage would
  silently become 0.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from longstraw_core.tasks import Sample

logger = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[Sample]], list[float | None]]
Completion = str | Sequence[dict[str, Any]]


# Squared deviations overflow float32 past ~1e19 (float64 past ~1e154), and well before that
# float32 advantages lose the differences: a reward this large is a bug, not a scale.
MAX_ABS_REWARD = 1e12


class RewardError(RuntimeError):
    """A reward function failed and ``raise_errors=True``."""


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


def exact_match(completions: list[Completion], samples: list[Sample]) -> list[float | None]:
    """1.0 when the extracted answer equals the reference (surrounding and repeated
    whitespace ignored), else 0.0; None for a sample without a reference."""
    out: list[float | None] = []
    for completion, sample in zip(completions, samples, strict=True):
        ref = " ".join(str(sample.answer).split())
        got = " ".join(extract_answer(completion).split())
        out.append(None if not ref else float(got == ref))
    return out


def contains(completions: list[Completion], samples: list[Sample]) -> list[float | None]:
    """Normalised containment (case, punctuation, whitespace ignored; whole words only).

    A sample with several required answers (``meta["answers"]``) scores the fraction found,
    RULER's ``string_match_all``. None for a sample without a reference.
    """
    out: list[float | None] = []
    for completion, sample in zip(completions, samples, strict=True):
        refs = sample.meta.get("answers") or [sample.answer]
        refs = [normalize(str(r)) for r in refs]
        if not all(refs):
            out.append(None)
            continue
        text = f" {normalize(extract_answer(completion))} "
        out.append(sum(f" {r} " in text for r in refs) / len(refs))
    return out


def answer_char_recall(completions: list[Completion], samples: list[Sample]) -> list[float | None]:
    """The fraction of the answer's distinct characters that the completion contains.

    Partial credit a random policy already earns sometimes: the signal that lets a tiny model
    learn something (the answer's alphabet) by GRPO alone in the CPU demos. It does not
    require retrieval; pair it with ``exact_match`` for real tasks. None without a reference.
    """
    out: list[float | None] = []
    for completion, sample in zip(completions, samples, strict=True):
        wanted = set(str(sample.answer).strip())
        text = completion_text(completion)
        out.append(None if not wanted else sum(c in text for c in wanted) / len(wanted))
    return out


def make_numeric_match(rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> RewardFn:
    """A ``numeric_match`` with other tolerances (``math.isclose`` semantics)."""

    def numeric_match(completions: list[Completion], samples: list[Sample]) -> list[float | None]:
        """1.0 when the last number of the extracted answer equals the reference number;
        None when the reference is not a number (the reward does not apply)."""
        out: list[float | None] = []
        for completion, sample in zip(completions, samples, strict=True):
            ref = parse_number(str(sample.answer))
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

    def format_reward(completions: list[Completion], samples: list[Sample]) -> list[float | None]:
        """1.0 when the completion has exactly one ``<tag>...</tag>`` pair, opened before it
        is closed, with non-empty content; else 0.0."""
        del samples  # the format does not depend on the reference
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
}


def resolve_reward(spec: str | RewardFn) -> tuple[str, RewardFn]:
    """A reward function and its display name from a built-in name, a dotted path
    (``package.module:function`` or ``package.module.function``) or a callable."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown reward {spec!r}: not a built-in ({sorted(BUILTIN_REWARDS)}) nor a "
            "dotted path like 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import reward {spec!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable (got {type(fn).__name__})")
    return attr, fn


# --------------------------------------------------------------------------- combination


@dataclass
class RewardResult:
    """Rewards of one batch.

    ``rewards``: the weighted sum per completion, always finite (see the module notes).
    ``rewards_per_func``: [N][F] raw values, NaN where a function returned None, failed, or
    gave a non-finite value. ``unscorable``: rows where every function gave NaN.
    ``failed``: function name -> ids of the samples in each batch where it raised.
    """

    names: list[str]
    rewards: list[float]
    rewards_per_func: list[list[float]]
    unscorable: list[int] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)

    @property
    def all_failed(self) -> bool:
        """Every reward function failed on this batch: the rewards carry no signal."""
        return bool(self.names) and len(self.failed) == len(self.names)

    def columns(self) -> dict[str, list[float]]:
        """Per-function columns, e.g. for a completions table."""
        return {n: [row[i] for row in self.rewards_per_func] for i, n in enumerate(self.names)}

    def metrics(self) -> dict[str, float]:
        """TRL's reward metrics: per-function nan-mean/std, overall mean/std, counts."""
        out: dict[str, float] = {}
        for name, col in self.columns().items():
            out[f"rewards/{name}/mean"] = _nanmean(col)
            out[f"rewards/{name}/std"] = _nanstd(col)
        scorable = [r for i, r in enumerate(self.rewards) if i not in set(self.unscorable)]
        out["reward"] = _nanmean(scorable)
        out["reward_std"] = _nanstd(scorable)
        out["rewards/unscorable_count"] = float(len(self.unscorable))
        out["rewards/failed_funcs"] = float(len(self.failed))
        return out


def _nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _nanstd(values: Sequence[float]) -> float:
    """Bessel-corrected std ignoring NaN, as TRL's ``nanstd``."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return math.nan
    mean = sum(kept) / len(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))


class RewardSet:
    """Several reward functions with weights: TRL's ``reward_funcs`` / ``reward_weights``.

    ``funcs``: built-in names, dotted paths or callables. ``weights``: one per function
    (default all 1.0). ``raise_errors``: re-raise a failing function instead of logging it
    and using NaN. ``unscorable``: what an all-NaN row becomes, ``"zero"`` (logged and
    counted) or ``"raise"``.
    """

    def __init__(
        self,
        funcs: Sequence[str | RewardFn],
        weights: Sequence[float] | None = None,
        *,
        raise_errors: bool = False,
        unscorable: Literal["zero", "raise"] = "zero",
    ) -> None:
        if not funcs:
            raise ValueError("RewardSet needs at least one reward function")
        resolved = [resolve_reward(f) for f in funcs]
        self.names = [name for name, _ in resolved]
        self.funcs = [fn for _, fn in resolved]
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise ValueError(
                f"Number of reward weights ({len(weights)}) must match number of reward "
                f"functions ({len(self.funcs)})"
            )
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite numbers, got {list(weights)}")
        if unscorable not in ("zero", "raise"):
            raise ValueError(f"unscorable must be 'zero' or 'raise', got {unscorable!r}")
        self.weights = [float(w) for w in weights]
        self.raise_errors = raise_errors
        self.unscorable = unscorable

    def __call__(
        self, completions: Sequence[Completion], samples: Sequence[Sample]
    ) -> RewardResult:
        if len(completions) != len(samples):
            raise ValueError(
                f"got {len(completions)} completions for {len(samples)} samples; pass one "
                "sample per completion (repeat a group's sample G times)"
            )
        completions, samples = list(completions), list(samples)
        columns, failed = [], {}
        for name, fn in zip(self.names, self.funcs, strict=True):
            column, error = self._column(name, fn, completions, samples)
            columns.append(column)
            if error:
                failed[name] = [s.id for s in samples]
        per_row = [list(row) for row in zip(*columns, strict=True)] if columns else []
        rewards, unscorable = self._combine(per_row, samples)
        return RewardResult(self.names, rewards, per_row, unscorable, failed)

    def _column(
        self, name: str, fn: RewardFn, completions: list[Completion], samples: list[Sample]
    ) -> tuple[list[float], bool]:
        """One function's values as floats (None -> NaN); NaN for all on failure."""
        try:
            raw = fn(completions, samples)
            column = [_as_float(v) for v in raw]
            if len(column) != len(samples):
                raise ValueError(f"returned {len(column)} rewards for {len(samples)} completions")
            huge = [v for v in column if math.isfinite(v) and abs(v) > MAX_ABS_REWARD]
            if huge:
                raise ValueError(
                    f"returned {huge[0]:g}, beyond |reward| <= {MAX_ABS_REWARD:g}: such values "
                    "overflow the group's statistics; scale the reward down"
                )
        except Exception as exc:
            ids = [s.id for s in samples]
            if self.raise_errors:
                raise RewardError(
                    f"reward function {name!r} failed on samples {ids}: {exc!r}"
                ) from exc
            logger.error("reward function %r failed on samples %s: %r", name, ids, exc)
            return [math.nan] * len(samples), True
        for value, sample in zip(column, samples, strict=True):
            if math.isinf(value):
                logger.warning(
                    "reward function %r gave %s for sample %s; using NaN", name, value, sample.id
                )
        return [math.nan if math.isinf(v) else v for v in column], False

    def _combine(
        self, per_row: list[list[float]], samples: list[Sample]
    ) -> tuple[list[float], list[int]]:
        """Weighted nansum per row; all-NaN rows follow ``self.unscorable``."""
        rewards, unscorable = [], []
        for i, row in enumerate(per_row):
            terms = [w * v for w, v in zip(self.weights, row, strict=True) if not math.isnan(v)]
            if not terms:
                unscorable.append(i)
            rewards.append(float(sum(terms)))
        if unscorable:
            ids = [samples[i].id for i in unscorable]
            message = (
                f"all reward functions returned None/NaN for rows {unscorable} (samples {ids})"
            )
            if self.unscorable == "raise":
                raise RewardError(message)
            logger.warning("%s; their reward is 0.0", message)
        return rewards, unscorable


def _as_float(value: object) -> float:
    """None -> NaN; bools and numbers (incl. numpy / 0-d torch) -> float; others raise."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        raise TypeError(f"reward values must be numbers or None, got the string {value!r}")
    return float(value)  # type: ignore[arg-type]
