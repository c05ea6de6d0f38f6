"""Rollout with an agent's environment (``turns``): ragged decode steps, so that a branch
whose tools run holds up no other.

Each branch moves through its own turns: it decodes a token a step until its turn ends (an
EOS or a stop string); it is then handed to the ``TurnHandler`` (which runs its tools in
the background) and sits the steps out (``decode(..., counts=)`` with ``0`` for it) while the
others go on; when its answer is ready, the turn's end token and the appended tokens (tool
results, the next turn's header) are prefilled in one step of that branch, without autograd,
and the logits at the last of them draw its next token. Appended tokens are recorded as the
environment's (``loss_masks`` 0) and count against ``max_new_tokens``; what would overflow is
cut. On one process a step with nothing to decode waits for the first answer; FSDP ranks
decode in step (one collective a step), so a rank with nothing to decode runs an empty step
(no branch keeps anything) rather than holding up its peers.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.sampled_group import SampledGroup
from longstraw_core.state import PrefixState


class _Branches:
    """Where each branch of the group is: its inputs for the next step (``pending``), the
    end token it holds while its turn's answer is awaited (``held``), and which are done."""

    def __init__(self, group: SampledGroup, first: int) -> None:
        self.group = group
        self.pending: list[list[int]] = [[first] for _ in range(group.size)]
        self.held: dict[int, int] = {}
        self.done: dict[int, bool] = {}
        # Answers that used the budget up: fed only to score them, then the branch is cut.
        self.closing: set[int] = set()

    @property
    def active(self) -> list[int]:
        return [row for row, inputs in enumerate(self.pending) if inputs]

    @property
    def all_done(self) -> bool:
        return len(self.done) == self.group.size

    def lowest_position(self) -> int:
        """No branch samples a response position before this one again."""
        going = [row for row in range(self.group.size) if row not in self.done]
        return min((self.group.filled[row] for row in going), default=self.group.max_new_tokens)

    def take_answers(self, wait: bool) -> None:
        """Answers that are ready (with ``wait``: at least one): the answered branch goes on
        with its end token and the appended tokens, or ends."""
        if not self.held:
            return
        for row, appended in self.group.turns.ended_turns(wait=wait).items():
            token = self.held.pop(row)
            kept = self.group.append_fed(row, appended)
            if kept == 0:
                self.done[row] = True  # the environment ended it at its end token
                continue
            self.pending[row] = [token, *list(appended)[:kept]]
            if self.group.filled[row] >= self.group.max_new_tokens:
                # The answer used the budget up: fed (but its last token) only to score it.
                self.pending[row].pop()
                self.closing.add(row)

    def after_step(self, counts: list[int], logits: torch.Tensor) -> list[int]:
        """The log-probs of the answers this step prefilled; returns the branches that
        sample now (the others were closing: cut at the budget)."""
        sampling = []
        for row in self.active:
            closing = row in self.closing
            fed = counts[row] - (0 if closing else 1)
            if fed > 0:
                self.group.score_fed(row, logits[row, :fed])
            if closing:
                self.closing.discard(row)
                self.pending[row] = []
                self.done[row] = False
            else:
                sampling.append(row)
        return sampling

    def after_sampling(self, rows: list[int], ended: list[bool]) -> None:
        """Each sampled branch's next inputs: its token, or (its turn ended) a wait for the
        handler's answer; branches at the budget are done."""
        group, ending = self.group, {}
        for row, end in zip(rows, ended, strict=True):
            filled = group.filled[row]
            token = int(group.tokens[row, filled - 1])
            self.pending[row] = []
            if filled >= group.max_new_tokens:
                self.done[row] = end  # no budget left for an answer: TRL cuts here too
            elif end:
                self.held[row] = token
                ending[row] = group.tokens[row, :filled].tolist()
            else:
                self.pending[row] = [token]
        if ending:
            group.turns.begin_turns(ending)


def decode_with_turns(
    adapter: ModelAdapter, state: PrefixState, group: SampledGroup, bar: tqdm
) -> tuple[int, int]:
    """One process (or FSDP ranks in step), with ``group.turns``: ragged steps (module
    docstring). Returns the decode steps run and the branch cache's bytes."""
    size, device = group.size, adapter.device
    cache = adapter.new_branch_cache(state, size, group.max_new_tokens)
    branches = _Branches(group, int(state.last_token))
    sharded = adapter.parallel is not None
    bar.reset(total=None)
    steps = 0
    while True:
        branches.take_answers(wait=not sharded and not branches.active)
        active = branches.active
        if active or sharded:
            counts = [len(inputs) for inputs in branches.pending]
            width = max(1, *counts)
            inputs = torch.full((size, width), group.pad_id, dtype=torch.long)
            for row in active:
                inputs[row, : counts[row]] = torch.tensor(branches.pending[row])
            logits = adapter.decode(state, cache, inputs.to(device), counts=counts)
            steps += 1
            bar.update(1)
            sampling = branches.after_step(counts, logits)
            if sampling:
                last = torch.tensor([counts[row] - 1 for row in sampling], device=logits.device)
                index = torch.tensor(sampling, device=logits.device)
                ended = group.sample_rows(sampling, logits[index, last])
                branches.after_sampling(sampling, ended)
                if group.noise is not None:
                    group.noise.forget_before(branches.lowest_position())
        finite, done = adapter.everywhere_each(
            not bool(group.nonfinite), branches.all_done and not branches.held
        )
        if not finite:
            group.raise_if_nonfinite(steps - 1)
        if done:
            break
    group.end_rows(branches.done)
    return steps, cache.nbytes()
