"""The adapter's passes on a pipeline stage: its own layers and prefix state, its neighbours.

``longstraw_core.pipeline.stage_model`` puts a ``Stage`` on ``ModelAdapter.stage``; the public
passes (``prefill``, ``score``, ``decode``, ``backprop_prompt``) and ``grpo_step``'s replay then
run here. Each stage runs ``run_owned_layers`` over the layers it owns, reading and writing
only its own records; only hidden states (and GLM-5.x's DSA selection, which a layer hands
to the next) cross a stage boundary, forward, and their gradients, back
(``docs/design.md``, "One prompt across GPUs"):

- **prefill**: the prompt's chunks flow through the stages without autograd; stage ``s``
  works on chunk ``k`` while stage ``s - 1`` works on chunk ``k + 1``.
- **score** (no grad; the reference policy): one pass through the stages; the last stage
  computes the log-probabilities and every stage receives them.
- **decode** (rollout): the branches' step goes through the stages in turn; the last stage
  returns the logits (``None`` elsewhere) and ``longstraw_core.rollout`` samples there and
  sends the tokens to every stage.
- **replay** (``replay_branches``): the branches are microbatches of a 1F1B schedule
  (``longstraw_core.pipeline.schedule``); the loss and its backward start on the last stage.
- **exact sweep**: the prompt's chunks, last to first, are microbatches of the same
  schedule; each stage seeds its backward with the ``dS`` of what the chunk wrote into its
  own records, plus the gradient of its output from the next stage.

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

from longstraw_core.exact import Produced, StateGrad, exact_state
from longstraw_core.pipeline.schedule import forward_only, one_f_one_b
from longstraw_core.pipeline.transport import Message

if TYPE_CHECKING:
    from longstraw_core.pipeline.stage import Stage
    from longstraw_core.state import BranchCache, PrefixState
    from model_adapters.base import ModelAdapter, Span

# loss_of(branch index, log-probs, entropy) -> the loss to backpropagate (last stage only)
BranchLoss = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


class StagedPasses:
    """``ModelAdapter``'s passes on a pipeline stage (a base of ``ModelAdapter``)."""

    # Set by ``longstraw_core.pipeline.stage_model``. None: every layer on this rank.
    stage: Stage | None = None

    # --- what enters and leaves a stage -------------------------------------------------

    def _stage_input(
        self: ModelAdapter, ids: torch.Tensor, received: Message | None, grad: bool = False
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
    def _input_gradient(leaf: torch.Tensor | None) -> Message | None:
        """The gradient to send back for a stage input (zeros when nothing depended on it)."""
        if leaf is None:
            return None
        return (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf),)

    # --- prefill, score, decode ---------------------------------------------------------

    def _staged_prefill(
        self: ModelAdapter,
        stored: torch.Tensor,
        chunk_size: int,
        state: PrefixState,
        on_chunk: Callable[[int], None],
    ) -> None:
        """Prefill ``stored`` into this stage's records, chunks pipelined through stages."""
        from model_adapters.base import Span

        # Replicas sharded together run as many chunks each; the extra ones are idle passes
        # after this replica's own, on each stage alone (no-grad passes gather in the same
        # order either way).
        starts = list(range(0, len(stored), chunk_size))
        items = list(self.in_step(starts))

        def forward(k: int, received: Message | None) -> tuple[Message | None, None]:
            if items[k] is None:
                self.idle_forward()
                return None, None
            chunk = stored[starts[k] : starts[k] + chunk_size]
            span = Span(start=starts[k], length=len(chunk), write=True)

            def work() -> tuple[torch.Tensor, Any]:
                hidden, carried, _ = self._stage_input(chunk[None], received)
                return self.run_owned_layers(hidden, span, state, carried=carried)

            hidden, carried = self._call_model(work)
            state.length = span.start + span.length
            on_chunk(len(chunk))
            return (hidden, carried), None

        with torch.no_grad():
            forward_only(self.stage.link, len(items), forward, exchanged=len(starts))

    def _staged_score(
        self: ModelAdapter,
        state: PrefixState,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        span: Span,
        return_entropy: bool,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad scoring through the stages; every stage gets the last one's result (the
        head, at ``temperature``, runs on the last)."""
        from model_adapters.base import _head_log_probs

        if torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters()):
            raise RuntimeError(
                "on pipeline stages score() runs without autograd (a branch's backward spans "
                "the stages): call it under torch.no_grad(), or train with grpo_step, whose "
                "replay runs the stages' pipeline schedule"
            )
        result: list[Any] = [None]

        def work(received: Message | None) -> tuple[torch.Tensor, Any]:
            hidden, carried, _ = self._stage_input(inputs[None], received)
            hidden, carried = self.run_owned_layers(hidden, span, state, carried=carried)
            if self.stage.is_last:
                head = _head_log_probs(self.lm_head, self.decoder.norm(hidden[0]), targets,
                                       return_entropy, temperature)  # fmt: skip
                result[0] = tuple(None if t is None else t.cpu() for t in head)
            return hidden, carried

        def forward(_: int, received: Message | None) -> tuple[Message, None]:
            return self._call_model(lambda: work(received)), None

        with torch.no_grad():
            forward_only(self.stage.link, 1, forward)
        logps, entropy = self.stage.link.objects_from_last(result[0])
        return logps.to(self.device), None if entropy is None else entropy.to(self.device)

    def _staged_decode(
        self: ModelAdapter, state: PrefixState, branch: BranchCache, ids: torch.Tensor, span: Span
    ) -> torch.Tensor | None:
        """One decoding step through the stages: the logits on the last stage, else None."""
        logits: list[torch.Tensor | None] = [None]

        def work(received: Message | None) -> tuple[torch.Tensor, Any]:
            hidden, carried, _ = self._stage_input(ids, received)
            hidden, carried = self.run_owned_layers(hidden, span, state, branch, carried)
            if self.stage.is_last:
                logits[0] = self.lm_head(self.decoder.norm(hidden))
            return hidden, carried

        def forward(_: int, received: Message | None) -> tuple[Message, None]:
            return self._call_model(lambda: work(received)), None

        forward_only(self.stage.link, 1, forward)
        return logits[0]

    # --- the passes with autograd: 1F1B ---------------------------------------------------

    def replay_branches(
        self: ModelAdapter,
        state: PrefixState,
        responses: Sequence[torch.Tensor | None],
        loss_of: BranchLoss,
        state_grad: StateGrad | None = None,
        temperature: float = 1.0,
    ) -> None:
        """Replay ``responses`` with autograd through the stages (1F1B, one microbatch per
        branch) and backpropagate ``loss_of(index, logps, entropy)`` of each, computed on the
        last stage from its log-probs at ``temperature`` (``ModelAdapter.score``'s). Parameter gradients accumulate in ``.grad`` (and, exact mode, this
        stage's ``dS`` in ``state_grad``). A ``None`` response is an idle branch (what
        ``in_step`` pads with): one token, weight zero, ``loss_of`` not called."""
        from model_adapters.base import Span, _head_log_probs

        reads = state if state_grad is None else exact_state(state, state_grad, produced=None)

        def work(m: int, received: Message | None) -> tuple[Any, Any, torch.Tensor | None]:
            response = state.last_token if responses[m] is None else responses[m]
            inputs = torch.cat([state.last_token, response[:-1]])
            span = Span(start=state.length, length=len(inputs), write=False)
            hidden, carried, leaf = self._stage_input(inputs[None], received, grad=True)
            with self._checkpointed_pass():
                hidden, carried = self.run_owned_layers(hidden, span, reads, carried=carried)
                if not self.stage.is_last:
                    return hidden, carried, leaf
                logps, entropy = _head_log_probs(
                    self.lm_head, self.decoder.norm(hidden[0]), response, True, temperature
                )
            if responses[m] is None:
                return logps.sum() * 0.0, None, leaf
            return loss_of(m, logps, entropy), None, leaf

        def forward(m: int, received: Message | None) -> tuple[Message | None, Any]:
            # The leaf is kept out of the FSDP forward's outputs: FSDP hooks what it returns.
            leaf: list[torch.Tensor | None] = [None]

            def pass_() -> tuple[Any, Any]:
                output, carried, leaf[0] = work(m, received)
                return output, carried

            output, carried = self._call_model(pass_)
            if self.stage.is_last:
                return None, (leaf[0], output)
            return (output, carried), (leaf[0], output)

        def backward(m: int, context: Any, gradient: Message | None) -> Message | None:
            leaf, output = context
            if gradient is None:
                output.backward()  # the branch's loss, on the last stage
            elif output.requires_grad:
                torch.autograd.backward(output, gradient[0])
            return self._input_gradient(leaf)

        with torch.enable_grad():
            one_f_one_b(self.stage.link, len(responses), forward, backward)

    def _staged_sweep(
        self: ModelAdapter,
        state: PrefixState,
        state_grad: StateGrad,
        starts: list[int],
        chunk_size: int,
        on_chunk: Callable[[int], None],
    ) -> None:
        """Exact mode's reverse sweep through the stages (1F1B over the chunks, last first).
        Replicas sharded together sweep as many chunks each: the extra ones recompute the
        first chunk with zero gradients (as the unstaged sweep does)."""
        from model_adapters.base import Span

        items = list(self.in_step(starts))
        if len(items) > len(starts) and not starts:
            raise RuntimeError(
                "a one-token prompt has no chunk to recompute while another replica sweeps; "
                "give every replica prompts of at least two tokens"
            )

        def forward(m: int, received: Message | None) -> tuple[Message, Any]:
            idle = items[m] is None
            start = starts[-1] if idle else items[m]
            chunk = state.prompt_ids[start : min(start + chunk_size, state.length)]
            span = Span(start=start, length=len(chunk), write=True)
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
            return (hidden, carried), (leaf[0], hidden, produced, 0 if idle else len(chunk))

        def backward(m: int, context: Any, gradient: Message | None) -> Message | None:
            leaf, output, produced, length = context
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
            on_chunk(length)
            return self._input_gradient(leaf)

        with torch.enable_grad():
            one_f_one_b(self.stage.link, len(items), forward, backward)
