"""A progress bar over training steps that shows the phase a step is in and the run's ETA.

One GRPO step on a long prompt spends minutes in phases of very different cost (prefill,
rollout, reward, replay, sweep, optimizer), so "step 3/100" alone says little about where
the time goes. The phase also times itself: ``step_done`` returns seconds per phase, which
become the ``time/<phase>`` metrics::

    progress = StepProgress(total_steps=100, initial=resumed_step)
    for step in range(resumed_step + 1, 101):
        with progress.phase("prefill"):
            state = adapter.prefill(prompt_ids)   # its own bar shows below, then goes away
        with progress.phase("rollout"):
            ...
        metrics |= progress.step_done()           # {"time/prefill": 12.1, ..., "time/step": 30.2}
    progress.close()

It is a tqdm bar because the passes count their own work on bars of their own (``counter``:
prefill and sweep tokens, decode steps, branches replayed), and tqdm stacks nested bars under
this one; text goes through ``write`` so lines print above the bars instead of through them.

Where stderr is not a terminal (a log file, CI, a scheduler's output), live bars would only
write carriage returns, so tqdm hides them; a million-token step would then be silent for an
hour. While a ``StepProgress`` with ``every_seconds`` is open (a run's, from
``train.progress_every_seconds``), each pass's ``counter`` prints a plain line instead, at
most every ``every_seconds`` and once when the pass ends (only a pass that printed before)::

    step 3/100 prefill: 38% 24.6k/65.5k tok [00:14<00:23, 1.75ktok/s]
    step 3/100 replay: sweep: 100% 65.5k/65.5k tok [00:41<00:00, 1.59ktok/s]

The counts are those the passes keep anyway (a chunk done, a decode step, a branch
replayed), read on the host where the pass already is: no device sync, no collective.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

PHASES = ("prefill", "rollout", "reward", "replay", "sweep", "optimizer", "eval", "checkpoint")
# A pass's plain line (no bar: a log has no width to fill).
PLAIN_FORMAT = (
    "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}]"
)

_open: list[StepProgress] = []  # the run's StepProgress while it is open (plain lines' source)


def counter(
    total: int, desc: str, unit: str, progress: bool | None, *, unit_scale: bool = False
) -> tqdm:
    """A pass's count of its work (``update(n)`` as each piece is done).

    ``progress``: False hides it (ranks other than the one that reports); True draws a live
    bar; None draws one on a terminal, and elsewhere prints plain lines every
    ``every_seconds`` of the open ``StepProgress`` (none open, as in a library call outside
    a run: nothing). Nothing to do (``total`` 0, e.g. no branch to replay): nothing shown."""
    if total == 0:
        progress = False
    if progress is None and _open and _open[-1].every_seconds is not None and not _on_terminal():
        return _open[-1].plain_counter(total, desc, unit, unit_scale)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        disable=(not progress) if progress is not None else None,
        leave=False,
    )


def _on_terminal() -> bool:
    """Whether tqdm's stream (stderr) is a terminal, where live bars redraw in place."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class _Lines:
    """A file for tqdm that turns its in-place redraws (``\\r`` + text) into whole lines on
    stderr, each written at once (lines of several processes do not interleave)."""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def flush(self) -> None:
        pass


class StepProgress:
    """Steps done out of ``total_steps``, the current phase, and an ETA.

    ``initial``: steps already done (a resumed run), so the bar and ETA count what is left.
    ``enabled``: None shows the bar only on a terminal (as tqdm decides); pass False on
    processes other than the main one. ``every_seconds``: while it is open, the passes'
    ``counter``s print a plain line at most this often where stderr is not a terminal
    (None: they stay silent there).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        initial: int = 0,
        enabled: bool | None = None,
        every_seconds: float | None = None,
    ) -> None:
        self.bar = tqdm(
            total=total_steps,
            initial=initial,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=(not enabled) if enabled is not None else None,
        )
        self.total_steps = total_steps
        self.current: str | None = None
        self.steps_done = initial
        self.every_seconds = None if enabled is False else every_seconds
        self._seconds: dict[str, float] = {}
        self._step_started = time.perf_counter()
        _open.append(self)

    def plain_counter(self, total: int, desc: str, unit: str, unit_scale: bool) -> tqdm:
        """``counter``'s plain lines, named by the step and phase they belong to: the first
        after ``every_seconds``, then at most that often, and a last one when the pass ends."""
        label = desc if self.current in (None, desc) else f"{self.current}: {desc}"
        every = self.every_seconds or 0.0
        return tqdm(
            total=total,
            desc=f"step {self.steps_done + 1}/{self.total_steps} {label}",
            unit=unit,
            unit_scale=unit_scale,
            file=_Lines(),
            bar_format=PLAIN_FORMAT,
            mininterval=every,
            delay=every,
            miniters=1,  # a time check at every update: lines as often as asked, no more
            position=0,  # one line each, never moved up to a nested bar's row
            leave=True,  # the pass's last line, if it printed any
            dynamic_ncols=False,
        )

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Show ``name`` on the bar while the block runs and add its duration to the step."""
        previous, self.current = self.current, name
        self.bar.set_postfix_str(f"phase={name}", refresh=True)
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed
            self.current = previous

    def step_done(self) -> dict[str, float]:
        """Advance the bar by one step; seconds per phase of that step, plus ``time/step``."""
        timings = self.take_timings()
        self.bar.set_postfix_str("", refresh=False)
        self.bar.update(1)
        self.steps_done += 1
        return timings

    def take_timings(self) -> dict[str, float]:
        """Seconds per phase since the last call (``time/<phase>``, ``time/step``), without
        advancing the bar: work outside the steps (the eval before the first)."""
        now = time.perf_counter()
        timings = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        timings["time/step"] = now - self._step_started
        self._seconds, self._step_started = {}, now
        return timings

    def write(self, line: str) -> None:
        """Print a line above the bars (a plain print would be overdrawn by them)."""
        tqdm.write(line)

    def close(self) -> None:
        self.bar.close()
        if self in _open:
            _open.remove(self)

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
