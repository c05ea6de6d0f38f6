"""Reward functions in TRL's convention, and their weighted combination with TRL's semantics.

A reward function is called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls it, by
keyword only, with one entry per completion in every list::

    fn(prompts=..., completions=..., completion_ids=..., **columns,
       trainer_state=..., log_extra=..., log_metric=...)

- ``prompts``: each completion's prompt as its ``Sample`` holds it: text (TRL's standard
  format) or chat messages (conversational), as the data row gave it;
- ``completions``: text for a text prompt; for a chat prompt (TRL's "conversational" format)
  ``[{"role": "assistant", "content": text}]`` (the recipes decode with special tokens
  skipped, as TRL does);
- ``completion_ids``: the sampled token ids (lists of ints, the EOS included, as TRL's);
- ``columns``: the sample's dataset columns (``sample_columns``: every column of its row but
  ``prompt``), e.g. ``solution=[...]``;
- ``trainer_state``: a ``transformers.TrainerState`` (``global_step``: optimizer steps done,
  ``max_steps``), for rewards shaped by training progress;
- ``log_extra(column, values)`` adds a column to the completions table, ``log_metric(name,
  value)`` a scalar to the step's metrics.

So TRL's own functions (``trl.rewards.think_format_reward``, ...) and functions written for
TRL run unchanged; the built-ins here are written the same way::

    def my_reward(completions, answer, **kwargs) -> list[float | None]

A function returns one value per completion; ``None`` (or NaN) means "not applicable", as in
TRL. An ``async def`` function (or an object with an async ``__call__``) runs, as in TRL, after
the synchronous ones, together with the other async ones (``asyncio.gather``) on one event
loop in a daemon thread that a ``RewardSet`` starts and keeps for the run.

A function whose signature the call cannot bind is refused, never called with wrong
arguments: a positional-only parameter, a required parameter that is neither an argument TRL
passes nor a column of the data, or no ``**kwargs`` while TRL passes more than it names
(``signature_problem``; the config check runs it at load time on the data's columns, and
``RewardSet`` again before it calls any function on a batch). LongStraw's former
``fn(completions, samples)`` is one.

``RewardSet`` calls each function, stacks the columns into ``rewards_per_func`` ([N, F],
None -> NaN) and sums ``weight * reward`` across functions ignoring NaN (TRL's ``nansum``).
A row where every function gave NaN is *unscorable*: its reward stays NaN, as in TRL, and
``losses.group_advantages`` leaves it out of its group's mean and std and gives it zero
advantage (TRL's ``nan_to_num(advantages, nan=0.0)``).

Where LongStraw differs from TRL, on purpose:

- A function that raises (or returns the wrong number of values, or a non-number) is logged
  with the ids of the samples in that batch, and its column becomes NaN, so one bad custom
  reward does not kill a long run (TRL raises); ``raise_errors=True`` re-raises instead.
- An infinite value is treated as invalid (NaN), logged with the sample id: in TRL it makes
  its group's mean infinite and every advantage NaN, hence 0.
- A finite value larger in magnitude than ``MAX_ABS_REWARD`` counts as a failure of that
  function: the group's mean and std of such values overflow, and every advantage would
  silently become 0.
- A call that takes longer than its timeout (``timeouts``; a run's
  ``rewards[i].timeout_seconds``, ``DEFAULT_TIMEOUT_SECONDS`` unless set) counts as a failure
  of that call, so a hung judge or a ``sleep`` cannot stall a run (TRL waits forever). Python
  cannot stop a thread: a synchronous function with a timeout runs in a daemon thread that
  the run stops waiting for; a call that times out is left running (it lingers until it
  returns, and the function is not called again meanwhile: its later batches fail at once).
  An async function is cancelled (``asyncio.wait_for``); one that blocks its event loop is
  left with that loop, and the later async calls get a new one. ``timeouts`` None: the call
  runs in the calling thread with no limit, as in TRL.
- ``SystemExit`` or ``KeyboardInterrupt`` raised by a reward function is not a failure of a
  call but a request to stop: ``RewardError`` naming the function, which the recipes turn into
  a one-line exit (TRL would end the run without a word).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import logging
import math
import re
import string
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

# Re-exported: the recipes import it from here, once longstraw_core has quieted bitsandbytes
# (transformers.TrainerState's import imports it).
from transformers import TrainerState

from longstraw_core import metrics as metric_names
from longstraw_core.grpo_config import normalize_scale_rewards
from longstraw_core.reward_imports import (
    CALLABLE_PREFIX,
    RewardNameError,
    build,
    import_object,
    registered,
)
from longstraw_core.tasks import Sample

if TYPE_CHECKING:
    from longstraw_core.config import RunConfig

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list[float | None]]
Completion = str | Sequence[dict[str, Any]]

# What TRL passes every reward function besides the dataset columns, in its order.
TRL_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
# Record fields TRL never passes as columns (the prompt goes as ``prompts``).
NOT_COLUMNS = ("prompt", "completion", "completion_ids")

# Squared deviations overflow float32 past ~1e19 (float64 past ~1e154), and well before that
# float32 advantages lose the differences: a reward this large is a bug, not a scale.
MAX_ABS_REWARD = 1e12

# The longest a reward function's call may take (seconds) before it counts as failed:
# ``rewards[i].timeout_seconds``' default. Generous for a remote judge scoring a group; a
# hang costs this much per step, not the run.
DEFAULT_TIMEOUT_SECONDS = 600.0
# How long past the longest async timeout the caller waits for the event loop itself.
LOOP_GRACE_SECONDS = 5.0


class RewardError(RuntimeError):
    """A reward function failed and ``raise_errors=True``, cannot be called at all, or asked
    to end the run (``SystemExit``, ``KeyboardInterrupt``)."""


class RewardTimeout(TimeoutError):
    """A reward function's call took longer than its timeout (a failure of that call)."""


class _Stop:
    """A reward function raised ``SystemExit``/``KeyboardInterrupt``: carried back to the
    calling thread, which raises ``RewardError``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def stop_error(name: str, error: BaseException) -> RewardError:
    """The one-line ``RewardError`` for a reward function that raised ``SystemExit`` or
    ``KeyboardInterrupt``."""
    return RewardError(
        f"reward function {name!r} raised {error!r}, which ends the run; a reward function "
        "returns None for a completion it cannot score, or raises an Exception to count as a "
        "failure"
    )


# --------------------------------------------------------------------------- TRL's inputs


def sample_columns(sample: Sample) -> dict[str, Any]:
    """The dataset columns TRL would pass for ``sample``: a data row's every column but
    ``NOT_COLUMNS`` (``Sample.columns``, as ``datasets`` read it; ``prompt`` is passed as
    ``prompts``), with ``answer`` added when the row's answer came from elsewhere (a
    ``messages`` row's last assistant turn). A generated task sample has no row: its
    ``answer`` (when it has one) and its ``meta``.

    The one place that maps a ``Sample`` onto TRL's columns.
    """
    row = sample.columns or sample.meta
    columns = {k: v for k, v in row.items() if k not in NOT_COLUMNS}
    if sample.answer and "answer" not in columns:
        columns = {"answer": sample.answer, **columns}
    return columns


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is chat messages (TRL's conversational format), as TRL's
    ``is_conversational({"prompt": prompt})`` decides: a list whose first item is a dict with
    a ``role``."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def as_completion(text: Completion, conversational: bool) -> Completion:
    """A decoded completion as TRL passes it: the text itself for a text prompt, one assistant
    message for a chat prompt. A completion already given as messages is left as it is."""
    if conversational and isinstance(text, str):
        return [{"role": "assistant", "content": text}]
    return text


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
}


def callable_name(fn: Callable[..., Any]) -> str:
    """TRL's display name of a reward function (its metric and table names): a partial's
    wrapped function's, else ``__name__``, else the class name of a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def resolve_reward(
    spec: str | RewardFn,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    search_dirs: Sequence[str | Path] = (),
) -> tuple[str, RewardFn]:
    """A reward function and its display name from a built-in name (the name as given), a
    dotted path (``package.module:function`` or ``package.module.function``, looked up on the
    import path, then in ``search_dirs`` and the working directory; TRL's name of the object,
    ``callable_name``), a registered ``callable:<name>``, or a callable.

    With ``args``/``kwargs`` the named object is a factory and its product the function
    (``reward_imports.build``). Raises ``RewardNameError`` (a ``ValueError``)."""
    if callable(spec):
        if args or kwargs:
            raise RewardNameError(
                "args/kwargs apply to a named factory; pass its product", "kwargs"
            )
        return callable_name(spec), spec
    if spec.startswith(CALLABLE_PREFIX):
        target, shown = registered(spec), spec.removeprefix(CALLABLE_PREFIX)
    elif spec in BUILTIN_REWARDS:
        target, shown = BUILTIN_REWARDS[spec], spec
    elif ":" not in spec and "." not in spec:
        raise RewardNameError(
            f"unknown reward {spec!r}: not a built-in ({sorted(BUILTIN_REWARDS)}) nor a "
            "dotted path like 'package.module:function'"
        )
    else:
        target = import_object(spec, search_dirs)
        shown = None
    if args or kwargs:
        fn = build(spec, target, args, dict(kwargs or {}))
        return callable_name(fn), fn
    if not callable(target):
        raise RewardNameError(f"reward {spec!r} is not callable (got {type(target).__name__})")
    return shown or callable_name(target), target


# --------------------------------------------------------------------------- signatures


def signature_problem(fn: Callable[..., Any], columns: Collection[str] | None) -> str | None:
    """Why TRL's keyword call (``TRL_ARGUMENTS`` and the data's ``columns``) cannot bind
    ``fn``'s signature, as a phrase following the function's name; None when it can.

    ``columns`` None: not known yet, so only what no data could satisfy is reported.
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C callable): the call tells
        return None
    by_position = [
        p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty
    ]
    if by_position:
        return (
            f"takes {_listed(by_position)} by position only, but TRL passes every argument by "
            "keyword: make them ordinary parameters"
        )
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    passed = [*TRL_ARGUMENTS, *(columns or ())]
    if columns is not None:
        lacking = [p.name for p in named if p.default is p.empty and p.name not in passed]
        if lacking:
            legacy = (
                "; LongStraw's former fn(completions, samples) is TRL's keyword call now: "
                "name the columns it reads, e.g. def f(completions, answer, **kwargs)"
                if "samples" in lacking
                else ""
            )
            return (
                f"needs {_listed(lacking)}, which is neither an argument TRL passes "
                f"({', '.join(TRL_ARGUMENTS)}) nor a column of the data "
                f"({', '.join(columns) or 'none'}){legacy}"
            )
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = {p.name for p in named}
        unexpected = [name for name in passed if name not in accepted]
        if unexpected:
            return (
                f"does not accept {_listed(unexpected)}, which TRL passes every reward "
                "function: add **kwargs"
            )
    return None


def _listed(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, a partial of
    one, or an object whose ``__call__`` is async (TRL's ``is_async_callable`` forms)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class _EventLoopThread:
    """An asyncio loop running in a daemon thread, as TRL keeps one for its async rewards:
    one loop for the run, so clients a reward function keeps (an HTTP session to a judge)
    stay bound to a live loop from step to step."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="LongStraw-RewardLoop", daemon=True)
        self.thread.start()
        ready.wait()
        atexit.register(self.close)

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def abandon(self) -> None:
        """When the loop next gets control (it may never): cancel its tasks, then stop it a
        second later (their cancellation runs first). Not waited for at exit."""
        atexit.unregister(self.close)

        def wind_down() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(1.0, self.loop.stop)

        self.loop.call_soon_threadsafe(wind_down)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


# --------------------------------------------------------------------------- combination


@dataclass
class RewardResult:
    """Rewards of one batch (the recipes score one group per call).

    ``rewards``: the weighted nansum per completion; NaN where every function gave NaN (the
    row is unscorable: zero advantage, left out of the group's statistics, as in TRL).
    ``rewards_per_func``: [N][F] raw values, NaN where a function returned None, failed, or
    gave a non-finite value. ``unscorable``: the all-NaN rows. ``failed``: function name ->
    ids of the samples in each batch where it raised. ``prompts``/``completions``: as the
    functions got them. ``extra_columns``: what they logged with ``log_extra``;
    ``logged_metrics``: with ``log_metric``, each name's values in call order.
    """

    names: list[str]
    rewards: list[float]
    rewards_per_func: list[list[float]]
    unscorable: list[int] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    prompts: list[Any] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)

    @property
    def all_failed(self) -> bool:
        """Every reward function failed on this batch: the rewards carry no signal."""
        return bool(self.names) and len(self.failed) == len(self.names)

    def columns(self) -> dict[str, list[float]]:
        """Per-function columns, e.g. for a completions table."""
        return {n: [row[i] for row in self.rewards_per_func] for i, n in enumerate(self.names)}

    def metrics(self) -> dict[str, float]:
        """TRL's reward metrics (names in ``longstraw_core.metrics``), this batch taken as one
        group: per-function nan-mean/std, the rewards' nan-mean/std (unscorable rows left
        out), whether the group's std is zero; LongStraw's counts; ``log_metric`` means."""
        m = metric_names
        out = reward_metrics([self])
        out[m.REWARD_UNSCORABLE_COUNT] = float(len(self.unscorable))
        out[m.REWARD_FAILED_FUNCS] = float(len(self.failed))
        for name, values in self.logged_metrics.items():
            out[name] = sum(values) / len(values)
        return out


def reward_metrics(
    groups: Sequence[RewardResult], scale_rewards: str | bool = "group"
) -> dict[str, float]:
    """TRL's reward metrics of a batch of groups (one ``RewardResult`` per prompt, all from
    one ``RewardSet``), as ``GRPOTrainer`` logs a batch: each function's nan-mean and std and
    the weighted rewards' (unscorable rows left out) over every completion, and the share of
    completions whose reward std is zero: their group's (``scale_rewards`` "group" or
    "none"; a group of one counts as zero, as TRL's eval with ``num_generations_eval=1``),
    or with "batch" the whole batch's, as TRL scales it."""
    m = metric_names
    names = groups[0].names if groups else []
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        column = [row[i] for group in groups for row in group.rewards_per_func]
        out[m.REWARD_FUNC_MEAN.format(name)] = _nanmean(column)
        out[m.REWARD_FUNC_STD.format(name)] = _nanstd(column)
    rewards = [r for group in groups for r in group.rewards]
    out[m.REWARD] = _nanmean(rewards)
    out[m.REWARD_STD] = _nanstd(rewards)
    # TRL: torch.isclose(std_rewards, 0) per completion, averaged; a NaN std is not close.
    if normalize_scale_rewards(scale_rewards) == "batch":
        std = _nanstd(rewards) if len(rewards) > 1 else 0.0
        zero_std = len(rewards) * math.isclose(std, 0.0, abs_tol=1e-8)
    else:
        zero_std = 0
        for group in groups:
            std = _nanstd(group.rewards) if len(group.rewards) > 1 else 0.0
            zero_std += len(group.rewards) * math.isclose(std, 0.0, abs_tol=1e-8)
    out[m.FRAC_REWARD_ZERO_STD] = zero_std / len(rewards) if rewards else math.nan
    return out


def batch_columns(result: RewardResult) -> RewardResult:
    """Only what ``reward_metrics`` reads (the functions' names and values, the weighted
    rewards): what replicas exchange to log one batch's metrics (no prompts: a million-token
    prompt must not travel)."""
    return RewardResult(result.names, list(result.rewards), result.rewards_per_func)


def _nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _nanstd(values: Sequence[float]) -> float:
    """Bessel-corrected std ignoring NaN, as TRL's ``nanstd`` (NaN below two values)."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return math.nan
    mean = sum(kept) / len(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))


class _Logs:
    """What reward functions log through ``log_extra`` and ``log_metric`` in one batch."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.columns[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))


class RewardSet:
    """Several reward functions with weights: TRL's ``reward_funcs`` / ``reward_weights``.

    ``funcs``: built-in names, dotted paths, callables, or run-config entries (``name``,
    ``args``, ``kwargs``: ``from_config``). ``weights``: one per function (default all 1.0). ``raise_errors``: re-raise a failing function instead of logging it
    and using NaN. ``unscorable``: what an all-NaN row gets, ``"nan"`` (TRL: its reward stays
    NaN, a warning is logged) or ``"raise"``.

        scored = rewards(texts, [sample] * G, completion_ids=ids, trainer_state=state)
    """

    def __init__(
        self,
        funcs: Sequence[str | RewardFn | RewardEntry],
        weights: Sequence[float] | None = None,
        *,
        raise_errors: bool = False,
        unscorable: Literal["nan", "raise"] = "nan",
        timeouts: float | Sequence[float | None] | None = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        if not funcs:
            raise ValueError("RewardSet needs at least one reward function")
        resolved = [_resolve_entry(f) for f in funcs]
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
        if unscorable not in ("nan", "raise"):
            raise ValueError(f"unscorable must be 'nan' or 'raise', got {unscorable!r}")
        if timeouts is None or isinstance(timeouts, (int, float)):
            timeouts = [timeouts] * len(self.funcs)
        if len(timeouts) != len(self.funcs) or not all(
            t is None or (isinstance(t, (int, float)) and 0 < t < math.inf) for t in timeouts
        ):
            raise ValueError(
                f"timeouts must be one positive number of seconds (or None: no limit) per "
                f"reward function, got {list(timeouts)}"
            )
        self.timeouts: list[float | None] = [None if t is None else float(t) for t in timeouts]
        for name, fn in zip(self.names, self.funcs, strict=True):
            problem = signature_problem(fn, None)
            if problem:
                raise ValueError(f"reward function {name!r} {problem}")
        self.weights = [float(w) for w in weights]
        self.raise_errors = raise_errors
        self.unscorable = unscorable
        self.is_async = [is_async_callable(fn) for fn in self.funcs]
        self._loop = _EventLoopThread() if any(self.is_async) else None
        self._checked: set[tuple[int, tuple[str, ...]]] = set()
        self._lingering: dict[int, threading.Thread] = {}  # timed-out calls still running

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RewardSet:
        """The run's reward functions: ``cfg.rewards`` (names, weights, factory arguments,
        timeouts) and ``train.raise_reward_errors``."""
        weights = [r.weight for r in cfg.rewards]
        timeouts = [r.timeout_seconds for r in cfg.rewards]
        return cls(
            cfg.rewards, weights, raise_errors=cfg.train.raise_reward_errors, timeouts=timeouts
        )

    def __call__(
        self,
        completions: Sequence[Completion],
        samples: Sequence[Sample],
        *,
        completion_ids: Sequence[Sequence[int]],
        trainer_state: TrainerState | None = None,
    ) -> RewardResult:
        """Score ``completions`` (decoded text, or messages), one ``Sample`` and one list of
        token ids each (repeat a group's sample G times). ``trainer_state``: passed as is
        (default: a fresh ``TrainerState``, ``global_step`` 0)."""
        count = len(completions)
        if len(samples) != count or len(completion_ids) != count:
            raise ValueError(
                f"got {count} completions, {len(samples)} samples and {len(completion_ids)} "
                "completion_ids; pass one of each per completion (repeat a group's sample G "
                "times)"
            )
        samples = list(samples)
        prompts = [s.prompt for s in samples]
        conversational = is_conversational(prompts[0]) if prompts else False
        completions = [as_completion(c, conversational) for c in completions]
        ids = [[int(t) for t in row] for row in completion_ids]
        logs = _Logs()
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": ids,
            **_batch_columns(samples),
            "trainer_state": trainer_state if trainer_state is not None else TrainerState(),
            "log_extra": logs.log_extra,
            "log_metric": logs.log_metric,
        }
        columns, failed = self._columns(kwargs, samples)
        per_row = [list(row) for row in zip(*columns, strict=True)] if columns else []
        rewards, unscorable = self._combine(per_row, samples)
        return RewardResult(
            self.names, rewards, per_row, unscorable, failed, prompts, completions,
            dict(logs.columns), dict(logs.metrics),
        )  # fmt: skip

    def _columns(
        self, kwargs: dict[str, Any], samples: list[Sample]
    ) -> tuple[list[list[float]], dict[str, list[str]]]:
        """Every function's values, synchronous ones first, then the async ones together."""
        data_columns = tuple(k for k in kwargs if k not in TRL_ARGUMENTS)
        for index, (name, fn) in enumerate(zip(self.names, self.funcs, strict=True)):
            self._check_call(index, name, fn, data_columns)
        results: dict[int, Any] = {}
        for index in range(len(self.funcs)):
            if not self.is_async[index]:
                results[index] = self._call(index, kwargs)
        pending = [i for i, is_async in enumerate(self.is_async) if is_async]
        if pending:
            results |= self._call_async(pending, kwargs)
        for index, outcome in results.items():
            if isinstance(outcome, _Stop):
                raise stop_error(self.names[index], outcome.error)
        columns, failed = [], {}
        for index, name in enumerate(self.names):
            column, error = self._column(name, results[index], samples)
            columns.append(column)
            if error:
                failed[name] = [s.id for s in samples]
        return columns, failed

    def _call(self, index: int, kwargs: dict[str, Any]) -> Any:
        """A synchronous function's values, or what it raised, within its timeout: in a
        daemon thread the caller stops waiting for (None: in this thread, no limit)."""
        fn, timeout = self.funcs[index], self.timeouts[index]
        if timeout is None:
            return _outcome(fn, kwargs)
        lingering = self._lingering.get(index)
        if lingering is not None and lingering.is_alive():
            return RewardTimeout(
                f"its call from an earlier batch, which exceeded the {timeout:g} s timeout, is "
                "still running; not called again until it returns"
            )
        box: list[Any] = []
        thread = threading.Thread(
            target=lambda: box.append(_outcome(fn, kwargs)),
            name=f"LongStraw-Reward-{self.names[index]}",
            daemon=True,
        )
        thread.start()
        thread.join(timeout)
        if thread.is_alive():  # it runs on, abandoned (a thread cannot be stopped)
            self._lingering[index] = thread
            return RewardTimeout(f"took longer than its timeout of {timeout:g} s")
        return box[0]

    def _call_async(self, pending: list[int], kwargs: dict[str, Any]) -> dict[int, Any]:
        """The async functions together on the reward loop, each cancelled at its timeout.
        One that blocks the loop itself (a call that never awaits) is abandoned with the
        loop: every pending call fails, and later calls get a new loop."""
        assert self._loop is not None
        timeouts = [self.timeouts[i] for i in pending]

        async def gather() -> list[Any]:
            return await asyncio.gather(
                *(_async_outcome(self.funcs[i], kwargs, self.timeouts[i]) for i in pending)
            )

        limited = [t for t in timeouts if t is not None]
        limit = max(limited) + LOOP_GRACE_SECONDS if len(limited) == len(timeouts) else None
        future = asyncio.run_coroutine_threadsafe(gather(), self._loop.loop)
        try:
            values = future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._loop.abandon()
            self._loop = _EventLoopThread()
            blocked = RewardTimeout(
                "the async reward functions' event loop was blocked past their timeout (a "
                "call that never awaits, e.g. time.sleep in an async def); it is abandoned"
            )
            values = [blocked] * len(pending)
        return dict(zip(pending, values, strict=True))

    def _check_call(
        self, index: int, name: str, fn: RewardFn, data_columns: tuple[str, ...]
    ) -> None:
        """Refuse a call the signature cannot bind, before any function runs (once per
        function and set of columns)."""
        if (index, data_columns) in self._checked:
            return
        problem = signature_problem(fn, data_columns)
        if problem:
            raise RewardError(f"reward function {name!r} {problem}")
        self._checked.add((index, data_columns))

    def _column(self, name: str, outcome: Any, samples: list[Sample]) -> tuple[list[float], bool]:
        """One function's values as floats (None -> NaN); NaN for all on failure."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            column = [_as_float(v) for v in outcome]
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
        """Weighted nansum per row; an all-NaN row stays NaN (TRL) or raises."""
        rewards, unscorable = [], []
        for i, row in enumerate(per_row):
            terms = [w * v for w, v in zip(self.weights, row, strict=True) if not math.isnan(v)]
            if not terms:
                unscorable.append(i)
            rewards.append(float(sum(terms)) if terms else math.nan)
        if unscorable:
            ids = [samples[i].id for i in unscorable]
            message = (
                f"all reward functions returned None/NaN for rows {unscorable} (samples {ids})"
            )
            if self.unscorable == "raise":
                raise RewardError(message)
            logger.warning(
                "%s; they get zero advantage and stay out of the group's baseline", message
            )
        return rewards, unscorable


class RewardEntry(Protocol):
    """A run config's reward entry (``config.RewardSpec``)."""

    name: str
    args: Sequence[Any]
    kwargs: dict[str, Any]


def _resolve_entry(entry: str | RewardFn | RewardEntry) -> tuple[str, RewardFn]:
    if isinstance(entry, str) or callable(entry):
        return resolve_reward(entry)
    return resolve_reward(entry.name, args=entry.args, kwargs=entry.kwargs)


def _batch_columns(samples: list[Sample]) -> dict[str, list[Any]]:
    """Each column's values over the batch, TRL's ``reward_kwargs``; every sample must have
    the same columns (TRL takes the names from the first row)."""
    rows = [sample_columns(s) for s in samples]
    names = list(rows[0]) if rows else []
    taken = [name for name in names if name in TRL_ARGUMENTS]
    if taken:
        raise RewardError(
            f"sample {samples[0].id!r} has the column(s) {_listed(taken)}, which TRL passes "
            "reward functions itself: rename that field in the data"
        )
    for sample, row in zip(samples, rows, strict=True):
        if set(row) != set(names):
            raise RewardError(
                f"sample {sample.id!r} has the columns {sorted(row)}, but {samples[0].id!r} has "
                f"{sorted(names)}: score samples with the same columns together"
            )
    return {name: [row[name] for row in rows] for name in names}


def _outcome(fn: RewardFn, kwargs: dict[str, Any]) -> Any:
    """The function's values, or the exception it raised (judged by ``_column``); a
    ``SystemExit``/``KeyboardInterrupt`` wrapped in ``_Stop``, to end the run."""
    try:
        return fn(**kwargs)
    except Exception as exc:
        return exc
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: stop the run
        return _Stop(exc)


async def _async_outcome(fn: RewardFn, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """``_outcome`` of an async function, cancelled after ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(_guarded(fn, kwargs), timeout)
    except (TimeoutError, asyncio.TimeoutError):  # the function's own errors are returned
        return RewardTimeout(f"took longer than its timeout of {timeout:g} s")
    except asyncio.CancelledError as exc:
        return RuntimeError(f"cancelled ({exc!r})")


async def _guarded(fn: RewardFn, kwargs: dict[str, Any]) -> Any:
    """Await the function inside the task ``wait_for`` makes, so that what it raises never
    reaches the event loop (a ``SystemExit`` escaping a task stops the loop's thread)."""
    try:
        return await fn(**kwargs)
    except Exception as exc:
        return exc
    except asyncio.CancelledError:
        raise  # the timeout's cancellation
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: stop the run
        return _Stop(exc)


def _as_float(value: object) -> float:
    """None -> NaN; bools and numbers (incl. numpy / 0-d torch) -> float; others raise."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        raise TypeError(f"reward values must be numbers or None, got the string {value!r}")
    return float(value)  # type: ignore[arg-type]
