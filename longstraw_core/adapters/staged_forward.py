"""The adapter's passes without autograd on a pipeline stage, and what both kinds share:
what crosses a stage boundary, and running this stage's program.

``longstraw_core.adapters.stage_cut.stage_model`` puts a ``Stage`` on ``ModelAdapter.stage``; the public
passes (``prefill``, ``score``, ``backprop_prompt``), rollout's decode steps and
``grpo_step``'s replay then run on the stage (the passes with autograd, replay and the exact
sweep, are ``longstraw_core.adapters.staged_backward``'s). Each stage runs
``run_owned_layers`` over the layers it owns, reading and writing only its own records; only
hidden states (and GLM-5.x's DSA selection, which a layer hands to the next) cross a stage
boundary, forward, and their gradients, back (``docs/design.md``, "One prompt across GPUs").

Every pass is a schedule (``longstraw_core.pipeline.schedule``) run as this stage's program
(``run_program``): the order of every compute and transfer is fixed in advance, the same on
every stage, NCCL-correct, and each message's shape comes from the pass's plan
(``boundary_spec``), so no header is sent and nothing is read back per message.

- **prefill**: the prompt's chunks flow through the stages without autograd; stage ``s``
  works on chunk ``k`` while stage ``s - 1`` works on chunk ``k + 1``.
- **score** (no grad; the reference policy): one pass through the stages; the last stage
  computes the log-probabilities and every stage receives them.
- **decode** (rollout, ``ring_decode``): one micro-group's decode step on this stage; the
  ring schedule (``longstraw_core.rollout.decode``) keeps every stage on a different micro-group.

Every stage must make the same calls in the same order (they pair up like collectives).

With FSDP2 across the replicas (``distributed.fsdp=true``; ``shard_model`` over the mesh's
``replica`` dimension) a stage's layers are sharded over the ranks that hold that stage in
every replica, and every microbatch's work runs as the root's FSDP forward
(``_call_model``). Those ranks' collectives pair up only if they run the same schedule, so
the number of microbatches of each pass is agreed over the replicas first (``in_step``): a
replica with fewer chunks or branches runs idle ones in their place (a no-grad pass that only
gathers; a one-token branch of weight zero; a recompute with zero gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from longstraw_core.adapters.lm_head import chunked_head_log_probs
from longstraw_core.adapters.span import Span
from longstraw_core.pipeline.runner import run_program
from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Compute,
    Key,
    Message,
    forward_orders,
    stage_program,
)
from longstraw_core.pipeline.transport import MessageSpec, Payload, TensorSpec

if TYPE_CHECKING:
    from longstraw_core.pipeline.stage import Stage
    from longstraw_core.state.prefix import BranchCache, PrefixState


class StagedForwardPasses:
    """``ModelAdapter``'s passes without autograd on a pipeline stage (a base of
    ``ModelAdapter``), and the boundary specs and program runner the passes with autograd
    (``StagedBackwardPasses``) share."""

    # Set by ``longstraw_core.adapters.stage_cut.stage_model``. None: every layer on this rank.
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
