"""What TRL passes a reward function: the arguments' names, the dataset columns of a
``Sample``, and prompts and completions in TRL's text or conversational format."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from longstraw_core.data.tasks import Sample

__all__ = [
    "NOT_COLUMNS",
    "TRL_ARGUMENTS",
    "Completion",
    "RewardFn",
    "as_completion",
    "is_conversational",
    "sample_columns",
]

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
