"""The adapter's public passes: ``prefill`` a prompt once without autograd, ``score`` a
branch from its prefix state, exact mode's reverse sweep (``backprop_prompt``), and a decode
step of a batch of branches (``decode``, with ``new_branch_cache``).

``PublicPasses`` is a base of ``ModelAdapter`` (``longstraw_core.adapters.base``), which gives
the layer loop these passes run (``run_layers``) and the checks they call; each pass is read
here in its one-process and sharded forms, and hands over to its staged form
(``longstraw_core.adapters.staged_forward``, ``staged_backward``) on a pipeline stage.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from longstraw_core.adapters.lm_head import chunked_head_log_probs
from longstraw_core.adapters.span import Span
from longstraw_core.adapters.validation import (
    as_token_ids,
    check_decode_inputs,
    check_prefill_options,
    check_temperature,
)
from longstraw_core.kinds.base import Produced
from longstraw_core.offload import OffloadPolicy
from longstraw_core.process.progress import counter
from longstraw_core.state.exact import StateGrad, exact_state
from longstraw_core.state.prefix import BranchCache, PrefixState


def token_progress(total: int, desc: str, progress: bool | None) -> tqdm:
    """A count of prompt tokens done (``progress.counter``: a live bar on a terminal, plain
    lines in a run's log, nothing with ``progress=False``)."""
    return counter(total, desc, "tok", progress, unit_scale=True)


class PublicPasses:
    """``ModelAdapter``'s public passes (a base of ``ModelAdapter``; its methods use the
    adapter's ``run_layers``, ``embed_tokens``, ``decoder``, ``lm_head`` and checks)."""

    def new_branch_cache(self, state: PrefixState, batch: int, capacity: int) -> BranchCache:
        """Empty per-branch records for ``batch`` branches of up to ``capacity`` positions
        decoded from ``state`` (which they read and never copy or write)."""
        self.check_state(state)
        layers = [record.new_branch(batch, capacity, self.device) for record in state.layers]
        return BranchCache(
            layers=layers, batch=batch, capacity=capacity, prefix_length=state.length
        )

    def decode(
        self,
        state: PrefixState,
        branch: BranchCache,
        input_ids: torch.Tensor,
        counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the next ``T`` positions of every branch in ``branch``
        (one process or sharded; pipeline stages decode with ``ring_decode``).

        ``input_ids`` ``[B, T]`` are appended to the branches' records; the first position of
        a branch is the prompt's last token (``state.last_token``). Runs with whatever
        autograd mode is active (rollout: ``no_grad``).

        ``counts`` (a ragged step, under ``no_grad``): branch ``b`` takes only its first
        ``counts[b]`` inputs (``0``: it sits the step out), each branch from its own position;
        the rest of its row pads it to ``T`` and its logits there mean nothing.
        """
        check_decode_inputs(state, branch, input_ids)
        length = input_ids.shape[1]
        rows = None
        if counts is not None:
            rows = branch.ragged_rows(counts, length, input_ids.device)
            start = state.length + rows.most
        else:
            start = state.length + branch.length
        span = Span(start=start, length=length, write=False, rows=rows)
        if self.stage is not None:
            raise RuntimeError(
                "on pipeline stages decoding runs the stages' ring schedule: call "
                "longstraw_core.rollout.decode (or ModelAdapter.ring_decode within its program)"
            )

        def step() -> torch.Tensor:
            hidden = self.run_layers(self.embed_tokens(input_ids), span, state, branch)
            return self.lm_head(self.decoder.norm(hidden))

        logits = self._call_model(step)
        if counts is not None:
            branch.advance(counts)
        else:
            branch.length += span.length
        return logits

    def prefill(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        chunk_size: int = 4096,
        progress: bool | None = None,
        checkpoints: str | None = None,
        offload: OffloadPolicy | str | dict | None = None,
        keep_attention_outputs: bool = False,
    ) -> PrefixState:
        """Run the prompt once under ``no_grad``, in chunks, keeping only the prefix state.

        All prompt tokens but the last are stored; the last is kept as ``state.last_token``
        and replayed at the head of every branch (see ``score``). ``progress=None`` shows a
        progress bar only on a terminal. ``checkpoints`` (``"device"`` or ``"cpu"``) keeps
        the state of recurrent and sliding-window layers at every chunk start, which exact
        mode needs; full-attention-only models keep nothing extra. ``offload`` (an ``OffloadPolicy``, or what
        ``OffloadPolicy.parse`` takes) keeps chosen layer types in CPU memory: each chunk's
        state is copied there, and every later pass streams it in layer by layer (offloaded
        records keep their checkpoints in CPU memory too).
        ``keep_attention_outputs`` also keeps each full-attention layer's output, which exact
        mode's sweep reuses (``PrefixState.keep_attention_outputs``).
        """
        prompt_ids = as_token_ids(prompt_ids, "prompt_ids", self.vocab_size)
        check_prefill_options(chunk_size, checkpoints)
        offload = OffloadPolicy.parse(offload)
        self._check_positions(len(prompt_ids), 0)
        prompt_ids = prompt_ids.to(self.device)
        stored = prompt_ids[:-1]
        state = PrefixState(
            layers=self.new_layer_states(len(stored), offload),
            prompt_ids=prompt_ids.clone(),
            owner=self.owner_id,
            meta={"model_type": self.config.model_type, "chunk_size": chunk_size},
            offload=offload,
        )
        if checkpoints is not None:
            state.keep_checkpoints(self.device if checkpoints == "device" else "cpu")
        if keep_attention_outputs:
            state.keep_attention_outputs()
        bar = token_progress(len(stored), "prefill", progress)
        if self.stage is not None:
            with bar:
                self._staged_prefill(stored, chunk_size, state, bar.update)
            return state
        with torch.no_grad(), bar:
            for start in self.in_step(range(0, len(stored), chunk_size)):
                if start is None:
                    self.idle_forward()
                    continue
                chunk = stored[start : start + chunk_size]
                span = Span(start=start, length=len(chunk), write=True)
                self._call_model(functools.partial(self._run_chunk, chunk, span, state))
                state.length = span.start + span.length
                bar.update(len(chunk))
        if offload is not None and offload.active and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # chunks copied out async
        return state

    def score(
        self,
        state: PrefixState,
        response_ids: torch.Tensor | Sequence[int],
        return_entropy: bool = False,
        state_grad: StateGrad | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities of a response given the prompt held by ``state``.

        ``logps[t] = log p(response[t] | prompt, response[:t])``, differentiable with respect
        to the parameters, of the distribution at ``temperature``
        (``log_softmax(logits / temperature)``: TRL's GRPO scores every log-prob of its loss
        at its sampling temperature, ``GRPOConfig.temperature``; > 0). The branch replays the last prompt token first, so every logit
        that scores a response token runs with autograd. ``state`` is only read. With
        ``return_entropy`` also returns the (detached) entropy of each predictive distribution.
        With ``state_grad`` (exact mode), backward also adds ``dL/dstate`` into it. The LM head
        runs in row chunks of at most ``HEAD_CHUNK_ELEMENTS`` logits, each recomputed in
        backward when there are several (``lm_head.chunked_head_log_probs``).
        """
        self.check_state(state)
        check_temperature(temperature)
        response_ids = as_token_ids(response_ids, "response_ids", self.vocab_size)
        self._check_positions(state.prompt_length, len(response_ids))
        response_ids = response_ids.to(self.device)
        inputs = torch.cat([state.last_token, response_ids[:-1]])
        span = Span(start=state.length, length=len(inputs), write=False)
        if self.stage is not None:
            if state_grad is not None:
                raise RuntimeError(
                    "on pipeline stages exact mode's replay runs in grpo_step (replay_branches)"
                )
            logps, entropy = self._staged_score(
                state, inputs, response_ids, span, return_entropy, temperature
            )
            return (logps, entropy) if return_entropy else logps
        reads = state if state_grad is None else exact_state(state, state_grad, produced=None)

        def replay() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self.run_layers(self.embed_tokens(inputs[None]), span, reads)
            hidden = self.decoder.norm(hidden[0])
            return chunked_head_log_probs(
                self.lm_head, hidden, response_ids, return_entropy, temperature
            )

        with self._checkpointed_pass():
            logps, entropy = self._call_model(replay)
        if not return_entropy:
            return logps
        return logps, entropy

    def backprop_prompt(
        self, state: PrefixState, state_grad: StateGrad, progress: bool | None = None
    ) -> None:
        """Exact mode's reverse sweep: push ``state_grad`` back through the prompt's chunks.

        Chunk ``k`` (last to first) is recomputed with autograd from the stored state before
        it and backpropagated with the accumulated gradient of the state it produced; its
        reads of earlier state add into ``state_grad`` for the chunks still to come.
        Parameter gradients accumulate in ``.grad``. Memory: one chunk's graph (with
        ``activation_checkpointing``: each layer's input and what the chunk writes, plus one
        layer's graph while backward recomputes it).
        """
        self.check_state(state)
        chunk_size = int(state.meta["chunk_size"])
        starts = list(range(0, state.length, chunk_size))
        bar = token_progress(state.length, "sweep", progress)
        if self.stage is not None:
            with bar:
                self._staged_sweep(state, state_grad, starts[::-1], chunk_size, bar.update)
            return
        with torch.enable_grad(), bar:
            for start in self.in_step(starts[::-1]):
                # A sharded model's other rank may have more chunks: join their collectives
                # by recomputing the first chunk again with a zero gradient (the same
                # computation as a real chunk, so the same parameters take part; this rank's
                # dS is no longer needed, and the zeros add nothing to the parameters').
                idle = start is None
                if idle:
                    if not starts:
                        raise RuntimeError(
                            "a one-token prompt has no chunk to recompute while another rank "
                            "sweeps; give every rank prompts of at least two tokens"
                        )
                    start = starts[0]
                chunk = state.prompt_ids[start : min(start + chunk_size, state.length)]
                produced: Produced = []
                span = Span(start=start, length=len(chunk), write=True)
                reads = exact_state(state, state_grad, produced)
                self._produced = produced  # what call_layer hands to a sharded layer
                try:
                    with self._checkpointed_pass():
                        self._call_model(functools.partial(self._run_chunk, chunk, span, reads))
                finally:
                    self._produced = None
                # Outputs that depend on no trainable parameter (frozen early layers under
                # LoRA, say) carry no gradient path and are left out.
                pairs = [
                    (out, torch.zeros_like(out) if idle else seed.resolve())
                    for out, seed in produced
                    if out.requires_grad
                ]
                if pairs:
                    outputs, grads = zip(*pairs, strict=True)
                    torch.autograd.backward(outputs, grads)
                bar.update(0 if idle else len(chunk))

    def _run_chunk(self, chunk: torch.Tensor, span: Span, state: PrefixState) -> None:
        """One prompt chunk through every layer: written into ``state`` (or, in exact mode's
        recompute, handed to the sweep)."""
        self.run_layers(self.embed_tokens(chunk[None]), span, state)
