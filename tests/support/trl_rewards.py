"""A reward that reads a TRL dataset's own column (``solution``), for the recipe tests.

Partial credit, the share of the solution's characters in the completion, so even a random
toy's groups have reward variance and every step trains. Written as a TRL user writes one:
keyword arguments, the dataset column by name, completions as text or chat messages.
"""

from __future__ import annotations

from typing import Any

from longstraw_core.rewards import completion_text


def solution_char_recall(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    out = []
    for completion, wanted_text in zip(completions, solution, strict=True):
        text, wanted = completion_text(completion), set(wanted_text)
        out.append(sum(c in text for c in wanted) / len(wanted))
    return out
