"""The adapter's passes on a pipeline stage: its own layers and prefix state, its neighbours.

``longstraw_core.pipeline.stage_model`` puts a ``Stage`` on ``ModelAdapter.stage``; the public
passes (``prefill``, ``score``, ``backprop_prompt``), rollout's decode steps and
``grpo_step``'s replay then run here. Each stage runs ``run_owned_layers`` over the layers it
owns, reading and writing only its own records; only hidden states (and GLM-5.x's DSA
selection, which a layer hands to the next) cross a stage boundary, forward, and their
gradients, back (``docs/design.md``, "One prompt across GPUs").

Every pass is a schedule (``longstraw_core.pipeline.schedule``) run as this stage's program
(``run_program``): the order of every compute and transfer is fixed in advance, the same on
every stage, NCCL-correct, and each message's shape comes from the pass's plan
(``boundary_spec``), so no header is sent and nothing is read back per message.

- **prefill**: the prompt's chunks flow through the stages without autograd; stage ``s``
  works on chunk ``k`` while stage ``s - 1`` works on chunk ``k + 1``.
- **score** (no grad; the reference policy): one pass through the stages; the last stage
  computes the log-probabilities and every stage receives them.
- **decode** (rollout, ``ring_decode``): one micro-group's decode step on this stage; the
  ring schedule (``longstraw_core.rollout``) keeps every stage on a different micro-group.
- **replay** (``replay_branches``): each branch is cut into pieces that carry the branch's
  own state from piece to piece (``PieceCache``); forwards run in order, a branch's
  backwards last piece first, each seeded by the gradient later pieces left on what it
  wrote; the loss of a branch is taken on the last stage once all its pieces have their
  log-probabilities. Many small pieces keep every stage busy (``replay_orders``).
- **exact sweep**: the prompt's chunks, last to first, are the microbatches of the same
  schedule with one piece each (1F1B); each stage seeds its backward with the ``dS`` of
  what the chunk wrote into its own records, plus the gradient of its output.

Every stage must make the same calls in the same order (they pair up like collectives).

With FSDP2 across the replicas (``distributed.fsdp=true``; ``shard_model`` over the mesh's
``replica`` dimension) a stage's layers are sharded over the ranks that hold that stage in
every replica, and every microbatch's work runs as the root's FSDP forward
(``_call_model``). Those ranks' collectives pair up only if they run the same schedule, so
the number of microbatches of each pass is agreed over the replicas first (``in_step``): a
replica with fewer chunks or branches runs idle ones in their place (a no-grad pass that only
gathers; a one-token branch of weight zero; a recompute with zero gradients), and replay cuts
every branch into the same number of pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from longstraw_core.adapters.lm_head import chunked_head_log_probs
from longstraw_core.adapters.span import Span
from longstraw_core.exact import StateGrad, exact_state
from longstraw_core.kinds.base import Produced
from longstraw_core.pipeline.runner import run_program
from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Compute,
    Key,
    Message,
    forward_orders,
    replay_orders,
    split_pieces,
    stage_program,
)
from longstraw_core.pipeline.transport import MessageSpec, Payload, TensorSpec
from longstraw_core.state import PieceCache

if TYPE_CHECKING:
    from longstraw_core.pipeline.stage import Stage
    from longstraw_core.state import BranchCache, PrefixState

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


class StagedPasses:
    """``ModelAdapter``'s passes on a pipeline stage (a base of ``ModelAdapter``)."""

    # Set by ``longstraw_core.pipeline.stage_model``. None: every layer on this rank.
    stage: Stage | None = None

    # --- what crosses a stage boundary --------------------------------------------------

    def boundary_spec(self, batch: int, span: Span) -> MessageSpec:
        """What a stage sends the next for ``batch`` rows over ``span``: the hidden states
        ``[batch, span.length, hidden]`` and what the last layer carries on
        (``carried_spec``)."""
        hidden = ((batch, span.length, self.config.hidden_size), self.dtype)
        return (hidden, self.carried_spec(batch, span))

    def carried_spec(self, batch: int, span: Span) -> TensorSpec | None:
        """The shape of what a layer hands the next besides its output (``layer_result``)
        over ``span``; ``None``: nothing (GLM-5.x: its DSA selection)."""
        return None

    def gradient_spec(self, batch: int, span: Span) -> MessageSpec:
        """What a stage sends back in a backward: the gradient of the hidden states."""
        return (self.boundary_spec(batch, span)[0],)

    def _stage_input(
        self, ids: torch.Tensor, received: Payload | None, grad: bool = False
    ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """The first owned layer's input: the embeddings of ``ids`` on the first stage, the
        previous stage's output elsewhere (a leaf that collects its gradient when ``grad``).
        Returns ``(hidden, carried, leaf)``."""
        if received is None:
            return self.embed_tokens(ids), None, None
        hidden, carried = received
        if grad and hidden.is_floating_point():
            hidden.requires_grad_(True)
            return hidden, carried, hidden
        return hidden, carried, None

    @staticmethod
    def _input_gradient(leaf: torch.Tensor | None) -> Payload | None:
        """The gradient to send back for a stage input (zeros when nothing depended on it)."""
        if leaf is None:
            return None
        return (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf),)

    def _run(
        self,
        orders: list[list[Compute]],
        compute: Callable[[Compute, dict[Key, Payload]], Payload | None],
        spec: Callable[[Message], MessageSpec],
        max_open_sends: int | None = None,
    ) -> None:
        """Run this stage's program of ``orders``."""
        program = stage_program(orders, self.stage.index, max_open_sends=max_open_sends)
        run_program(self.stage.link, program, compute, spec)

    # --- prefill, score, decode ---------------------------------------------------------

    def _staged_prefill(
        self,
        stored: torch.Tensor,
        chunk_size: int,
        state: PrefixState,
        on_chunk: Callable[[int], None],
    ) -> None:
        """Prefill ``stored`` into this stage's records, chunks pipelined through stages."""

        # Replicas sharded together run as many chunks each; the extra ones are idle passes
        # after this replica's own, on each stage alone (no-grad passes gather in the same
        # order either way), inside the program: a peer may still need this rank's gathers
        # to reach the receive of a send this rank has in flight.
        starts = list(range(0, len(stored), chunk_size))
        items = list(self.in_step(starts))

        def span_of(k: int) -> Span:
            return Span(
                start=starts[k], length=min(chunk_size, len(stored) - starts[k]), write=True
            )

        def compute(step: Compute, received: dict[Key, Payload]) -> Payload | None:
            k = step.microbatch
            if items[k] is None:
                self.idle_forward()
                return None
            span = span_of(k)
            chunk = stored[span.start : span.start + span.length]

            def work() -> tuple[torch.Tensor, Any]:
                hidden, carried, _ = self._stage_input(chunk[None], received.get(("F", k)))
                return self.run_owned_layers(hidden, span, state, carried=carried)

            hidden, carried = self._call_model(work)
            state.length = span.start + span.length
            on_chunk(span.length)
            return (hidden, carried)

        orders = forward_orders(self.stage.link.stages, len(items), lambda k: k < len(starts))
        with torch.no_grad():
            self._run(
                orders, compute, lambda m: self.boundary_spec(1, span_of(m.key[1])), MAX_OPEN_SENDS
            )

    def _staged_score(
        self,
        state: PrefixState,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        span: Span,
        return_entropy: bool,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad scoring through the stages; every stage gets the last one's result (the
        head, at ``temperature``, runs on the last)."""

        if torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters()):
            raise RuntimeError(
                "on pipeline stages score() runs without autograd (a branch's backward spans "
                "the stages): call it under torch.no_grad(), or train with grpo_step, whose "
                "replay runs the stages' pipeline schedule"
            )
        result: list[Any] = [None]
        scored = torch.promote_types(self.dtype, torch.float32)  # the head's (lm_head.py)

        def compute(step: Compute, received: dict[Key, Payload]) -> Payload:
            def work() -> tuple[torch.Tensor, Any]:
                hidden, carried, _ = self._stage_input(inputs[None], received.get(("F", 0)))
                hidden, carried = self.run_owned_layers(hidden, span, state, carried=carried)
                if self.stage.is_last:
                    head = chunked_head_log_probs(self.lm_head, self.decoder.norm(hidden[0]), targets,
                                           return_entropy, temperature)  # fmt: skip
                    result[0] = torch.stack([t for t in head if t is not None]).to(scored)
                return hidden, carried

            return self._call_model(work)

        with torch.no_grad():
            self._run(
                forward_orders(self.stage.link.stages, 1),
                compute,
                lambda _: self.boundary_spec(1, span),
            )
        # One tensor broadcast of a shape every stage knows: the log-probs (and entropies).
        like = torch.empty(1 + return_entropy, len(targets), dtype=scored, device=self.device)
        rows = self.stage.link.from_last(result[0], like=like)
        return rows[0], rows[1] if return_entropy else None

    def ring_decode(
        self,
        state: PrefixState,
        branch: BranchCache,
        ids: torch.Tensor | None,
        received: Payload | None,
        counts: Sequence[int] | None = None,
        step: int | None = None,
    ) -> Payload | torch.Tensor:
        """One decode step of ``branch``'s rows on this stage (rollout's ring): from ``ids``
        ``[B, 1]`` on the first stage, else from the previous stage's ``received`` output.
        Returns the message for the next stage, or the logits ``[B, 1, vocab]`` on the last.
        ``counts`` (agents): a ragged step at ring step ``step``, each row taking its one
        input (``1``) or sitting the step out (``0``); the span starts where ``decode_spec``
        says step ``step`` does, past every row's position."""
        rows = None
        if counts is not None:
            rows = branch.ragged_rows(counts, 1, self.device)
            if step is None or step < rows.most:
                raise ValueError(f"ring step {step} is behind a row at {rows.most}")
            span = Span(start=state.length + step, length=1, write=False, rows=rows)
        else:
            span = Span(start=state.length + branch.length, length=1, write=False)

        def work() -> Any:
            hidden, carried, _ = self._stage_input(ids, received)
            hidden, carried = self.run_owned_layers(hidden, span, state, branch, carried)
            if self.stage.is_last:
                return self.lm_head(self.decoder.norm(hidden))
            return hidden, carried

        output = self._call_model(work)
        if counts is not None:
            branch.advance(counts)
        else:
            branch.length += 1
        return output

    def decode_spec(self, state: PrefixState, rows: int, step: int) -> MessageSpec:
        """What ``ring_decode`` sends the next stage at decode step ``step`` of ``rows`` rows."""

        return self.boundary_spec(rows, Span(start=state.length + step, length=1, write=False))

    # --- the passes with autograd ----------------------------------------------------------

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
