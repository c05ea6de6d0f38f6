"""A reward that reads a TRL dataset's own column (``solution``), for the recipe tests.

Partial credit, the share of the solution's characters in the completion, so even a random
toy's groups have reward variance and every step trains.
"""

from __future__ import annotations

from longstraw_core.tasks import Sample


def solution_char_recall(completions: list[str], samples: list[Sample]) -> list[float]:
    out = []
    for text, sample in zip(completions, samples, strict=True):
        wanted = set(sample.columns["solution"])
        out.append(sum(c in text for c in wanted) / len(wanted))
    return out
