"""``ToolTurns``: the rollout's ``TurnHandler`` over one ``ToolBranch`` per branch of a group.

``rollout(..., turns=ToolTurns(branches))`` hands it each branch whose turn ended
(``begin_turns``); the branch's ``ToolBranch`` parses the turn, runs its tool calls and
answers with the tokens the rollout feeds the branch next (the tool results and the model's
next turn header), or ends the branch. That work runs in worker threads (one per branch, or
``threads``: ``rollout.tool_threads``), so the rollout goes on decoding the other branches
while a tool runs and takes each answer when it is ready (``ended_turns``). Tools of
different branches may therefore run at the same time: each branch has its own environment
(``rollout.environment``), while a plain function tool (``rollout.tools``) may be called from
several threads at once and must allow it (or set ``rollout.tool_threads: 1``: one branch's
turn at a time, TRL's order). One branch's own calls run as TRL runs them (synchronous ones
in order, async ones together).

``close(responses)`` ends the branches the rollout cut at ``max_new_tokens`` as TRL does: the
cut turn is parsed and its complete calls run (an environment may count them), but their
results are dropped (no budget is left for them), so ``messages`` holds every turn the reward
functions are to see.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence

import torch

from longstraw_core.tools.branch import ToolBranch


class ToolTurns:
    """The group's tool loops, branch ``i`` answered by ``branches[i]``."""

    def __init__(self, branches: Sequence[ToolBranch], threads: int | None = None) -> None:
        self.branches = list(branches)
        workers = len(self.branches) if threads is None else min(threads, len(self.branches))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="LongStraw-Turn"
        )
        self._running: dict[int, concurrent.futures.Future[list[int]]] = {}

    def begin_turns(self, turns: Mapping[int, list[int]]) -> None:
        for row, tokens in turns.items():
            if row in self._running:
                raise RuntimeError(f"branch {row} ended a turn while its last one still runs")
            branch = self.branches[row]
            new = tokens[len(branch.completion_ids) :]
            if branch.done:
                self._running[row] = _answered([])
            else:
                self._running[row] = self._pool.submit(branch.end_turn, new)

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        if wait and self._running:
            concurrent.futures.wait(
                self._running.values(), return_when=concurrent.futures.FIRST_COMPLETED
            )
        ready = [row for row, future in self._running.items() if future.done()]
        return {row: self._running.pop(row).result() for row in ready}

    def close(self, responses: Sequence[torch.Tensor]) -> None:
        """End each branch the rollout cut (module docstring), and check every branch's tokens
        are the rollout's."""
        self._pool.shutdown(wait=True)
        if self._running:
            raise RuntimeError(f"branches {sorted(self._running)} still wait on their tools")
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


def _answered(tokens: list[int]) -> concurrent.futures.Future[list[int]]:
    future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
    future.set_result(tokens)
    return future
