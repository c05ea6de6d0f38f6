"""Environments, TRL's ``environment_factory`` named in a config (``rollout.environment:
module:Class``): one instance per branch, whose public methods are that branch's tools.

As in TRL: the class must define ``reset``; ``reset(**row)`` is called with the sample's
columns before the rollout, and a string it returns is appended to the last user message
(``with_observation``); every other method not starting with ``_`` (``get_reward`` aside) is
a tool; an optional ``get_reward()`` (sync or async) scores the branch from the
environment's state, an extra reward source of weight 1 named after the class
(``reward_function``). LongStraw prefills one prompt for a whole group, so the G branches'
``reset`` must return the same observation (``reset_group``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RESERVED = ("reset", "get_reward")


def method_names(cls: type) -> list[str]:
    """The tool methods of an environment class, in TRL's order (sorted by name)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


def bound_tools(environment: Any) -> list[Callable[..., Any]]:
    """An instance's tool methods, bound (TRL lists them on the class, so properties are not
    evaluated)."""
    return [getattr(environment, name) for name in method_names(type(environment))]


def has_reward(cls: type) -> bool:
    return callable(getattr(cls, "get_reward", None))


def reset_group(environments: Sequence[Any], row: Mapping[str, Any]) -> Any:
    """``reset(**row)`` on each of a group's environments; their one observation (None, a
    string or content blocks). Branches that share a prefilled prompt cannot see different
    observations: a difference is a ValueError."""
    observations = [env.reset(**row) for env in environments]
    first = observations[0] if observations else None
    if any(o != first for o in observations[1:]):
        raise ValueError(
            "it returned different observations for the branches of one group; they share "
            "one prompt, so reset must return the same observation for the same row (keep "
            "per-branch randomness in the tools)"
        )
    return first


def with_observation(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt with ``reset``'s observation appended to its last message (TRL's rule; the
    prompt is not changed in place). None: the prompt as it is."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*prompt[:-1], {**prompt[-1], "content": content + observation}]


def reward_function(cls: type) -> Callable[..., Any]:
    """TRL's reward source for an environment's ``get_reward``: a function of the
    ``environments`` keyword (one per completion) returning each one's ``get_reward()``
    (None for an instance of another class), async when ``get_reward`` is; its ``__name__``
    is the class name, the name TRL logs it under."""
    if asyncio.iscoroutinefunction(cls.get_reward):

        async def reward(environments: Sequence[Any], **kwargs: Any) -> list[Any]:
            return [await e.get_reward() if type(e) is cls else None for e in environments]

    else:

        def reward(environments: Sequence[Any], **kwargs: Any) -> list[Any]:  # type: ignore[misc]
            return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward
