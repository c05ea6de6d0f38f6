"""The non-finite guard: a step whose loss, gradient or logits are not finite changes nothing.

One NaN in one gradient entry makes the gradient norm NaN, and AdamW then turns every weight
into NaN; the run goes on printing step lines, saves the NaN weights, and every later step
and every resume fails. The guard skips such a step instead: no optimizer update, no
scheduler step, gradients cleared. It counts skipped steps; ``max_skipped_steps`` of them
in a row (the weights have diverged, e.g. ``optim.lr`` far too high) stop the run with
``TrainingDiverged``, whose message says what to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


class NonFiniteError(ArithmeticError):
    """A computation met inf/NaN where the step needs finite values (logits, a loss)."""


class TrainingDiverged(RuntimeError):
    """Too many steps in a row had to be skipped: the run cannot continue as configured."""


def non_finite_reason(loss: float, grad_norm: float) -> str | None:
    """Why a step must be skipped (``"loss is nan"``), or None when both are finite."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm is {grad_norm}"
    return None


# What a run stopped by skipped steps changes, by the cause of its last skip.
DIVERGED_FIX = (
    "the weights or the data give non-finite values every step. Lower optim.lr (or "
    "optim.max_grad_norm), check the reward functions and the data, then resume from a "
    "checkpoint before the trouble (train.resume_from=<output_dir>/step-N)"
)
REWARDS_FIX = (
    "the reward functions failed every step (their errors are logged above, one line per "
    "function and step). Fix them (or the judge they call) and run again; "
    "train.raise_reward_errors=true stops at the first failure with its error"
)


@dataclass
class NonFiniteGuard:
    """Counts skipped steps and stops the run after ``max_skipped_steps`` in a row.

    ``skipped`` counts every skipped step of the run (a checkpoint keeps it), ``in_a_row``
    the current streak; a step that updates the weights ends the streak.
    """

    max_skipped_steps: int
    skipped: int = 0
    in_a_row: int = 0
    # The last skip's step, reason and fix: for this process's messages, not checkpointed.
    last: tuple[int, str, str] | None = field(default=None, compare=False)

    def passed(self) -> None:
        """The step updated the weights."""
        self.in_a_row = 0

    def skip(
        self,
        step: int,
        reason: str,
        write: Callable[[str], None] = print,
        *,
        fix: str = DIVERGED_FIX,
    ) -> None:
        """Record that ``step`` changed nothing because of ``reason``; raise
        ``TrainingDiverged`` (ending with ``fix``: what to change) once more than
        ``max_skipped_steps`` steps in a row were."""
        self.skipped += 1
        self.in_a_row += 1
        self.last = (step, reason, fix)
        write(
            f"step {step} skipped: {reason}; no update (skipped {self.in_a_row} in a row, "
            f"{self.skipped} in all; train.max_skipped_steps={self.max_skipped_steps})"
        )
        if self.in_a_row > self.max_skipped_steps:
            raise TrainingDiverged(
                f"{self.in_a_row} steps in a row skipped (last at step {step}: {reason}), more "
                f"than train.max_skipped_steps={self.max_skipped_steps}: {fix}"
            )

    def nothing_trained(self, steps: int) -> None:
        """Raise ``TrainingDiverged`` for a run whose ``steps`` steps were all skipped (fewer
        than the limit in a row, so ``skip`` let it run to its end): it trained nothing, and
        ends as a failure rather than as a finished run."""
        step, reason, fix = self.last or (0, "no step ran", DIVERGED_FIX)
        raise TrainingDiverged(
            f"every step of this run was skipped ({steps}; the last, step {step}: {reason}), "
            f"so it trained nothing and wrote no checkpoint: {fix}"
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.in_a_row = int(state.get("in_a_row", 0))


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding inf or NaN, or None when all are finite.

    Checked before a checkpoint is written, so no checkpoint ever holds a non-finite value.
    """
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of the optimizer's state (AdamW's moments), named for error messages."""
    for index, (param, state) in enumerate(optimizer.state.items()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {key} of parameter {index} {tuple(param.shape)}", value
