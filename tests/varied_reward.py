"""A reward for fault tests that varies within every group, so every step trains.

Random tokens almost never score on the built-in rewards at tiny sizes; the fault tests
need each step to update the weights, so this one scores a completion by the share of its
characters with an even code point: deterministic, and different between completions.
"""

from __future__ import annotations

from longstraw_core.tasks import Sample


def even_characters(completions: list[str], samples: list[Sample]) -> list[float]:
    return [sum(ord(c) % 2 == 0 for c in text) / max(len(text), 1) for text in completions]


def always_fails(completions: list[str], samples: list[Sample]) -> list[float]:
    raise ConnectionError("the reward server is down")
