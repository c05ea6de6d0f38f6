"""Tools for agent rollouts (issue 27), TRL's way: what the rollout loop calls between a
branch's turns. One job per module:

- ``schemas``: a tool's JSON schema (``transformers.utils.get_json_schema``), the
  ``apply_chat_template`` keywords of a run with tools (``template_kwargs``), and
  ``TOOL_CHATML_TEMPLATE``, the built-in tokenizer's ChatML with Hermes tool calls.
- ``environments``: environment classes (``reset``, tool methods, ``get_reward``).
- ``callbacks``: an environment built and reset within ``rollout.environment_timeout_seconds``,
  a failure as one ``AgentError`` line.
- ``tool_set``: ``ToolSet``, the tools a config names, loaded once.
- ``parsing``: a turn's tokens -> an assistant message with its ``tool_calls``
  (``parse_turn``: the tokenizer's own parser, else the documented Hermes fallback).
- ``running``: ``ToolRunner``, sync and async tools with a timeout, errors as
  ``{"error": ...}`` results.
- ``rendering``: the tokens a branch gets after a tool-calling turn (``tool_suffix``), the
  generation prompt (``resume_ids``), TRL's overflow rule (``overflows``).
- ``branch``: ``ToolBranch``, one branch's loop state (tokens, loss mask, messages, counts).
- ``checks``: ``check_config``, the config check of the tool keys.
- ``turns``: ``ToolTurns``, the rollout's turn handler over a group's branches.
- ``agents``: ``Agents``, a run's tools as its loop uses them, and ``AgentGroup``, a prompt's
  environments, turn handlers and their ``ToolOutcome`` (shared from the last stage).

``tool_metrics`` (TRL's ``tools/*``) is ``longstraw_core.metrics.names``'.
"""

from longstraw_core.metrics.names import tool_metrics
from longstraw_core.tools.agents import AgentError, AgentGroup, Agents, ToolOutcome
from longstraw_core.tools.branch import ToolBranch
from longstraw_core.tools.callbacks import DEFAULT_ENVIRONMENT_TIMEOUT_SECONDS, call_environment
from longstraw_core.tools.checks import check_config
from longstraw_core.tools.environments import (
    bound_tools,
    method_names,
    reset_group,
    reward_function,
    with_observation,
)
from longstraw_core.tools.parsing import has_response_parser, parse_hermes, parse_turn
from longstraw_core.tools.rendering import ToolSuffix, overflows, resume_ids, tool_suffix
from longstraw_core.tools.running import DEFAULT_TIMEOUT_SECONDS, ToolResult, ToolRunner
from longstraw_core.tools.schemas import (
    TOOL_CHATML_TEMPLATE,
    ToolSchemaError,
    renders_tool_calls,
    template_kwargs,
    tool_schema,
)
from longstraw_core.tools.tool_set import ToolLoadError, ToolSet
from longstraw_core.tools.turns import ToolTurns

__all__ = [
    "DEFAULT_ENVIRONMENT_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "TOOL_CHATML_TEMPLATE",
    "AgentError",
    "AgentGroup",
    "Agents",
    "ToolBranch",
    "ToolLoadError",
    "ToolOutcome",
    "ToolResult",
    "ToolRunner",
    "ToolSchemaError",
    "ToolSet",
    "ToolSuffix",
    "ToolTurns",
    "bound_tools",
    "call_environment",
    "check_config",
    "has_response_parser",
    "method_names",
    "overflows",
    "parse_hermes",
    "parse_turn",
    "renders_tool_calls",
    "reset_group",
    "resume_ids",
    "reward_function",
    "template_kwargs",
    "tool_metrics",
    "tool_schema",
    "tool_suffix",
    "with_observation",
]
