"""The tools a config names, loaded once per run: ``ToolSet.load(rollout, search_dirs)``.

``rollout.tools`` lists functions (sync or async) as ``module:function``, ``rollout.environment``
names an environment class (``environments``); both are imported as reward functions are
(``rewards.imports.import_object``: the import path, then the config file's directory, then
the working directory). Every tool needs a schema (``schemas.tool_schema``), and a name no
other tool has: the model calls tools by name. ``ToolLoadError.key`` is the config key at fault.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longstraw_core.rewards.imports import RewardNameError, import_object
from longstraw_core.tools.environments import bound_tools, has_reward, method_names
from longstraw_core.tools.schemas import Schema, ToolSchemaError, method_schema, tool_schema

if TYPE_CHECKING:
    from longstraw_core.schema.run_config import RolloutSection


class ToolLoadError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class ToolSet:
    """A run's tools: standalone ``functions``, an ``environment`` class (or None), their
    ``schemas`` in TRL's order (the functions, then the environment's methods by name),
    ``max_iterations`` (``rollout.max_tool_calling_iterations``; None: ``sys.maxsize``, TRL's
    no limit), ``timeout`` (``rollout.tool_timeout_seconds``), ``threads``
    (``rollout.tool_threads``: branches whose tool rounds may run at once; None: all) and
    ``environment_timeout`` (``rollout.environment_timeout_seconds``: building a group's
    environments, and their ``reset``; None: no limit)."""

    functions: list[Callable[..., Any]] = field(default_factory=list)
    environment: type | None = None
    schemas: list[Schema] = field(default_factory=list)
    max_iterations: int = sys.maxsize
    timeout: float | None = None
    threads: int | None = None
    environment_timeout: float | None = None

    def __bool__(self) -> bool:
        return bool(self.schemas)

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    @property
    def environment_name(self) -> str | None:
        """The name ``get_reward``'s reward is logged under (None: no such reward)."""
        env = self.environment
        return env.__name__ if env is not None and has_reward(env) else None

    def new_environment(self) -> Any:
        """A fresh environment instance for one branch (None without an environment)."""
        return None if self.environment is None else self.environment()

    def branch_tools(self, environment: Any = None) -> dict[str, Callable[..., Any]]:
        """Name -> callable for one branch: the functions and its environment's methods."""
        methods = [] if environment is None else bound_tools(environment)
        return {fn.__name__: fn for fn in [*self.functions, *methods]}

    @classmethod
    def load(cls, rollout: RolloutSection, search_dirs: Sequence[str | Path] = ()) -> ToolSet:
        functions, schemas = [], []
        seen: dict[str, str] = {}
        for i, spec in enumerate(rollout.tools):
            key = f"rollout.tools[{i}]"
            fn = _imported(key, spec, search_dirs)
            if inspect.isclass(fn) or not callable(fn):
                raise ToolLoadError(
                    key,
                    f"{spec} is a {type(fn).__name__}, not a function; name a function here, "
                    "or a class with tool methods as rollout.environment",
                )
            schema = _schema(key, lambda fn=fn: tool_schema(fn))
            _claim(seen, schema["function"]["name"], spec, key)
            functions.append(fn)
            schemas.append(schema)
        env = None
        if rollout.environment is not None:
            key = "rollout.environment"
            env = _imported(key, rollout.environment, search_dirs)
            if not inspect.isclass(env):
                raise ToolLoadError(
                    key, f"{rollout.environment} is a {type(env).__name__}, not a class"
                )
            if not callable(getattr(env, "reset", None)):
                raise ToolLoadError(
                    key,
                    f"{env.__name__} has no reset method; define reset(self, **kwargs) (it gets "
                    "the sample's columns; a returned string is appended to the prompt)",
                )
            names = method_names(env)
            if not names:
                raise ToolLoadError(
                    key,
                    f"{env.__name__} has no public methods besides reset/get_reward, so the "
                    "model has no tool to call; add one (type hints and a Google-style docstring)",
                )
            for name in names:
                where = f"{rollout.environment}.{name}"
                schemas.append(_schema(key, lambda name=name: method_schema(env, name)))
                _claim(seen, name, where, key)
        iterations = rollout.max_tool_calling_iterations
        return cls(
            functions=functions,
            environment=env,
            schemas=schemas,
            max_iterations=sys.maxsize if iterations is None else iterations,
            timeout=rollout.tool_timeout_seconds,
            threads=rollout.tool_threads,
            environment_timeout=rollout.environment_timeout_seconds,
        )


def _imported(key: str, spec: str, search_dirs: Sequence[str | Path]) -> Any:
    try:
        return import_object(spec, search_dirs)
    except RewardNameError as exc:
        raise ToolLoadError(
            key, str(exc).replace("cannot import reward", "cannot import")
        ) from None


def _schema(key: str, build: Callable[[], Schema]) -> Schema:
    try:
        return build()
    except ToolSchemaError as exc:
        raise ToolLoadError(key, str(exc)) from None


def _claim(seen: dict[str, str], name: str, where: str, key: str) -> None:
    if name in seen:
        raise ToolLoadError(
            key,
            f"two tools are named {name!r} ({seen[name]} and {where}); the model calls tools "
            "by name, so rename one",
        )
    seen[name] = where
