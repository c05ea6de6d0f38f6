"""From a reward entry to a function: built-in names, dotted paths, registered callables and
factories resolved (``resolve_reward``), TRL's display name (``callable_name``), and the check
that TRL's keyword call can bind a function's signature (``signature_problem``)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from longstraw_core.rewards.builtins import BUILTIN_REWARDS
from longstraw_core.rewards.imports import (
    CALLABLE_PREFIX,
    RewardNameError,
    build,
    import_object,
    registered,
)
from longstraw_core.rewards.inputs import TRL_ARGUMENTS, RewardFn
from longstraw_core.rewards.reward_models import is_model_name, reward_model

__all__ = [
    "RewardEntry",
    "callable_name",
    "is_async_callable",
    "resolve_reward",
    "signature_problem",
]


def callable_name(fn: Callable[..., Any]) -> str:
    """TRL's display name of a reward function (its metric and table names): a partial's
    wrapped function's, else ``__name__``, else the class name of a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def resolve_reward(
    spec: str | RewardFn,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    search_dirs: Sequence[str | Path] = (),
    device: str | None = None,
    batch_size: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, RewardFn]:
    """A reward function and its display name from a built-in name (the name as given), a
    dotted path (``package.module:function`` or ``package.module.function``, looked up on the
    import path, then in ``search_dirs`` and the working directory; TRL's name of the object,
    ``callable_name``), a registered ``callable:<name>``, a callable, or a reward model: a
    directory or a Hub id (``models.is_model_name``) of a sequence classifier, its ``kwargs``
    ``from_pretrained``'s, run on ``device`` in batches of ``batch_size`` with
    ``chat_template_kwargs`` (``models.RewardModel``; TRL's name: the path's last part).

    With ``args``/``kwargs`` the named object is a factory and its product the function
    (``imports.build``). Raises ``RewardNameError`` (a ``ValueError``)."""
    if callable(spec):
        if args or kwargs:
            raise RewardNameError(
                "args/kwargs apply to a named factory; pass its product", "kwargs"
            )
        return callable_name(spec), spec
    model = not spec.startswith(CALLABLE_PREFIX) and spec not in BUILTIN_REWARDS
    model = model and is_model_name(spec)
    for key, value in (("device", device), ("batch_size", batch_size)):
        if value is not None and not model:
            raise RewardNameError(
                f"{key} applies to a reward model (a directory or Hub id), not to the reward "
                f"function {spec!r}; remove it",
                key,
            )
    if model:
        if args:
            raise RewardNameError(
                f"reward model {spec!r} takes no args (kwargs are from_pretrained's)", "args"
            )
        fn = reward_model(
            spec, device=device, batch_size=batch_size, init_kwargs=kwargs,
            chat_template_kwargs=chat_template_kwargs,
        )  # fmt: skip
        return fn.__name__, fn
    if spec.startswith(CALLABLE_PREFIX):
        target, shown = registered(spec), spec.removeprefix(CALLABLE_PREFIX)
    elif spec in BUILTIN_REWARDS:
        target, shown = BUILTIN_REWARDS[spec], spec
    elif ":" not in spec and "." not in spec:
        close = difflib.get_close_matches(spec, sorted(BUILTIN_REWARDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RewardNameError(
            f"unknown reward {spec!r}: {hint}not a built-in ({sorted(BUILTIN_REWARDS)}), a "
            "dotted path like 'package.module:function', nor a reward model's directory or Hub "
            "id ('org/name')"
        )
    else:
        target = import_object(spec, search_dirs)
        shown = None
    if args or kwargs:
        fn = build(spec, target, args, dict(kwargs or {}))
        return callable_name(fn), fn
    if not callable(target):
        raise RewardNameError(f"reward {spec!r} is not callable (got {type(target).__name__})")
    return shown or callable_name(target), target


# --------------------------------------------------------------------------- signatures


def signature_problem(fn: Callable[..., Any], columns: Collection[str] | None) -> str | None:
    """Why TRL's keyword call (``TRL_ARGUMENTS`` and the data's ``columns``) cannot bind
    ``fn``'s signature, as a phrase following the function's name; None when it can.

    ``columns`` None: not known yet, so only what no data could satisfy is reported.
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C callable): the call tells
        return None
    by_position = [
        p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty
    ]
    if by_position:
        return (
            f"takes {listed(by_position)} by position only, but TRL passes every argument by "
            "keyword: make them ordinary parameters"
        )
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    passed = [*TRL_ARGUMENTS, *(columns or ())]
    if columns is not None:
        lacking = [p.name for p in named if p.default is p.empty and p.name not in passed]
        if lacking:
            legacy = (
                "; LongStraw's former fn(completions, samples) is TRL's keyword call now: "
                "name the columns it reads, e.g. def f(completions, answer, **kwargs)"
                if "samples" in lacking
                else ""
            )
            return (
                f"needs {listed(lacking)}, which is neither an argument TRL passes "
                f"({', '.join(TRL_ARGUMENTS)}) nor a column of the data "
                f"({', '.join(columns) or 'none'}){legacy}"
            )
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = {p.name for p in named}
        unexpected = [name for name in passed if name not in accepted]
        if unexpected:
            return (
                f"does not accept {listed(unexpected)}, which TRL passes every reward "
                "function: add **kwargs"
            )
    return None


def listed(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, a partial of
    one, or an object whose ``__call__`` is async (TRL's ``is_async_callable`` forms)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class RewardEntry(Protocol):
    """A run config's reward entry (``config.RewardSpec``)."""

    name: str
    args: Sequence[Any]
    kwargs: dict[str, Any]
    device: str | None
    batch_size: int | None


def resolve_entry(
    entry: str | RewardFn | RewardEntry,
    *,
    search_dirs: Sequence[str | Path] = (),
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, RewardFn]:
    """``resolve_reward`` of a name, a callable, or a run config's entry (with its reward
    model settings; ``chat_template_kwargs``: the data's, which a reward model renders a
    chat with)."""
    if isinstance(entry, str) or callable(entry):
        return resolve_reward(
            entry, search_dirs=search_dirs, chat_template_kwargs=chat_template_kwargs
        )
    return resolve_reward(
        entry.name, args=entry.args, kwargs=entry.kwargs, search_dirs=search_dirs,
        device=getattr(entry, "device", None), batch_size=getattr(entry, "batch_size", None),
        chat_template_kwargs=chat_template_kwargs,
    )  # fmt: skip
