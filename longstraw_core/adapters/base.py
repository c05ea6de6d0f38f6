"""The adapter engine: prefill a prompt once without autograd, then score branches from it.

An adapter wraps a transformers causal LM (plain or PEFT-wrapped) and reuses its modules and
parameter names, so checkpoints, LoRA and sharding keep working; it only drives the
per-layer computation with an explicit ``PrefixState``. ``run_layers`` is the loop over the
decoder layers; subclasses give which state each layer keeps (``new_layer_state``), one
decoder layer's work over a span of positions (``layer_work``, with ``layer_result`` when a
layer passes something on to the next), and optional model checks (``check_model``).

Decoding (``longstraw_core.rollout``) runs the same ``run_layers`` on a batch of branches
with a ``BranchCache``: each layer reads the shared prefix record and its own branch record.
Scoring is the one-branch case without a cache: the branch's positions are the span itself.

Every layer's work goes through ``call_layer`` and every pass over the model through
``_call_model``, which run as FSDP forwards on a sharded model (``longstraw_core.adapters.parallel``).
``layer_records`` hands each pass its records: streamed to the device one layer at a time for
offloaded layer types (``longstraw_core.offload``), and, with ``activation_checkpointing`` in
a pass with autograd, wrapped for backward's layer recompute (``longstraw_core.adapters.recompute``).
``score``'s LM head runs in row chunks (``longstraw_core.adapters.lm_head``); input checks are in
``longstraw_core.adapters.validation``. This module re-exports the names callers import from it.
On pipeline stages (``stage`` set) each public pass hands over to its staged form in
``longstraw_core.adapters.staged``. The module stays whole, a little over 500 lines: it is the
public passes, each read with its one-process, sharded and staged forms.
"""

from __future__ import annotations

import functools
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from longstraw_core.adapters.family import ModelFamily
from longstraw_core.adapters.lm_head import chunked_head_log_probs
from longstraw_core.adapters.parallel import Item, Parallel, ShardedPasses
from longstraw_core.adapters.recompute import LayerRecord, recomputable
from longstraw_core.adapters.recompute import checkpointed as _checkpointed
from longstraw_core.adapters.span import Span
from longstraw_core.adapters.staged import StagedPasses
from longstraw_core.adapters.validation import (
    as_token_ids,
    check_decode_inputs,
    check_positions,
    check_prefill_options,
    check_state,
    check_temperature,
)
from longstraw_core.exact import StateGrad, exact_state
from longstraw_core.kinds.base import LayerState, Produced
from longstraw_core.offload import OffloadPolicy, stream_layers
from longstraw_core.state import BranchCache, BranchRecord, PrefixState

__all__ = [
    "Item",
    "LayerRecord",
    "ModelAdapter",
    "Parallel",
    "Span",
    "as_token_ids",
    "branch_records",
    "token_progress",
    "unwrap_causal_lm",
    "writes_only",
]

_OWNER_ATTRIBUTE = "_longstraw_owner_id"


def writes_only(span: Span, index: int, layers: Sequence[nn.Module]) -> bool:
    """Whether layer ``index`` only has to write its state: the last layer of a writing span.

    Its output would feed the final norm and the LM head, which a prefill chunk never runs.
    """
    return span.write and index == len(layers) - 1


def branch_records(branch: BranchCache | None, state: PrefixState) -> list[BranchRecord | None]:
    """Each layer's branch record, or ``None`` for every layer when there is no cache."""
    return [None] * len(state.layers) if branch is None else branch.layers


def token_progress(total: int, desc: str, progress: bool | None) -> tqdm:
    """A transient bar over prompt tokens; ``progress=None`` shows it only on a terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit="tok",
        unit_scale=True,
        disable=(not progress) if progress is not None else None,
        leave=False,
    )


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (LoRA layers stay in place inside it)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"expected a transformers PreTrainedModel (optionally wrapped by peft), "
            f"got {type(model).__name__}"
        )
    return base


class ModelAdapter(ShardedPasses, StagedPasses, ABC):
    """Prefill once, score many branches: the per-architecture engine behind LongStraw.

    ``parallel`` and the passes over a sharded model come from ``ShardedPasses``; ``stage``
    and the passes on a pipeline stage from ``StagedPasses``."""

    # The family this adapter serves (``longstraw_core.adapters.family``): the model types and what
    # config, tiny models, planner and offload read about them. ``model_types`` repeats the
    # family's (``register_adapter`` checks that they agree).
    family: ClassVar[ModelFamily]
    model_types: ClassVar[tuple[str, ...]] = ()
    # The decoder's RMSNorm: Llama's ``weight * x.to(dtype)`` (True), or Qwen3.5's
    # ``(x * (1 + weight)).to(dtype)`` in fp32 (False). The planner sizes saved norms by it.
    llama_norm: ClassVar[bool] = True
    # Recompute each decoder layer in backward instead of keeping its activations, in the
    # passes with autograd (``score`` with grad enabled, ``backprop_prompt``): a branch's
    # graph keeps one ``[T, hidden]`` input per layer plus one layer's graph during backward,
    # for about one more forward of the layers. Set it on the adapter (any time between
    # passes); see the module docstring.
    activation_checkpointing: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.causal_lm = unwrap_causal_lm(model)
        self.config = self.causal_lm.config
        self.decoder = self.causal_lm.get_decoder()
        self.embed_tokens = self.causal_lm.get_input_embeddings()
        self.lm_head = self.causal_lm.get_output_embeddings()
        self.check_model()
        # States remember the model they came from; the id lives on the model so that two
        # adapters of one model can share states, and a state from another model is refused.
        if not hasattr(self.causal_lm, _OWNER_ATTRIBUTE):
            setattr(self.causal_lm, _OWNER_ATTRIBUTE, uuid.uuid4().hex)
        self.owner_id: str = getattr(self.causal_lm, _OWNER_ATTRIBUTE)
        # Exact mode's list of what a recomputed chunk writes, while one is recomputed.
        self._produced: Produced | None = None
        # Whether the pass running now checkpoints its layers (``_checkpointed_pass``).
        self._checkpointing = False

    # --- architecture hooks ---------------------------------------------------------------

    def check_model(self) -> None:
        """Refuse configurations the adapter cannot reproduce exactly (override to add)."""

    def new_layer_states(
        self, capacity: int, offload: OffloadPolicy | None = None
    ) -> list[LayerState]:
        """Empty records sized for ``capacity`` prompt positions, one per decoder layer this
        rank runs (every layer in one process; its own block on a pipeline stage)."""
        return [
            self.new_layer_state(index, self.decoder.layers[index], capacity, offload)
            for index in self.owned_layers()
        ]

    @abstractmethod
    def new_layer_state(
        self, index: int, layer: nn.Module, capacity: int, offload: OffloadPolicy | None
    ) -> LayerState:
        """Decoder layer ``index``'s empty record for ``capacity`` prompt positions, allocated
        where ``offload`` keeps its layer kind (``longstraw_core.offload.home_options``)."""

    def owned_layers(self) -> range:
        """The decoder layers this rank runs and keeps state for: all of them in one process
        (or under FSDP), its own contiguous block on a pipeline stage."""
        if self.stage is not None:
            return self.stage.layers
        return range(len(self.decoder.layers))

    def run_layers(
        self,
        hidden: torch.Tensor,
        span: Span,
        state: PrefixState,
        branch: BranchCache | None = None,
    ) -> torch.Tensor:
        """Run every decoder layer over ``hidden`` ``[B, T, hidden]`` at ``span``.

        Without ``branch`` (prefill, scoring, exact recompute) ``B`` is 1 and a branch span
        sees the prefix and itself. With ``branch`` (decoding), ``B`` branches each append the
        span to their own records and see the prefix plus every position they hold. Each
        layer's work (``layer_work``) goes through ``call_layer``, with the record it reads;
        the records come from ``layer_records``.

        Returns the last layer's output, or ``None`` for a span that writes (a prefill chunk
        or its recompute): nothing reads that output, so the last layer computes only the
        state it writes (``writes_only``), which skips its MLP and, for attention, the
        queries' attention and output projection.
        """
        return self.run_owned_layers(hidden, span, state, branch)[0]

    def run_owned_layers(
        self,
        hidden: torch.Tensor,
        span: Span,
        state: PrefixState,
        branch: BranchCache | None = None,
        carried: Any = None,
    ) -> tuple[torch.Tensor, Any]:
        """``run_layers`` over the layers this rank owns (``owned_layers``), starting from what
        the previous layer ``carried`` (another stage's, on a pipeline); returns the output and
        what the last owned layer carries on (``layer_result``)."""
        position_embeddings = self.decoder.rotary_emb(hidden, span.position_ids(hidden.device))
        layers = [self.decoder.layers[index] for index in self.owned_layers()]
        with self.layer_records(state, span) as records:
            owned = zip(
                self.owned_layers(), layers, records, branch_records(branch, state), strict=True
            )
            for index, layer, record, branch_record in owned:
                work = self.layer_work(
                    index, layer, position_embeddings, record, span, branch_record,
                    writes_only(span, index, self.decoder.layers), carried,
                )  # fmt: skip
                hidden, carried = self.layer_result(self.call_layer(layer, work, hidden, record))
        return hidden, carried

    @abstractmethod
    def layer_work(
        self,
        index: int,
        layer: nn.Module,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        record: Any,
        span: Span,
        branch_record: BranchRecord | None,
        state_only: bool,
        carried: Any,
    ) -> Callable[[torch.Tensor], Any]:
        """Decoder layer ``index``'s work as ``fn(hidden)`` (for ``call_layer``): it reads
        ``record`` (and ``branch_record`` when decoding) at ``span``; ``state_only``: only
        write the state (``writes_only``). ``carried``: what the previous layer's work passed
        on (``layer_result``; ``None`` for the first layer). Everything but ``hidden`` is bound
        now, so backward's recompute runs the same work."""

    def layer_result(self, output: Any) -> tuple[torch.Tensor, Any]:
        """A layer's work ``output`` as its hidden states and what it carries to the next
        layer's work; by default the output is the hidden states and carries nothing."""
        return output, None

    def layer_records(
        self, state: PrefixState, span: Span
    ) -> AbstractContextManager[Sequence[LayerState]]:
        """``with adapter.layer_records(state, span) as records``: each layer's record as the
        pass over ``span`` reads it. Offloaded layers arrive one by one on the device (a
        record is valid until the next one is taken); the others are ``state.layers``."""
        records = stream_layers(state, span.start if span.write else None, self.device)
        if not self._checkpoints_layers():
            return records
        return recomputable(records, state.layers)

    def call_layer(
        self,
        layer: nn.Module,
        fn: Callable[[torch.Tensor], Any],
        hidden: torch.Tensor,
        record: Any = None,
    ) -> Any:
        """``fn(hidden)``: decoder ``layer``'s work on the activations ``hidden``.

        A plain call in one process. On a sharded model it runs as ``layer``'s registered
        FSDP forward method: the layer's parameters are gathered for it and its backward is
        hooked. Pass only activations as ``hidden``; records, spans and branch caches belong
        in ``fn``'s closure (FSDP casts and hooks the arguments it is given).

        ``record``: the record ``fn`` reads, as ``layer_records`` gave it. With
        ``activation_checkpointing`` in a pass with autograd, ``fn`` runs under
        ``torch.utils.checkpoint`` and is run again in backward, reading ``record`` (writes
        dropped, an offloaded copy fetched again); a call without a record is not
        checkpointed.
        """
        if isinstance(record, LayerRecord) and self._checkpoints_layers():
            fn = functools.partial(_checkpointed, fn, record)
        if self.parallel is None:
            return fn(hidden)
        return self.parallel.run_layer(layer, fn, hidden, self._produced)

    def _checkpoints_layers(self) -> bool:
        """Whether the layers of the pass running now are checkpointed."""
        return self._checkpointing and torch.is_grad_enabled()

    @contextmanager
    def _checkpointed_pass(self) -> Iterator[None]:
        """A pass whose layers are checkpointed when ``activation_checkpointing`` is on."""
        previous = self._checkpointing
        self._checkpointing = bool(self.activation_checkpointing)
        try:
            yield
        finally:
            self._checkpointing = previous

    # --- properties -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        if self.stage is not None:  # the embeddings may live on another stage
            return self.stage.device
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layers compute in (and the state is kept in)."""
        if self.parallel is not None and self.parallel.param_dtype is not None:
            return self.parallel.param_dtype  # FSDP mixed precision: params gathered in it
        if self.stage is not None:  # before FSDP: a stage records its weights' dtype
            return self.stage.dtype
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        if self.stage is not None:
            return self.stage.vocab_size
        return self.embed_tokens.weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    # --- the public API ---------------------------------------------------------------------

    def new_branch_cache(self, state: PrefixState, batch: int, capacity: int) -> BranchCache:
        """Empty per-branch records for ``batch`` branches of up to ``capacity`` positions
        decoded from ``state`` (which they read and never copy or write)."""
        self.check_state(state)
        layers = [record.new_branch(batch, capacity, self.device) for record in state.layers]
        return BranchCache(
            layers=layers, batch=batch, capacity=capacity, prefix_length=state.length
        )

    def decode(
        self, state: PrefixState, branch: BranchCache, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the next ``T`` positions of every branch in ``branch``
        (one process or sharded; pipeline stages decode with ``ring_decode``).

        ``input_ids`` ``[B, T]`` are appended to the branches' records; the first position of
        a branch is the prompt's last token (``state.last_token``). Runs with whatever
        autograd mode is active (rollout: ``no_grad``).
        """
        check_decode_inputs(state, branch, input_ids)
        span = Span(start=state.length + branch.length, length=input_ids.shape[1], write=False)
        if self.stage is not None:
            raise RuntimeError(
                "on pipeline stages decoding runs the stages' ring schedule: call "
                "longstraw_core.rollout (or ModelAdapter.ring_decode within its program)"
            )

        def step() -> torch.Tensor:
            hidden = self.run_layers(self.embed_tokens(input_ids), span, state, branch)
            return self.lm_head(self.decoder.norm(hidden))

        logits = self._call_model(step)
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
        recurrent layers' state at every chunk start, which exact mode needs; attention-only
        models keep nothing extra. ``offload`` (an ``OffloadPolicy``, or what
        ``OffloadPolicy.parse`` takes) keeps chosen layer types in CPU memory: each chunk's
        state is copied there, and every later pass streams it in layer by layer (offloaded
        recurrent layers keep their checkpoints in CPU memory too).
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
        bar = token_progress(state.length, "prompt backward", progress)
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

    # --- checks -----------------------------------------------------------------------------

    def check_state(self, state: PrefixState) -> None:
        """Refuse a state of another model, or on another device (``validation.check_state``)."""
        check_state(state, self.owner_id, self.device)

    def _check_positions(self, prompt_length: int, response_length: int) -> None:
        check_positions(self.max_positions, prompt_length, response_length)
