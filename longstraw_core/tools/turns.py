"""``ToolTurns``: the rollout's ``TurnHandler`` over one ``ToolBranch`` per branch of a group.

``rollout(..., turns=ToolTurns(branches))`` hands it the branches whose turn ended at a decode
step; each ``ToolBranch`` parses its new turn, runs its tool calls and answers with the
tokens the rollout feeds the branch next (the tool results and the model's next turn header),
or ends the branch. The branches of one step run one after another, as TRL's tool loop runs
its completions' calls (their async tools run together within a branch's turn).
``close(responses)`` ends the branches the rollout cut at ``max_new_tokens`` as TRL does: the
cut turn is parsed and its complete calls run (an environment may count them), but their
results are dropped (no budget is left for them), so ``messages`` holds every turn the reward
functions are to see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from longstraw_core.tools.branch import ToolBranch


class ToolTurns:
    """The group's tool loops, branch ``i`` answered by ``branches[i]``."""

    def __init__(self, branches: Sequence[ToolBranch]) -> None:
        self.branches = list(branches)

    def after_turns(self, turns: Mapping[int, list[int]]) -> dict[int, list[int]]:
        appended: dict[int, list[int]] = {}
        for row, tokens in turns.items():
            branch = self.branches[row]
            if branch.done:
                continue
            suffix = branch.end_turn(tokens[len(branch.completion_ids) :])
            if suffix:
                appended[row] = suffix
        return appended

    def close(self, responses: Sequence[torch.Tensor]) -> None:
        """End each branch the rollout cut (module docstring), and check every branch's tokens
        are the rollout's."""
        for branch, response in zip(self.branches, responses, strict=True):
            tokens = response.tolist()
            if not branch.done and branch.end_turn(tokens[len(branch.completion_ids) :]):
                raise RuntimeError("a cut branch was given tool results: it has no budget left")
            if branch.completion_ids != tokens:
                raise RuntimeError(
                    "tool loop out of step with the rollout: a branch's tokens differ from "
                    "its response (was the rollout given these ToolTurns?)"
                )

    @property
    def messages(self) -> list[list[dict]]:
        """Each branch's completion as TRL passes it to reward functions."""
        return [branch.messages for branch in self.branches]

    @property
    def calls(self) -> int:
        return sum(branch.calls for branch in self.branches)

    @property
    def failures(self) -> int:
        return sum(branch.failures for branch in self.branches)
