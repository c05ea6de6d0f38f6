"""The config check of the tool keys (``rollout.tools``, ``rollout.environment``,
``rollout.max_tool_calling_iterations``, ``rollout.tool_timeout_seconds``,
``rollout.environment_timeout_seconds``), run by
``config.validation.validate`` at load, before any weight or data is touched."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from longstraw_core.schema.run_config import ConfigError
from longstraw_core.tools.tool_set import ToolLoadError, ToolSet

if TYPE_CHECKING:
    from longstraw_core.schema.run_config import RunConfig


def check_config(
    cfg: RunConfig, search_dirs: Sequence[str | Path] = (), *, imports: bool = True
) -> None:
    """Raise ``ConfigError`` for a bad tool setting; ``imports=False`` leaves the tools
    unimported (as ``check_rewards=False`` does the reward functions)."""
    r = cfg.rollout
    _check_count(
        "rollout.max_tool_calling_iterations", r.max_tool_calling_iterations, 0,
        "tool rounds per branch", "for no limit",
    )  # fmt: skip
    for key in ("tool_timeout_seconds", "environment_timeout_seconds"):
        timeout = getattr(r, key)
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigError(
                f"rollout.{key}",
                f"{timeout!r} is invalid; allowed: seconds > 0, or null for no limit",
            )
    _check_count(
        "rollout.tool_threads", r.tool_threads, 1,
        "branches whose tools may run at once; 1: one after another", "for every branch's",
    )  # fmt: skip
    if imports:
        try:
            toolset = ToolSet.load(r, search_dirs)
        except ToolLoadError as exc:
            raise ConfigError(exc.key, str(exc)) from None
        if not cfg.rewards and toolset.environment_name is None:
            raise ConfigError(
                "rewards",
                f"empty, and {r.environment} has no get_reward method to score the branches; "
                "list at least one {name, weight}, or give the environment a get_reward()",
            )


def _check_count(key: str, value: int | None, least: int, meaning: str, null: str) -> None:
    """``value`` is null or an int ``>= least`` (not a bool), else a ``ConfigError`` on ``key``."""
    if value is not None and (isinstance(value, bool) or value < least):
        raise ConfigError(
            key, f"{value!r} is invalid; allowed: an int >= {least} ({meaning}), or null {null}"
        )
