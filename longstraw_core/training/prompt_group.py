"""``PromptGroup``: one prompt's branches as a training loop (or eval) rolls them out and
scores them, with or without tools.

Why one object: an agent run (``rollout.tools`` / ``rollout.environment``) changes four
things around the rollout, and a loop should not branch on it four times:

- the prompt: an environment's ``reset`` observation is appended, and the tools' schemas
  are rendered by the chat template (``tools.Agents.template_kwargs``);
- the rollout's ``turns``: each branch's tool loop (``tool_turns``; None without tools);
- the completions the reward functions get: decoded text, or, with tools, each branch's
  messages (TRL's), after the cut branches are closed and, on pipeline stages, the last
  stage's outcome shared (``completions``);
- the reward call's extra keyword (``reward_kwargs``: TRL's ``environments``) and the
  ``tools/*`` counts (``tool_counts``).

    group = PromptGroup.build(sample, G, tokenizer, template_kwargs, agents)
    turns = group.tool_turns()
    out = ls.rollout(adapter, prefill(group.prompt_ids), G, ..., turns=turns)
    completions = group.completions(out, turns, adapter)
    scored = score_once(adapter, lambda: rewards(completions, ..., **group.reward_kwargs))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from longstraw_core.data.tasks import Sample
from longstraw_core.data.tokenizer import encode_prompt
from longstraw_core.rewards import RewardError
from longstraw_core.tools.agents import AgentGroup, Agents, ToolOutcome
from longstraw_core.tools.turns import ToolTurns

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.rewards import RewardResult
    from longstraw_core.rewards.inputs import Completion
    from longstraw_core.rollout.decode import RolloutOutput


def template_kwargs(
    chat_template_kwargs: Mapping[str, Any], agents: Agents | None
) -> dict[str, Any]:
    """How a run renders its prompts: ``data.chat_template_kwargs``, or with tools the
    agents' (the schemas added, and the built-in tokenizer's tool template)."""
    return dict(agents.template_kwargs if agents is not None else chat_template_kwargs)


def scores_here(adapter: ModelAdapter) -> bool:
    """Whether this rank calls the reward functions (``score_once``): every rank, or on
    pipeline stages the last, which ran the tools and holds the environments."""
    link = adapter.stage.link if adapter.stage is not None else None
    return link is None or link.is_last


def score_once(adapter: ModelAdapter, score: Callable[[], RewardResult]) -> RewardResult:
    """``score()`` (the reward call) on this rank, or on pipeline stages on the last stage
    alone, its result sent to the others (``StageLink.objects_from_last``).

    The stages of a pipeline hold the same completions; rewards that differ between calls (a
    sampling judge, a server, a clock) would give each stage its own advantages, and each
    stage's layers would train on another objective. So a pipeline scores once, as TRL scores
    once per process. A ``RewardError`` there (``train.raise_reward_errors``, a Ctrl-C in a
    reward's thread) is sent the same way and raised on every stage, so none waits for rewards
    that will not come."""
    link = adapter.stage.link if adapter.stage is not None else None
    if link is None or link.stages == 1:
        return score()
    outcome: tuple[str, Any] | None = None
    if link.is_last:
        try:
            outcome = ("scored", score())
        except RewardError as error:
            outcome = ("failed", str(error))
    kind, value = link.objects_from_last(outcome)  # type: ignore[misc]
    if kind == "failed":
        if not link.is_last:
            value += f" (on rank {link.last_rank}, which scores for this pipeline)"
        raise RewardError(value)
    return value


@dataclass
class PromptGroup:
    """``sample`` (its prompt as rendered: an observation added), ``prompt_ids``, the
    ``tokenizer``, the group's tool loops' source (``agent``: None without tools) and the
    ``outcomes`` of its finished rollouts, in order."""

    sample: Sample
    prompt_ids: torch.Tensor
    tokenizer: PreTrainedTokenizerBase
    agent: AgentGroup | None = None
    outcomes: list[ToolOutcome] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        sample: Sample,
        size: int,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: Mapping[str, Any],
        agents: Agents | None = None,
    ) -> PromptGroup:
        """``size`` branches of ``sample``: environments reset (with ``agents``), the prompt
        rendered with ``template_kwargs`` (``data.chat_template_kwargs``, or the agents')."""
        agent = agents.group(sample, size) if agents is not None else None
        if agent is not None:
            sample = agent.sample
        ids = torch.tensor(encode_prompt(tokenizer, sample.prompt, template_kwargs))
        return cls(sample, ids, tokenizer, agent)

    def tool_turns(self, rows: slice = slice(None)) -> ToolTurns | None:
        """The rollout's turn handler for branches ``rows`` (None without tools)."""
        if self.agent is None:
            return None
        return self.agent.turns(len(self.prompt_ids), rows)

    def completions(
        self, out: RolloutOutput, turns: ToolTurns | None, adapter: ModelAdapter
    ) -> list[Completion]:
        """What reward functions get of the rollout ``out`` (which ran with ``turns``):
        decoded text, or each branch's messages (module docstring). Collective on stages."""
        if self.agent is None or turns is None:
            return self.tokenizer.batch_decode(out.responses, skip_special_tokens=True)
        outcome = self.agent.finish(turns, out.responses, adapter)
        self.outcomes.append(outcome)
        return list(outcome.messages)

    @property
    def reward_kwargs(self) -> dict[str, Any]:
        """The reward call's extra keywords, for the completions of every finished rollout in
        order: TRL's ``environments`` when the run has an environment class."""
        if self.agent is None or self.agent.agents.toolset.environment is None:
            return {}
        return {"environments": [env for o in self.outcomes for env in o.environments]}

    @property
    def tool_counts(self) -> tuple[int, int] | None:
        """Tool calls and failed calls over the finished rollouts (None without tools)."""
        if self.agent is None:
            return None
        return sum(o.calls for o in self.outcomes), sum(o.failures for o in self.outcomes)
