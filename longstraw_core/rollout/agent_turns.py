"""Rollout with an agent's environment (``turns``): ragged decode steps, so that a branch
whose tools run holds up no other.

Each branch moves through its own turns: it decodes a token a step until its turn ends (an
EOS or a stop string); it is then handed to the ``TurnHandler`` (which runs its tools in
the background) and sits the steps out (``decode(..., counts=)`` with ``0`` for it) while the
others go on. When its answer is ready, the appended tokens (tool results, the next turn's
header) are recorded as the environment's (``loss_masks`` 0) and fed after the turn's end
token, without autograd, and the logits after the last of them draw the branch's next token;
the logits before each appended token give its log-prob (it never enters the loss).
Appended tokens count against ``max_new_tokens``; what would overflow is cut.

One process feeds a whole answer in one step: a multi-token prefill of that branch alone
(``BranchCache.narrow``: its rows of every record, so the others are not padded to the
answer's length) beside the others' one-token step; FSDP ranks pad it into their one batched
call a step (each forward may gather parameters); pipeline stages feed one token a step
(every message of the ring has a fixed shape). On one process a step with nothing to decode
waits for the first answer. FSDP ranks decode in step (one collective a step), so a rank
with nothing to decode runs an empty step (no branch keeps anything) rather than holding up
its peers. On stages the last
stage samples and runs the tools; every stage reads each step's counts from the messages.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.pipeline.runner import run_program
from longstraw_core.pipeline.schedule import Compute, Key, Message, Ring, micro_groups, ring_steps
from longstraw_core.pipeline.transport import MessageSpec, Payload
from longstraw_core.rollout.sampled_group import SampledGroup
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors.fake import known_bool


class TurnSteps:
    """Where each branch is: ``fed[row]`` inputs run (input 0 is the prompt's last token,
    input ``k`` the response's token ``k - 1``; the logits after input ``k`` predict response
    token ``k``), which branches wait on an answer, and which are done (``True``: ended,
    ``False``: cut at the budget).

    A branch's next inputs run from input ``fed`` to the newest response token: the logits
    after a token the branch already holds (an appended one) score it, and those after the
    newest draw the next. ``width`` caps a branch's inputs per step (``None``: all).
    """

    def __init__(self, group: SampledGroup, first_token: int, width: int | None) -> None:
        self.group, self.first, self.width = group, first_token, width
        self.fed = [0] * group.size
        self.waiting: set[int] = set()
        self.done: dict[int, bool] = {}
        self.ended_turn = [False] * group.size  # the newest token ended a turn

    def inputs(self, row: int) -> list[int]:
        if row in self.done or row in self.waiting:
            return []
        response, fed = self.group.responses[row], self.fed[row]
        end = min(len(response), self.group.max_new_tokens - 1)  # the last predicts nothing
        if self.width is not None:
            end = min(end, fed + self.width - 1)
        return [self.first if k == 0 else response[k - 1] for k in range(fed, end + 1)]

    @property
    def going(self) -> bool:
        """Some branch is not done (it decodes, or waits on an answer)."""
        return len(self.done) < self.group.size

    def lowest_position(self) -> int:
        """No branch draws a response position before this one again."""
        going = [row for row in range(self.group.size) if row not in self.done]
        return min((len(self.group.responses[r]) for r in going), default=self.group.max_new_tokens)

    def take_answers(self, wait: bool) -> None:
        """Answers that are ready (with ``wait``: at least one): the branch goes on after its
        end token with the appended tokens, or ends there (an empty answer)."""
        if not self.waiting:
            return
        for row, appended in self.group.turns.ended_turns(wait=wait).items():
            self.waiting.discard(row)
            self.ended_turn[row] = False
            if self.group.append_fed(row, appended) == 0:
                self.done[row] = True

    def after_step(
        self, rows: list[int], counts: list[int], logits: torch.Tensor, step: int
    ) -> None:
        """Decode step ``step`` fed ``counts[i]`` inputs to branch ``rows[i]`` (logits
        ``[len(rows), T, vocab]``): score the tokens they predict that the branches hold, draw the next token
        of those that reached their newest, and hand over the turns that ended."""
        group, sampling, last = self.group, [], []
        for i, (row, count) in enumerate(zip(rows, counts, strict=True)):
            if count == 0:
                continue
            first = self.fed[row]
            self.fed[row] += count
            held = len(group.responses[row])
            scored = min(count, held - first)  # predictions of tokens the branch holds
            if scored > 0:
                group.score_fed(row, first, logits[i, :scored])
            if first + count > held:
                sampling.append(row)
                last.append(i * logits.shape[1] + count - 1)
        if sampling:
            flat = logits.reshape(-1, logits.shape[-1])
            ended = group.sample_rows(sampling, flat[torch.tensor(last, device=flat.device)], step)
            for row, end in zip(sampling, ended, strict=True):
                self.ended_turn[row] = end
            turns = {
                row: list(group.responses[row])
                for row, end in zip(sampling, ended, strict=True)
                if end and len(group.responses[row]) < group.max_new_tokens
            }
            if turns:
                self.waiting.update(turns)
                group.turns.begin_turns(turns)
        for row in rows:
            if row not in self.done and row not in self.waiting and not self.inputs(row):
                # Nothing left to feed: at the budget, or ended with no answer to wait on.
                self.done[row] = self.ended_turn[row]

    def finish(self) -> None:
        self.group.end_rows(self.done)


def decode_with_turns(
    adapter: ModelAdapter, state: PrefixState, group: SampledGroup, bar: tqdm, every: int
) -> tuple[int, int]:
    """One process (or FSDP ranks in step), with ``group.turns``: ragged steps (module
    docstring). Whether the logits were finite is read every ``every`` loop rounds and at
    the end; FSDP ranks decide to stop together at those rounds only (a rank that is done
    runs empty rounds until then). Returns the decode steps run and the branch cache's
    bytes."""
    size, device = group.size, adapter.device
    cache = adapter.new_branch_cache(state, size, group.max_new_tokens)
    steps = TurnSteps(group, int(state.last_token), width=None)
    sharded = adapter.parallel is not None
    bar.total = None  # ragged steps: as many as the waits make
    count, rounds = 0, 0
    while True:
        # Nothing to decode on one process: wait for the first answer.
        idle = not sharded and not any(steps.inputs(row) for row in range(size))
        steps.take_answers(wait=idle)
        inputs = [steps.inputs(row) for row in range(size)]
        if any(inputs) or (sharded and steps.going):
            # An answer (several inputs) is prefilled for its branch alone (a narrowed cache),
            # not padded across the batch; FSDP ranks keep one call a step (its gathers).
            alone = [] if sharded else [row for row, ids in enumerate(inputs) if len(ids) > 1]
            for row in alone:
                ids = torch.tensor([inputs[row]], dtype=torch.long, device=device)
                logits = adapter.decode(state, cache.narrow(row, row + 1), ids, [ids.shape[1]])
                steps.after_step([row], [ids.shape[1]], logits, count)
            counts = [0 if row in alone else len(ids) for row, ids in enumerate(inputs)]
            if any(counts) or not alone:
                batch = torch.full((size, max(1, *counts)), group.pad_id, dtype=torch.long)
                for row, ids in enumerate(inputs):
                    batch[row, : counts[row]] = torch.tensor(ids[: counts[row]], dtype=torch.long)
                logits = adapter.decode(state, cache, batch.to(device), counts=counts)
                steps.after_step(list(range(size)), counts, logits, count)
            count += 1
            bar.update(1)
            if group.noise is not None:
                group.noise.forget_before(steps.lowest_position())
        rounds += 1
        # One process knows at once when it is done (no read); FSDP ranks agree every
        # ``every`` rounds, all at the same rounds.
        if (not sharded and not steps.going) or rounds % every == 0:
            finite, done = adapter.everywhere_each(
                not known_bool(group.nonfinite, fake=False), not steps.going
            )
            if not finite:
                group.raise_if_nonfinite()
            if done:
                break
    steps.finish()
    return count, cache.nbytes()


def decode_with_turns_on_stages(
    adapter: ModelAdapter, state: PrefixState, group: SampledGroup, bar: tqdm, every: int
) -> tuple[int, int]:
    """Pipeline stages, with ``group.turns``: the ring of ``rollout._decode_on_stages``
    with one input a branch a step, or none while it waits (module docstring). The last
    stage sends the first each micro-group's next tokens and counts, and every stage passes
    the counts on with its hidden states. The ring may run past ``max_new_tokens`` steps
    (branches sit steps out); it is planned for twice as many, and the last stage waits for
    an answer rather than let a waiting branch run out of steps. The stop collective runs
    every ``every`` ring steps. Each stage reads each message's counts (its cache's lengths
    are the host's); the last stage reads each step's tokens (the environment's). Returns
    the ring steps run and this stage's branch caches' bytes."""
    link = adapter.stage.link
    rows = micro_groups(group.size, link.stages)
    budget = group.max_new_tokens
    ring = Ring(link.stages, len(rows), 2 * budget, check_every=every)
    caches = [adapter.new_branch_cache(state, len(r), budget) for r in rows]
    steps = TurnSteps(group, int(state.last_token), width=1) if link.is_last else None
    long = {"dtype": torch.long, "device": adapter.device}

    def next_inputs(j: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's tokens and counts for micro-group ``j``'s step ``t + 1``."""
        steps_left = ring.max_steps - (t + 2)  # after step t + 1
        for row in rows[j]:
            while row in steps.waiting and budget - steps.fed[row] > steps_left:
                steps.take_answers(wait=True)  # it would run out of ring steps: wait now
        steps.take_answers(wait=False)
        inputs = [steps.inputs(row) for row in rows[j]]
        tokens = [ids[0] if ids else group.pad_id for ids in inputs]
        return torch.tensor(tokens, **long), torch.tensor([len(ids) for ids in inputs], **long)

    def compute(step: Compute, received: dict[Key, Payload]) -> Payload | None:
        j, t = step.microbatch
        if link.is_first:
            if t == 0:
                ids, counts = (
                    state.last_token.expand(len(rows[j])),
                    torch.ones(len(rows[j]), **long),
                )
            else:
                ids, counts = received[("T", j, t - 1)]
            read = counts.tolist()
            output = adapter.ring_decode(state, caches[j], ids[:, None], None, counts=read, step=t)
        else:
            *hidden, counts = received[("H", j, t)]
            read = counts.tolist()
            output = adapter.ring_decode(state, caches[j], None, tuple(hidden), counts=read, step=t)
        if j == len(rows) - 1:
            bar.update(1)
        if not link.is_last:
            return (*output, counts)
        steps.after_step(list(rows[j]), read, output, t)
        return next_inputs(j, t)

    def spec(message: Message) -> MessageSpec:
        kind, j, t = message.key
        count = ((len(rows[j]),), torch.long)
        if kind == "T":
            return (count, count)
        return (*adapter.decode_spec(state, len(rows[j]), t), count)

    def collective(name: Key) -> None:
        _, t = name
        flags = torch.zeros(2, **long)
        if link.is_last:
            flags[0] = int(steps.going)
            flags[1] = group.nonfinite
        going, nonfinite = link.signal_any(flags, every_replica=adapter.parallel is not None)
        if going == 0 or nonfinite:  # non-finite: raised once the group is shared
            ring.stop_at(t)

    run_program(link, ring_steps(ring, link.stage), compute, spec, collective)
    if link.is_last:
        steps.finish()
    return ring.planned_steps, sum(cache.nbytes() for cache in caches)
