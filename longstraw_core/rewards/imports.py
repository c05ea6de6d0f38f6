"""What a reward entry of a run config names: a module's object, a factory's product, or a
callable handed over in this process.

A TRL user passes reward functions as objects; a run config can only name them, so three
ways of naming are resolved here (``rewards.resolve_reward`` adds the built-ins):

- ``module:function`` (or ``module.function``): imported from the import path as usual, and
  if the module is not there, from the directory of the config file (``load_config`` passes
  it) and then the working directory: a ``my_rewards.py`` beside the config or where the
  command runs is found, without installing it. The directory it was found in is appended to
  ``sys.path`` (last, so it shadows nothing installed), which lets the module import its
  own neighbours and a later lookup of the same name find it. Nothing but the named module
  is imported; nothing in the config is executed.
- with ``args``/``kwargs``: the named object is a factory, called once with them; what it
  returns is the reward function (TRL's ``get_soft_overlong_punishment(max_completion_len,
  soft_punish_cache)``, or a class whose instances are called). The product is kept, so the
  config check and the run share one object (a factory that loads a judge model loads it once).
- ``callable:<name>``: a function registered in this process with ``register_callable``
  (``longstraw_core.training.trainer.train`` does, for lambdas and closures); it exists only in the
  process that registered it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CALLABLE_PREFIX = "callable:"

_REGISTERED: dict[str, Callable[..., Any]] = {}
_BUILT: dict[str, Callable[..., Any]] = {}


class RewardNameError(ValueError):
    """A reward entry that cannot be resolved; ``field`` is the entry's key at fault
    (``name``, ``args`` or ``kwargs``)."""

    def __init__(self, message: str, field: str = "name") -> None:
        super().__init__(message)
        self.field = field


def register_callable(fn: Callable[..., Any], name: str) -> str:
    """Make ``fn`` nameable in a run config as the returned ``callable:<name>`` (replacing an
    earlier registration of ``name``: a later call in the same process brings new objects)."""
    if not callable(fn):
        raise TypeError(f"reward {name!r} is not callable (got {type(fn).__name__})")
    _REGISTERED[name] = fn
    return CALLABLE_PREFIX + name


def registered(spec: str) -> Callable[..., Any]:
    """The callable registered as ``spec`` (``callable:<name>``)."""
    name = spec.removeprefix(CALLABLE_PREFIX)
    if name not in _REGISTERED:
        raise RewardNameError(
            f"reward {spec!r} is a function passed to longstraw_core.training.trainer.train in another "
            "process; pass it again through train(..., reward_funcs=[...]), or name a "
            "module:function here"
        )
    return _REGISTERED[name]


def import_object(spec: str, search_dirs: Sequence[str | Path] = ()) -> Any:
    """The object ``module:attr`` or ``module.attr`` names: from the import path, else from
    ``search_dirs`` and then the working directory (the first that holds the module)."""
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise RewardNameError(f"{spec!r} is not a dotted path like 'package.module:function'")
    try:
        module = _import_module(module_name, [*search_dirs, Path.cwd()])
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise RewardNameError(f"cannot import reward {spec!r}: {exc}") from exc


def _import_module(name: str, dirs: Sequence[str | Path]) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        if exc.name != top:  # the module is there, but it or a submodule is not: say so
            raise
        for directory in dirs:
            if importlib.machinery.PathFinder.find_spec(top, [str(directory)]) is not None:
                sys.path.append(str(directory))
                importlib.invalidate_caches()
                return importlib.import_module(name)
        places = ", ".join(dict.fromkeys(str(Path(d).resolve()) for d in dirs))
        raise ModuleNotFoundError(
            f"no module named {top!r} on the import path, nor in {places}", name=top
        ) from None


def build(spec: str, factory: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``factory(*args, **kwargs)``, checked: the arguments bind its signature, and it
    returns a callable. Built once per (``spec``, arguments) in a process."""
    key = json.dumps([spec, list(args), kwargs], sort_keys=True, default=repr)
    if key in _BUILT:
        return _BUILT[key]
    field = "kwargs" if kwargs else "args"
    if not callable(factory):
        raise RewardNameError(
            f"{spec!r} is called as a factory (args/kwargs given), but it is a "
            f"{type(factory).__name__}, not callable",
            field,
        )
    try:
        inspect.signature(factory).bind(*args, **kwargs)
    except TypeError as exc:
        raise RewardNameError(
            f"{spec}(...) cannot take these arguments ({exc}); args/kwargs are a factory's "
            "(a function that returns the reward function, or a class)",
            field,
        ) from None
    except ValueError:  # no signature to read (a C callable): the call tells
        pass
    try:
        product = factory(*args, **kwargs)
    except Exception as exc:
        raise RewardNameError(f"{spec}(...) raised {exc!r}", field) from exc
    if not callable(product):
        raise RewardNameError(
            f"{spec} with args/kwargs is called as a factory, but it returned a "
            f"{type(product).__name__}, not a reward function; give args/kwargs only to a "
            "factory (a function that returns the reward function, or a class)",
            field,
        )
    _BUILT[key] = product
    return product
