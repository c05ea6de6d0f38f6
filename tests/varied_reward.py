"""A reward for fault tests that varies within every group, so every step trains.

Random tokens almost never score on the built-in rewards at tiny sizes; the fault tests
need each step to update the weights, so this one scores a completion by the share of its
characters with an even code point: deterministic, and different between completions.
Written in TRL's convention (keyword arguments, ``**kwargs`` for the rest), as the recipes
call every reward function.
"""

from __future__ import annotations

from typing import Any

from longstraw_core.rewards import completion_text


def even_characters(completions: list[Any], **kwargs: Any) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return [sum(ord(c) % 2 == 0 for c in text) / max(len(text), 1) for text in texts]


def always_fails(completions: list[Any], **kwargs: Any) -> list[float]:
    raise ConnectionError("the reward server is down")
