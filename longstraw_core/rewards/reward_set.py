"""``RewardSet``: several reward functions with weights, called as TRL calls them, their
values checked, combined with TRL's semantics and logged where they fail (see the package's
docstring)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from longstraw_core.data.tasks import Sample
from longstraw_core.rewards.failures import FailureReport
from longstraw_core.rewards.inputs import (
    TRL_ARGUMENTS,
    Completion,
    RewardFn,
    as_completion,
    is_conversational,
    sample_columns,
)
from longstraw_core.rewards.resolution import (
    RewardEntry,
    is_async_callable,
    listed,
    resolve_entry,
    signature_problem,
)
from longstraw_core.rewards.result import RewardResult
from longstraw_core.rewards.reward_models import RewardModel
from longstraw_core.rewards.running import (
    DEFAULT_TIMEOUT_SECONDS,
    EventLoopThread,
    RewardError,
    RewardTimeout,
    Stop,
    async_call_outcome,
    call_in_daemon,
    call_outcome,
    stop_error,
)

if TYPE_CHECKING:
    from transformers import TrainerState

    from longstraw_core.schema.run_config import RunConfig

# The package's name, as before the split: what log configurations and tests select.
logger = logging.getLogger("longstraw_core.rewards")

# Squared deviations overflow float32 past ~1e19 (float64 past ~1e154), and well before that
# float32 advantages lose the differences: a reward this large is a bug, not a scale.
MAX_ABS_REWARD = 1e12
# How long past the longest async timeout the caller waits for the event loop itself.
LOOP_GRACE_SECONDS = 5.0


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

    ``funcs``: built-in names, dotted paths, callables, reward models' directories or Hub
    ids, or run-config entries (``name``, ``args``, ``kwargs``, a reward model's ``device``
    and ``batch_size``: ``from_config``). ``chat_template_kwargs``: what a reward model
    renders a chat prompt with (the data's). ``weights``: one per function (default all 1.0). ``raise_errors``: re-raise a failing function instead of logging it
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
        report_each_call: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not funcs:
            raise ValueError("RewardSet needs at least one reward function")
        resolved = [resolve_entry(f, chat_template_kwargs=chat_template_kwargs) for f in funcs]
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
        self._loop = EventLoopThread() if any(self.is_async) else None
        self._checked: set[tuple[int, tuple[str, ...]]] = set()
        self._lingering: dict[int, threading.Thread] = {}  # timed-out calls still running
        self.failures = FailureReport()
        self.report_each_call = report_each_call

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        extra: Sequence[RewardFn] = (),
        *,
        report_each_call: bool = True,
        load_models: bool = True,
    ) -> RewardSet:
        """The run's reward functions: ``cfg.rewards`` (names, weights, factory arguments,
        timeouts) and ``train.raise_reward_errors``; ``extra``: more sources of weight 1 and
        the default timeout, after them (an environment's ``get_reward``, TRL's rule).
        ``report_each_call=False``: failures wait for ``report_failures`` (once per step).
        ``load_models=False``: reward models' weights load at their first call, not now (a
        pipeline stage that never scores: ``training.prompt_group.scores_here``)."""
        weights = [r.weight for r in cfg.rewards] + [1.0] * len(extra)
        timeouts = [r.timeout_seconds for r in cfg.rewards] + [DEFAULT_TIMEOUT_SECONDS] * len(extra)
        rewards = cls(
            [*cfg.rewards, *extra], weights, raise_errors=cfg.train.raise_reward_errors,
            timeouts=timeouts, report_each_call=report_each_call,
            chat_template_kwargs=dict(cfg.data.chat_template_kwargs or {}),
        )  # fmt: skip
        for fn in rewards.funcs:  # reward models' weights, before the first step needs them
            if load_models and isinstance(fn, RewardModel):
                fn.load()
        return rewards

    def __call__(
        self,
        completions: Sequence[Completion],
        samples: Sequence[Sample],
        *,
        completion_ids: Sequence[Sequence[int]],
        trainer_state: TrainerState | None = None,
        environments: Sequence[Any] | None = None,
    ) -> RewardResult:
        """Score ``completions`` (decoded text, or messages), one ``Sample`` and one list of
        token ids each (repeat a group's sample G times). ``trainer_state``: passed as is
        (default: a fresh ``TrainerState``, ``global_step`` 0). ``environments``: an agent
        run's, one per completion, passed to every function as TRL passes them."""
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
            "trainer_state": trainer_state if trainer_state is not None else trainer_state_at(0, 0),
            "log_extra": logs.log_extra,
            "log_metric": logs.log_metric,
        }
        if environments is not None:
            kwargs["environments"] = list(environments)
        columns, failed = self._columns(kwargs, samples)
        per_row = [list(row) for row in zip(*columns, strict=True)] if columns else []
        self.failures.scored += count
        rewards, unscorable = self._combine(
            per_row, samples, all_failed=len(failed) == len(self.names)
        )
        if self.report_each_call:
            self.report_failures()
        return RewardResult(
            self.names, rewards, per_row, unscorable, failed, prompts, completions,
            dict(logs.columns), dict(logs.metrics),
        )  # fmt: skip

    def report_failures(self, label: str = "") -> list[str]:
        """Log, one line per function, its failures (and infinite values) since the last
        report: the count of completions, their distinct sample ids, the distinct errors;
        ``label`` leads each line (``"step 3"``). Returns the lines."""
        lines = self.failures.lines(label)
        for line in lines:
            logger.error("%s", line)
        return lines

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
            if isinstance(outcome, Stop):
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
            return call_outcome(fn, kwargs)
        lingering = self._lingering.get(index)
        if lingering is not None and lingering.is_alive():
            return RewardTimeout(
                f"its call from an earlier batch, which exceeded the {timeout:g} s timeout, is "
                "still running; not called again until it returns"
            )
        thread, box = call_in_daemon(
            lambda: call_outcome(fn, kwargs), timeout, f"LongStraw-Reward-{self.names[index]}"
        )
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
                *(async_call_outcome(self.funcs[i], kwargs, self.timeouts[i]) for i in pending)
            )

        limited = [t for t in timeouts if t is not None]
        limit = max(limited) + LOOP_GRACE_SECONDS if len(limited) == len(timeouts) else None
        future = asyncio.run_coroutine_threadsafe(gather(), self._loop.loop)
        try:
            values = future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._loop.abandon()
            self._loop = EventLoopThread()
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
        except (Exception, SystemExit) as exc:  # SystemExit: the function's failure too
            ids = [s.id for s in samples]
            if self.raise_errors:
                distinct = list(dict.fromkeys(ids))
                raise RewardError(
                    f"reward function {name!r} failed on samples {distinct} ({len(ids)} "
                    f"completions): {exc!r}"
                ) from exc
            self.failures.failed(name, ids, repr(exc))
            return [math.nan] * len(samples), True
        infinite = [s.id for v, s in zip(column, samples, strict=True) if math.isinf(v)]
        if infinite:
            self.failures.infinite(name, infinite)
        return [math.nan if math.isinf(v) else v for v in column], False

    def _combine(
        self, per_row: list[list[float]], samples: list[Sample], *, all_failed: bool
    ) -> tuple[list[float], list[int]]:
        """Weighted nansum per row; an all-NaN row stays NaN (TRL) or raises. Not warned of
        when every function failed: their failure lines say why."""
        rewards, unscorable = [], []
        for i, row in enumerate(per_row):
            terms = [w * v for w, v in zip(self.weights, row, strict=True) if not math.isnan(v)]
            if not terms:
                unscorable.append(i)
            rewards.append(float(sum(terms)) if terms else math.nan)
        if unscorable:
            ids = list(dict.fromkeys(samples[i].id for i in unscorable))
            message = (
                f"all reward functions returned None/NaN for rows {unscorable} (samples {ids})"
            )
            if self.unscorable == "raise":
                raise RewardError(message)
            if all_failed:
                return rewards, unscorable
            logger.warning(
                "%s; they get zero advantage and stay out of the group's baseline", message
            )
        return rewards, unscorable


def _batch_columns(samples: list[Sample]) -> dict[str, list[Any]]:
    """Each column's values over the batch, TRL's ``reward_kwargs``; every sample must have
    the same columns (TRL takes the names from the first row)."""
    rows = [sample_columns(s) for s in samples]
    names = list(rows[0]) if rows else []
    taken = [name for name in names if name in TRL_ARGUMENTS]
    if taken:
        raise RewardError(
            f"sample {samples[0].id!r} has the column(s) {listed(taken)}, which TRL passes "
            "reward functions itself: rename that field in the data"
        )
    for sample, row in zip(samples, rows, strict=True):
        if set(row) != set(names):
            raise RewardError(
                f"sample {sample.id!r} has the columns {sorted(row)}, but {samples[0].id!r} has "
                f"{sorted(names)}: score samples with the same columns together"
            )
    return {name: [row[name] for row in rows] for name in names}


def _as_float(value: object) -> float:
    """None -> NaN; bools and numbers (incl. numpy / 0-d torch) -> float; others raise."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        raise TypeError(f"reward values must be numbers or None, got the string {value!r}")
    return float(value)  # type: ignore[arg-type]


def trainer_state_at(global_step: int, max_steps: int) -> TrainerState:
    """The ``transformers.TrainerState`` TRL's reward functions get (``trainer_state``).

    Imported here, when rewards are scored: ``transformers.trainer_callback`` imports peft,
    and peft bitsandbytes (about 2 s), which importing the rewards alone must not cost."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps)
