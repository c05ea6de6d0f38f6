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

It is a tqdm bar because the adapters' prefill and the rollout draw tqdm bars of their own
(``leave=False``), and tqdm stacks nested bars under this one; text goes through ``write``
so lines print above the bars instead of through them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

PHASES = ("prefill", "rollout", "reward", "replay", "sweep", "optimizer", "eval", "checkpoint")


class StepProgress:
    """Steps done out of ``total_steps``, the current phase, and an ETA.

    ``initial``: steps already done (a resumed run), so the bar and ETA count what is left.
    ``enabled``: None shows the bar only on a terminal (as tqdm decides); pass False on
    processes other than the main one.
    """

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool | None = None) -> None:
        self.bar = tqdm(
            total=total_steps,
            initial=initial,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=(not enabled) if enabled is not None else None,
        )
        self.current: str | None = None
        self.steps_done = initial
        self._seconds: dict[str, float] = {}
        self._step_started = time.perf_counter()

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

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
