"""What went wrong with the reward functions, said once per function and step.

Why a tally rather than a line per call: a recipe scores one group per call, whose
``num_generations`` completions share one sample, so a line per call repeated that sample's
id G times, and a step of several groups printed as many lines per function. ``FailureReport``
counts each function's failed completions and their distinct sample ids (and its distinct
errors) until the caller asks for the lines: ``RewardSet`` asks after every call unless its
owner reports per step (the training session does, after each step's scoring and each eval).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

# Sample ids shown per line; more are counted, not listed (a step of many prompts).
SHOWN_IDS = 8


@dataclass
class _Tally:
    """One function's failures (or infinite values) since the last report."""

    count: int = 0
    ids: dict[str, None] = field(default_factory=dict)  # distinct, in order of appearance
    errors: dict[str, None] = field(default_factory=dict)

    def add(self, ids: Iterable[str], error: str | None) -> None:
        ids = list(ids)
        self.count += len(ids)
        self.ids.update(dict.fromkeys(ids))
        if error is not None:
            self.errors[error] = None


class FailureReport:
    """Failed calls (``failed``) and infinite values (``infinite``) per function, and the
    completions scored since the last ``lines``."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.scored = 0
        self._failed: dict[str, _Tally] = {}
        self._infinite: dict[str, _Tally] = {}

    def failed(self, name: str, ids: Iterable[str], error: str) -> None:
        self._failed.setdefault(name, _Tally()).add(ids, error)

    def infinite(self, name: str, ids: Iterable[str]) -> None:
        self._infinite.setdefault(name, _Tally()).add(ids, None)

    def lines(self, label: str = "") -> list[str]:
        """One line per function that failed (then per function that gave infinite values):
        how many of the completions, which samples, what it raised; the tally restarts."""
        where = ", ".join(filter(None, [label, _rank()]))
        head = f"{where}: " if where else ""
        out = [
            f"{head}reward function {name!r} failed on {t.count} of {self.scored} completions "
            f"({_samples(t)}): {_errors(t)}"
            for name, t in self._failed.items()
        ]
        out += [
            f"{head}reward function {name!r} gave an infinite value for {t.count} of "
            f"{self.scored} completions ({_samples(t)}); used as NaN"
            for name, t in self._infinite.items()
        ]
        self._reset()
        return out


def _samples(tally: _Tally) -> str:
    ids = list(tally.ids)
    shown = ", ".join(repr(i) for i in ids[:SHOWN_IDS])
    more = f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return f"sample{'s' if len(ids) > 1 else ''} {shown}{more}"


def _errors(tally: _Tally) -> str:
    errors = list(tally.errors)
    more = len(errors) - 1
    return errors[0] + (f" (and {more} other error{'s' if more > 1 else ''})" if more else "")


def _rank() -> str:
    """``rank R of N`` under a launcher that sets them (torchrun, accelerate), else ``""``:
    each rank prints its own failures."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"rank {os.environ.get('RANK', '0')} of {world}" if world > 1 else ""
