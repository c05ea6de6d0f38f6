"""A run's tools as its training loop and eval use them: ``Agents`` (one per run) and an
``AgentGroup`` per prompt.

Why a group: LongStraw prefills one prompt for a whole group, so what TRL does per completion
happens here once per prompt where it can, and per branch where it must:

1. ``Agents.group(sample, size)``: one environment per branch (``rollout.environment``),
   ``reset(**row)`` on each with the sample's row (``prompt`` and its columns, as TRL's
   ``reset(**x)``); their one observation is appended to the prompt (``with_observation``).
   The group's ``sample`` is the sample with that prompt: what is rendered, prefilled and
   passed to the reward functions as ``prompts`` (TRL passes the observed prompt too).
2. ``group.turns(prompt_tokens)``: the rollout's ``TurnHandler`` (``ToolTurns``: a
   ``ToolBranch`` per branch, ``rows`` picking some, as eval's greedy and sampled rollouts do).
3. ``group.finish(turns, responses, adapter)``: ends the branches the rollout cut, and, on
   pipeline stages, gives every stage the last stage's outcome (only the last stage ran the
   tools: each branch's messages, call and failure counts, and its environment, pickled).
   Its ``messages`` are the completions TRL passes reward functions, its ``environments``
   the keyword TRL passes them all (with an environment class).

The prompt's rendering keywords (``template_kwargs``: ``data.chat_template_kwargs`` plus the
tools' schemas, and the built-in tokenizer's tool template) serve the data scan too, so the
tools' system prompt counts against ``data.prompt_tokens``.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.data.tasks import Sample
from longstraw_core.rewards.inputs import sample_columns
from longstraw_core.tools.branch import ToolBranch
from longstraw_core.tools.callbacks import AgentError, call_environment
from longstraw_core.tools.environments import reset_group, reward_function, with_observation
from longstraw_core.tools.running import ToolRunner
from longstraw_core.tools.schemas import template_kwargs
from longstraw_core.tools.tool_set import ToolSet
from longstraw_core.tools.turns import ToolTurns

if TYPE_CHECKING:
    import torch

    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.pipeline.transport import StageLink
    from longstraw_core.schema.run_config import RunConfig


@dataclass
class ToolOutcome:
    """What a group's tool loops left: per branch its completion ``messages`` and its
    ``environment`` (None without ``rollout.environment``), and the group's ``calls`` and
    ``failures`` (TRL's ``tools/*`` counts)."""

    messages: list[list[dict[str, Any]]]
    environments: list[Any]
    calls: int
    failures: int


class Agents:
    """The run's tools (``ToolSet``), its tool runner and rendering keywords, and the limits
    of a branch (``max_new_tokens``, the model's ``max_positions``)."""

    def __init__(
        self,
        toolset: ToolSet,
        tokenizer: PreTrainedTokenizerBase,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        max_new_tokens: int,
        max_positions: int | None = None,
    ) -> None:
        self.toolset = toolset
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs(tokenizer, toolset.schemas, chat_template_kwargs)
        self.max_new_tokens = max_new_tokens
        self.max_positions = max_positions
        self.runner = ToolRunner(timeout=toolset.timeout)

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        tokenizer: PreTrainedTokenizerBase,
        search_dirs: Sequence[str | Path] = (),
    ) -> Agents | None:
        """The run's tools (``rollout.tools``, ``rollout.environment``); None without any."""
        toolset = ToolSet.load(cfg.rollout, search_dirs)
        if not toolset:
            return None
        return cls(
            toolset,
            tokenizer,
            dict(cfg.data.chat_template_kwargs),
            max_new_tokens=cfg.rollout.max_new_tokens,
        )

    def reward_functions(self) -> list[Callable[..., Any]]:
        """TRL's extra reward source: the environment's ``get_reward``, weight 1, named after
        its class (none without one)."""
        env = self.toolset.environment
        return [reward_function(env)] if self.toolset.environment_name else []

    def group(self, sample: Sample, size: int) -> AgentGroup:
        """A prompt's ``size`` branches: their environments reset with the sample's row, the
        sample with the observation in its prompt."""
        toolset = self.toolset
        if toolset.environment is None:
            return AgentGroup(self, sample, [None] * size)
        # Each call within rollout.environment_timeout_seconds; a failure stops the run.
        name, limit = toolset.environment.__name__, toolset.environment_timeout
        environments = call_environment(
            lambda: [toolset.new_environment() for _ in range(size)], f"{name}()", limit
        )
        row = {"prompt": sample.prompt, **sample_columns(sample)}
        observation = call_environment(
            lambda: reset_group(environments, row), f"{name}.reset", limit
        )
        sample = dataclasses.replace(sample, prompt=_observed(sample.prompt, observation))
        return AgentGroup(self, sample, environments)

    def close(self) -> None:
        self.runner.close()


@dataclass
class AgentGroup:
    """One prompt's branches (module docstring, steps 2 and 3)."""

    agents: Agents
    sample: Sample
    environments: list[Any] = field(default_factory=list)

    def turns(self, prompt_tokens: int, rows: slice = slice(None)) -> ToolTurns:
        """The turn handler of branches ``rows`` for a prompt of ``prompt_tokens`` tokens."""
        a = self.agents
        limits = {"prompt_tokens": prompt_tokens, "max_new_tokens": a.max_new_tokens,
                  "max_positions": a.max_positions}  # fmt: skip

        def branch(env: Any) -> ToolBranch:
            kwargs = {"template_kwargs": a.template_kwargs, "environment": env, **limits}
            return ToolBranch(a.tokenizer, a.toolset, a.runner, **kwargs)

        branches = [branch(env) for env in self.environments[rows]]
        return ToolTurns(branches, threads=a.toolset.threads)

    def finish(
        self, turns: ToolTurns, responses: Sequence[torch.Tensor], adapter: ModelAdapter
    ) -> ToolOutcome:
        """The branches' outcome after their rollout by ``adapter`` (on pipeline stages the
        last stage ran the tools and sends what they left)."""
        link = adapter.stage.link if adapter.stage is not None else None
        staged = link is not None and link.stages > 1
        if not staged or link.is_last:
            turns.close(responses)
            outcome = ToolOutcome(
                turns.messages, [b.environment for b in turns.branches], turns.calls,
                turns.failures,
            )  # fmt: skip
        if not staged:
            return outcome
        return _from_last_stage(link, outcome if link.is_last else None)


def _observed(prompt: Any, observation: Any) -> Any:
    """TRL's rule for chat prompts; a text prompt gets a string observation appended."""
    if isinstance(prompt, str):
        return prompt if observation is None else prompt + str(observation)
    return with_observation(prompt, observation)


def _from_last_stage(link: StageLink, outcome: ToolOutcome | None) -> ToolOutcome:
    """The last stage's outcome on every stage, pickled there first so that a failure (an
    environment that cannot be pickled) reaches every stage as the same error, not as a
    hang in the broadcast. An object broadcast (not a tensor's): the outcome holds the
    environments and messages, Python objects of no shape known ahead; once per rollout."""
    payload: tuple[str, Any] | None = None
    if link.is_last:
        try:
            payload = ("ok", pickle.dumps(outcome))
        except Exception as exc:  # pickle raises several kinds (TypeError, PicklingError...)
            payload = ("error", f"{type(exc).__name__}: {exc}")
    kind, value = link.objects_from_last(payload)  # type: ignore[misc]
    if kind == "error":
        raise AgentError(
            "rollout.environment: the last pipeline stage runs the tools and sends each "
            f"branch's environment to the other stages for the rewards, but it cannot be "
            f"pickled ({value}); keep its state picklable (no open files, sockets or locks), "
            "or run without distributed.pipeline_stages"
        )
    return pickle.loads(value)
