"""The config check of the tool keys (``rollout.tools``, ``rollout.environment``,
``rollout.max_tool_calling_iterations``, ``rollout.tool_timeout_seconds``), run by
``config.validation.validate`` at load, before any weight or data is touched."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from longstraw_core.config.schema import ConfigError
from longstraw_core.tools.loading import ToolLoadError, ToolSet

if TYPE_CHECKING:
    from longstraw_core.config.schema import RunConfig


def check_config(
    cfg: RunConfig, search_dirs: Sequence[str | Path] = (), *, imports: bool = True
) -> None:
    """Raise ``ConfigError`` for a bad tool setting; ``imports=False`` leaves the tools
    unimported (as ``check_rewards=False`` does the reward functions)."""
    r = cfg.rollout
    iterations = r.max_tool_calling_iterations
    if iterations is not None and (isinstance(iterations, bool) or iterations < 0):
        raise ConfigError(
            "rollout.max_tool_calling_iterations",
            f"{iterations!r} is invalid; allowed: an int >= 0 (tool rounds per branch), or null "
            "for no limit",
        )
    timeout = r.tool_timeout_seconds
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(
            "rollout.tool_timeout_seconds",
            f"{timeout!r} is invalid; allowed: seconds > 0, or null for no limit",
        )
    threads = r.tool_threads
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ConfigError(
            "rollout.tool_threads",
            f"{threads!r} is invalid; allowed: an int >= 1 (branches whose tools may run at "
            "once; 1: one after another), or null for every branch's",
        )
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
