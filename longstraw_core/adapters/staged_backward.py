"""The adapter's passes with autograd on a pipeline stage: ``grpo_step``'s replay and exact
mode's sweep, each a forward-and-backward schedule through the stages.

They build on ``StagedForwardPasses`` (``longstraw_core.adapters.staged_forward``: what
crosses a stage boundary, running this stage's program, the module's notes on schedules and
FSDP); ``ModelAdapter`` combines the two.

- **replay** (``replay_branches``): each branch is cut into pieces that carry the branch's
  own state from piece to piece (``PieceCache``); forwards run in order, a branch's
  backwards last piece first, each seeded by the gradient later pieces left on what it
  wrote; the loss of a branch is taken on the last stage once all its pieces have their
  log-probabilities. Many small pieces keep every stage busy (``replay_orders``). Replicas
  sharded together cut every branch into the same number of pieces.
- **exact sweep**: the prompt's chunks, last to first, are the microbatches of the same
  schedule with one piece each (1F1B); each stage seeds its backward with the ``dS`` of
  what the chunk wrote into its own records, plus the gradient of its output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from longstraw_core.adapters.lm_head import chunked_head_log_probs
from longstraw_core.adapters.span import Span
from longstraw_core.kinds.base import Produced
from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Compute,
    Key,
    Message,
    replay_orders,
    split_pieces,
)
from longstraw_core.pipeline.transport import MessageSpec, Payload
from longstraw_core.state.exact import StateGrad, exact_state
from longstraw_core.state.prefix import PieceCache

if TYPE_CHECKING:
    from longstraw_core.state.prefix import PrefixState

# loss_of(branch index, log-probs, entropy) -> the loss to backpropagate (last stage only)
BranchLoss = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class _Piece:
    """One microbatch of a staged replay: ``length`` inputs of branch ``branch`` from
    ``start`` (0 for an idle piece: one token read from the prefix, weight zero)."""

    branch: int
    index: int
    start: int
    length: int
    idle: bool


@dataclass
class _BranchRun:
    """What a stage keeps of one branch while its pieces are in flight."""

    cache: PieceCache | None
    logps: list[torch.Tensor] = field(default_factory=list)
    entropy: list[torch.Tensor] = field(default_factory=list)
    seeds: list[torch.Tensor] | None = None


class StagedBackwardPasses:
    """``ModelAdapter``'s passes with autograd on a pipeline stage (a base of ``ModelAdapter``,
    beside ``StagedForwardPasses``, whose ``_stage_input``, ``_input_gradient``, ``_run`` and
    boundary specs they use)."""

    def replay_branches(
        self,
        state: PrefixState,
        responses: Sequence[torch.Tensor | None],
        loss_of: BranchLoss,
        state_grad: StateGrad | None = None,
        temperature: float = 1.0,
        pieces: int = 1,
        on_branch: Callable[[int], object] | None = None,
    ) -> None:
        """Replay ``responses`` with autograd through the stages, each cut into ``pieces``
        pieces (see the module docstring), and backpropagate ``loss_of(index, logps,
        entropy)`` of each, computed on the last stage from its log-probs at
        ``temperature`` (``ModelAdapter.score``'s). Parameter gradients accumulate in
        ``.grad`` (and, exact mode, this stage's ``dS`` in ``state_grad``). A ``None``
        response is an idle branch (what ``in_step`` pads with): one-token pieces of weight
        zero, ``loss_of`` not called. A response shorter than ``pieces`` has one-token
        pieces and idle ones after them. ``on_branch(1)``: a response's last backward on this
        stage is done (a progress count; idle branches are not counted)."""

        if pieces < 1:
            raise ValueError(f"pieces must be at least 1, got {pieces}")
        reads = state if state_grad is None else exact_state(state, state_grad, produced=None)
        plan: list[_Piece] = []
        inputs: list[torch.Tensor] = []
        for b, response in enumerate(responses):
            length = 0 if response is None else len(response)
            if response is not None:
                inputs.append(torch.cat([state.last_token, response[:-1]]))
            else:
                inputs.append(state.last_token)
            for p, (start, size) in enumerate(split_pieces(length, pieces)):
                plan.append(_Piece(b, p, start, max(size, 1), size == 0))
        branches: dict[int, _BranchRun] = {}

        def span_of(piece: _Piece) -> Span:
            start = state.length + (0 if piece.idle else piece.start)
            return Span(start=start, length=piece.length, write=False)

        def piece_ids(piece: _Piece) -> torch.Tensor:
            if piece.idle:
                return state.last_token[None]
            return inputs[piece.branch][piece.start : piece.start + piece.length][None]

        def forward(m: int, received: Payload | None) -> tuple[Payload | None, Any]:
            piece = plan[m]
            run = branches.setdefault(
                piece.branch,
                _BranchRun(
                    None if responses[piece.branch] is None else self.new_piece_cache(reads)
                ),
            )
            produced: Produced = []
            records = None if piece.idle else run.cache.piece(produced)
            span = span_of(piece)
            leaf: list[torch.Tensor | None] = [None]

            def work() -> tuple[Any, Any]:
                hidden, carried, leaf[0] = self._stage_input(piece_ids(piece), received, grad=True)
                with self._checkpointed_pass():
                    hidden, carried = self.run_owned_layers(hidden, span, reads, records, carried)
                    if not self.stage.is_last:
                        return hidden, carried
                    targets = _piece_targets(responses, state, piece)
                    return chunked_head_log_probs(
                        self.lm_head, self.decoder.norm(hidden[0]), targets, True, temperature
                    )

            self._produced = produced  # what call_layer hands to a sharded layer
            try:
                result = self._call_model(work)
            finally:
                self._produced = None
            if not self.stage.is_last:
                hidden, carried = result
                return (hidden, carried), (leaf[0], hidden, produced)
            logps, entropy = result
            if not piece.idle:
                run.logps.append(logps)
                run.entropy.append(entropy)
            if piece.index == pieces - 1 and responses[piece.branch] is not None:
                run.seeds = _branch_seeds(loss_of, piece.branch, run)
            return None, (leaf[0], logps, produced)

        def backward(m: int, context: Any, gradient: Payload | None) -> Payload | None:
            # output: the piece's hidden states (its log-probs on the last stage)
            leaf, output, produced = context
            piece = plan[m]
            if gradient is not None:
                seed = gradient[0]
            elif piece.idle:
                seed = torch.zeros_like(output)
            else:
                seed = branches[piece.branch].seeds[piece.index]
            pairs = [(output, seed)] if output.requires_grad else []
            pairs += [(out, s.resolve()) for out, s in produced if out.requires_grad and s.used]
            if pairs:
                outputs, grads = zip(*pairs, strict=True)
                torch.autograd.backward(outputs, grads)
            if piece.index == 0:
                branches.pop(piece.branch, None)  # its last backward on this stage
                if on_branch is not None and responses[piece.branch] is not None:
                    on_branch(1)
            return self._input_gradient(leaf)

        counts = [pieces] * len(responses)
        with torch.enable_grad():
            self._run_with_autograd(
                replay_orders(self.stage.link.stages, counts),
                forward,
                backward,
                lambda m: span_of(plan[m]),
            )

    def _staged_sweep(
        self,
        state: PrefixState,
        state_grad: StateGrad,
        starts: list[int],
        chunk_size: int,
        on_chunk: Callable[[int], None],
    ) -> None:
        """Exact mode's reverse sweep through the stages (1F1B over the chunks, last first).
        Replicas sharded together sweep as many chunks each: the extra ones recompute the
        first chunk with zero gradients (as the unstaged sweep does)."""

        items = list(self.in_step(starts))
        if len(items) > len(starts) and not starts:
            raise RuntimeError(
                "a one-token prompt has no chunk to recompute while another replica sweeps; "
                "give every replica prompts of at least two tokens"
            )

        def span_of(m: int) -> Span:
            start = starts[-1] if items[m] is None else items[m]
            return Span(
                start=start, length=min(start + chunk_size, state.length) - start, write=True
            )

        def forward(m: int, received: Payload | None) -> tuple[Payload, Any]:
            span = span_of(m)
            chunk = state.prompt_ids[span.start : span.start + span.length]
            produced: Produced = []
            reads = exact_state(state, state_grad, produced)
            leaf: list[torch.Tensor | None] = [None]

            def pass_() -> tuple[torch.Tensor, Any]:
                hidden, carried, leaf[0] = self._stage_input(chunk[None], received, grad=True)
                with self._checkpointed_pass():
                    return self.run_owned_layers(hidden, span, reads, carried=carried)

            self._produced = produced  # what call_layer hands to a sharded layer
            try:
                hidden, carried = self._call_model(pass_)
            finally:
                self._produced = None
            return (hidden, carried), (leaf[0], hidden, produced)

        def backward(m: int, context: Any, gradient: Payload | None) -> Payload | None:
            leaf, output, produced = context
            idle = items[m] is None
            pairs = [
                (out, torch.zeros_like(out) if idle else seed.resolve())
                for out, seed in produced
                if out.requires_grad
            ]
            if gradient is not None and output is not None and output.requires_grad:
                pairs.append((output, gradient[0]))
            if pairs:
                outputs, grads = zip(*pairs, strict=True)
                torch.autograd.backward(outputs, grads)
            on_chunk(0 if idle else span_of(m).length)
            return self._input_gradient(leaf)

        with torch.enable_grad():
            self._run_with_autograd(
                replay_orders(self.stage.link.stages, [1] * len(items)),
                forward,
                backward,
                span_of,
            )

    def _run_with_autograd(
        self,
        orders: list[list[Compute]],
        forward: Callable[[int, Payload | None], tuple[Payload | None, Any]],
        backward: Callable[[int, Any, Payload | None], Payload | None],
        span_of: Callable[[int], Span],
    ) -> None:
        """Run a forward-and-backward schedule: ``forward(m, received)`` returns the message
        for the next stage and what ``backward(m, context, gradient)`` needs, which returns
        the gradient message for the previous stage."""
        contexts: dict[int, Any] = {}

        def compute(step: Compute, received: dict[Key, Payload]) -> Payload | None:
            m = step.microbatch
            if step.kind == "F":
                message, contexts[m] = forward(m, received.get(("F", m)))
                return message
            return backward(m, contexts.pop(m), received.get(("B", m)))

        def spec(message: Message) -> MessageSpec:
            kind, m = message.key
            span = span_of(m)
            return self.boundary_spec(1, span) if kind == "F" else self.gradient_spec(1, span)

        self._run(orders, compute, spec, MAX_OPEN_SENDS)

    def new_piece_cache(self, reads: PrefixState) -> PieceCache:
        """What a branch replayed in pieces keeps between its pieces, per owned layer."""
        return PieceCache([record.new_pieces(self.device) for record in reads.layers])


def _piece_targets(
    responses: Sequence[torch.Tensor | None], state: PrefixState, piece: _Piece
) -> torch.Tensor:
    """The tokens a piece's positions predict (the prompt's last token for an idle piece)."""
    response = responses[piece.branch]
    if piece.idle or response is None:
        return state.last_token
    return response[piece.start : piece.start + piece.length]


def _branch_seeds(loss_of: BranchLoss, index: int, run: _BranchRun) -> list[torch.Tensor]:
    """The gradient of branch ``index``'s loss with respect to each piece's log-probs: the
    loss may couple a branch's tokens (sequence-level terms), so it is taken once over all of
    them, on leaves, and each piece's backward is seeded with its share."""
    leaves = [logps.detach().requires_grad_(logps.requires_grad) for logps in run.logps]
    entropy = torch.cat(run.entropy) if run.entropy else None
    loss = loss_of(index, torch.cat(leaves), entropy)
    if loss.requires_grad:
        loss.backward()
    return [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves]
