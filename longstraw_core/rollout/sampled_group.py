"""``SampledGroup``: the group a rollout samples, and the draws it samples with.

Kept by the process that samples (on pipeline stages, the last stage): every branch's tokens,
behaviour log-probs, which tokens are the policy's, and whether it ended. ``rollout``'s
module docstring says how a token is drawn; ``NoiseBlocks`` makes the draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StopStringCriteria

from longstraw_core.process.guard import NonFiniteError
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors.fake import is_fake


class TurnHandler(Protocol):
    """What the rollout asks of an agent's environment when branches end a turn.

    The rollout hands over each branch whose turn ended (``begin_turns``) and goes on
    decoding the others; it takes the answers when they are ready (``ended_turns``), so a
    branch whose tools run holds up no other (``ToolTurns`` runs each in a thread).
    """

    def begin_turns(self, turns: Mapping[int, list[int]]) -> None:
        """``turns``: branch index -> its response tokens so far, for branches whose turn
        just ended. Start their environment's work (it may run in the background)."""
        ...

    def ended_turns(self, wait: bool) -> Mapping[int, Sequence[int]]:
        """The answers ready so far, each once: branch -> the tokens to append (the
        environment's turn and the model's next turn header); empty: the branch ends.
        ``wait``: block until at least one begun turn has its answer."""
        ...


class NoiseBlocks:
    """The ``Exp(1)`` draws sampling divides by: block ``k`` is the ``[G, vocab]`` draw that
    ``generate`` makes at decode step ``k`` (``torch.multinomial``'s fast path), and a branch
    samples its response position ``k`` with its row of block ``k``.

    Blocks come from one generator in the order of ``k``, whatever order they are asked
    for in: a branch that fell behind (its tool ran while the others decoded) gets its
    block again from the generator's state before it. So a seed gives the same draws to each
    branch at each position, in lock step or not, on one process or on pipeline stages.
    """

    def __init__(
        self, generator: torch.Generator, size: int, dtype: torch.dtype, keep_states: bool
    ) -> None:
        self.generator, self.size, self.dtype = generator, size, dtype
        # Lock step never asks for a block again: only ragged sampling keeps the states.
        self.keep_states = keep_states
        self.states: dict[int, torch.Tensor] = {}  # generator state before block k
        self.drawn = 0  # blocks drawn from the generator's head
        self.cached: tuple[int, torch.Tensor] | None = None

    def block(self, k: int, vocab: int) -> torch.Tensor:
        if self.cached is not None and self.cached[0] == k:
            return self.cached[1]
        empty = torch.empty(self.size, vocab, dtype=self.dtype, device=self.generator.device)
        if is_fake(empty):  # a dry run's fake tensors: no values (nor a generator) to draw
            return empty
        if k < self.drawn:
            head = self.generator.get_state()
            self.generator.set_state(self.states[k])
            noise = empty.exponential_(1, generator=self.generator)
            self.generator.set_state(head)
        else:
            while True:
                if self.keep_states:
                    self.states[self.drawn] = self.generator.get_state()
                noise = empty.exponential_(1, generator=self.generator)
                self.drawn += 1
                if self.drawn > k:
                    break
        self.cached = (k, noise)
        return noise

    def forget_before(self, k: int) -> None:
        """No branch samples a position before ``k`` again."""
        for old in [key for key in self.states if key < k]:
            del self.states[old]


class SampledGroup:
    """The group being sampled: every branch's tokens, behaviour log-probs, which tokens are
    the policy's, and whether it ended (on pipeline stages: kept by the last stage).

    Lock step (``sample``, without agents): every branch samples decode step ``t`` at
    response position ``t``; finished branches are fed the pad id. Ragged (``sample_rows``,
    agents: ``rollout_turns``): each branch samples at its own position, and what its
    environment appends is recorded at once (``append_fed``).
    """

    def __init__(
        self,
        state: PrefixState,
        size: int,
        max_new_tokens: int,
        temperature: float,
        processors: list[LogitsProcessor],
        stop: StopStringCriteria | None,
        eos: torch.Tensor,
        generator: torch.Generator,
        logps_dtype: torch.dtype,
        needs_prompt_tokens: bool,
        turns: TurnHandler | None = None,
    ) -> None:
        device = eos.device
        self.size, self.temperature, self.processors = size, temperature, processors
        self.stop, self.eos = stop, eos
        self.max_new_tokens = max_new_tokens
        self.pad_id = int(eos[0]) if len(eos) else 0
        # What the processors see as the sequence: the prompt's distinct tokens (the
        # repetition penalty needs only which tokens occur), then each branch's tokens.
        seen = torch.unique(state.prompt_ids) if needs_prompt_tokens else state.prompt_ids[:0]
        self.seen = len(seen)
        # Past a ragged branch's end its row holds a token the prompt has: the penalty is
        # over the set of tokens, so the rows of branches of other lengths can be batched.
        filler = int(seen[0]) if turns is not None and self.seen else self.pad_id
        self.sequence = torch.cat(
            [
                seen.to(device).expand(size, -1),
                torch.full((size, max_new_tokens), filler, dtype=torch.long, device=device),
            ],
            dim=1,
        )
        self.tokens = self.sequence[:, self.seen :]  # a view: the responses
        self.logps = torch.zeros(size, max_new_tokens, dtype=logps_dtype, device=device)
        self.finished = torch.zeros(size, dtype=torch.bool, device=device)
        self.lengths = torch.full((size,), max_new_tokens, dtype=torch.long, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        # The first decode step whose logits were non-finite (-1: none), kept on the device:
        # the stop check reads it every ``stop_check_every`` steps, not every step.
        self.nonfinite_at = torch.full((), -1, dtype=torch.long, device=device)
        self.noise = (
            NoiseBlocks(generator, size, logps_dtype, keep_states=turns is not None)
            if temperature != 0
            else None
        )
        # Agents: who answers ended turns, and which tokens are the policy's own (the rest
        # were appended).
        self.turns = turns
        self.policy = torch.ones(size, max_new_tokens, dtype=torch.bool, device=device)
        # Ragged: each branch's tokens so far (host side).
        self.responses: list[list[int]] = [[] for _ in range(size)]

    # --- lock step ---------------------------------------------------------------------------

    def sample(self, rows: range, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Sample step ``step`` of branches ``rows`` from their logits ``[len(rows), vocab]``:
        record the tokens (the pad id for ended branches), their log-probs, and which branches
        end; return the tokens. Non-finite logits are noted (``nonfinite``), not sampled."""
        rows_ = slice(rows.start, rows.stop)
        tokens, log_probs = self._draw(
            self.sequence[rows_, : self.seen + step], logits, rows_, [step] * len(rows), step
        )
        finished = self.finished[rows_]
        tokens = tokens.masked_fill(finished, self.pad_id)
        self.tokens[rows_, step] = tokens
        chosen = log_probs.gather(-1, tokens[:, None])[:, 0]
        self.logps[rows_, step] = chosen.masked_fill(finished, 0.0)
        ended = torch.isin(tokens, self.eos)
        if self.stop is not None:
            ended |= self.stop(self.tokens[rows_, : step + 1], None)
        ended &= ~finished
        self.lengths[rows_] = torch.where(ended, step + 1, self.lengths[rows_])
        self.finished[rows_] = finished | ended
        return tokens

    # --- ragged (agents) ---------------------------------------------------------------------

    def sample_rows(self, rows: Sequence[int], logits: torch.Tensor, step: int) -> list[bool]:
        """Sample the next token of each branch in ``rows`` (at its own position) from its
        logits ``[len(rows), vocab]`` at decode step ``step``; record it, its log-prob and
        whether it ends the branch's turn (an EOS or a stop string), which is returned.
        Non-finite logits are noted (``nonfinite``), not sampled. The one host read of the
        step (tokens and ends together): the environment and the next step's inputs need
        them."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.tokens.device)
        positions = [len(self.responses[row]) for row in rows]
        width = self.seen + max(positions)
        tokens, log_probs = self._draw(self.sequence[index, :width], logits, index, positions, step)
        self.tokens[index, positions] = tokens
        self.logps[index, positions] = log_probs.gather(-1, tokens[:, None])[:, 0]
        ended = torch.isin(tokens, self.eos)
        if self.stop is not None:
            for i, (row, position) in enumerate(zip(rows, positions, strict=True)):
                ended[i] |= self.stop(self.tokens[row : row + 1, : position + 1], None)[0]
        read, ends = torch.stack([tokens, ended.long()]).tolist()
        for row, token in zip(rows, read, strict=True):
            self.responses[row].append(token)
        return [bool(end) for end in ends]

    def append_fed(self, row: int, tokens: Sequence[int]) -> int:
        """Record the tokens an environment appended to branch ``row`` (not the policy's),
        cut to its budget; returns how many were kept."""
        start = len(self.responses[row])
        kept = [int(token) for token in tokens][: self.max_new_tokens - start]
        if kept:
            end = start + len(kept)
            self.tokens[row, start:end] = torch.tensor(kept, device=self.tokens.device)
            self.policy[row, start:end] = False
            self.responses[row] += kept
        return len(kept)

    def score_fed(self, row: int, start: int, logits: torch.Tensor) -> None:
        """The policy's log-probs of branch ``row``'s appended tokens from response position
        ``start`` on, one per row of ``logits`` (those before each token), as a lock-step
        rollout records them; they never enter the loss."""
        end = start + logits.shape[0]
        scale = self.temperature if self.temperature != 0 else 1.0
        log_probs = torch.log_softmax(logits.to(self.logps.dtype) / scale, -1)
        fed = self.tokens[row, start:end]
        self.logps[row, start:end] = log_probs.gather(-1, fed[:, None])[:, 0]

    def end_rows(self, ended: Mapping[int, bool]) -> None:
        """Branches that are done: at their tokens so far, ``True`` when they ended (an EOS,
        a stop string, or an environment ending them), ``False`` when cut (truncated)."""
        for row, done in ended.items():
            self.lengths[row] = len(self.responses[row])
            self.finished[row] = done

    # --- shared ------------------------------------------------------------------------------

    def _draw(
        self,
        sequence: torch.Tensor,
        logits: torch.Tensor,
        rows: slice | torch.Tensor,
        positions: Sequence[int],
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens drawn for ``rows`` (at response ``positions``) and every token's
        log-prob; non-finite logits are noted (``nonfinite``, ``nonfinite_at``: the first
        such decode ``step``), without a host read, and draw token 0."""
        logits = logits.to(self.logps.dtype)
        finite = torch.isfinite(logits).all()
        self.nonfinite |= ~finite
        first = ~finite & (self.nonfinite_at < 0)
        self.nonfinite_at = torch.where(first, step, self.nonfinite_at)
        scores = logits
        for processor in self.processors:
            scores = processor(sequence, scores)
        if self.temperature == 0:
            tokens = scores.argmax(-1)
            log_probs = torch.log_softmax(logits, -1)
        else:
            log_probs = torch.log_softmax(logits / self.temperature, -1)
            tokens = (torch.softmax(scores, -1) / self._noise(rows, positions, logits)).argmax(-1)
        return tokens.masked_fill(~finite, 0), log_probs

    def _noise(
        self, rows: slice | torch.Tensor, positions: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        if isinstance(rows, slice):  # lock step: one position
            return self.noise.block(positions[0], vocab)[rows]
        noise = torch.empty_like(logits)
        for position in sorted(set(positions)):
            at = [i for i, p in enumerate(positions) if p == position]
            noise[at] = self.noise.block(position, vocab)[rows[at]]
        return noise

    def raise_if_nonfinite(self, step: int | str | None = None) -> None:
        """Raise for the non-finite logits noted: at ``step``, or (``None``) at the first
        step ``nonfinite_at`` recorded (a stop check may come steps after it)."""
        if step is None:
            step = int(self.nonfinite_at) if not is_fake(self.nonfinite_at) else "?"
        raise NonFiniteError(
            f"rollout: non-finite logits at decode step {step}: the weights or the prompt's "
            "state hold inf/NaN (diverged training?)"
        )
