"""The adapter engine: prefill a prompt once without autograd, then score branches from it.

An adapter wraps a transformers causal LM (plain or PEFT-wrapped) and reuses its modules and
parameter names, so checkpoints, LoRA and sharding keep working; it only drives the
per-layer computation with an explicit ``PrefixState``. ``run_layers`` is the loop over the
decoder layers; subclasses give which state each layer keeps (``new_layer_state``), one
decoder layer's work over a span of positions (``layer_work``, with ``layer_result`` when a
layer passes something on to the next), and optional model checks (``check_model``).

Decoding (``longstraw_core.rollout.decode``) runs the same ``run_layers`` on a batch of branches
with a ``BranchCache``: each layer reads the shared prefix record and its own branch record.
Scoring is the one-branch case without a cache: the branch's positions are the span itself.

Every layer's work goes through ``call_layer`` and every pass over the model through
``_call_model``, which run as FSDP forwards on a sharded model (``longstraw_core.adapters.parallel``).
``layer_records`` hands each pass its records: streamed to the device one layer at a time for
offloaded layer types (``longstraw_core.offload``), and, with ``activation_checkpointing`` in
a pass with autograd, wrapped for backward's layer recompute (``longstraw_core.adapters.recompute``).
``score``'s LM head runs in row chunks (``longstraw_core.adapters.lm_head``); input checks are in
``longstraw_core.adapters.validation``. This module re-exports the names callers import from it.
The public passes (``prefill``, ``score``, ``backprop_prompt``, ``decode``) are
``longstraw_core.adapters.passes``'s, each read there with its one-process and sharded forms;
on pipeline stages (``stage`` set) each hands over to its staged form in
``longstraw_core.adapters.staged_forward`` (no autograd) or ``staged_backward`` (replay and
the exact sweep).
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
from transformers import PreTrainedModel

from longstraw_core.adapters.family import ModelFamily
from longstraw_core.adapters.parallel import Item, Parallel, ShardedPasses
from longstraw_core.adapters.passes import PublicPasses, token_progress
from longstraw_core.adapters.recompute import LayerRecord, recomputable
from longstraw_core.adapters.recompute import checkpointed as _checkpointed
from longstraw_core.adapters.span import Span
from longstraw_core.adapters.staged_backward import StagedBackwardPasses
from longstraw_core.adapters.staged_forward import StagedForwardPasses
from longstraw_core.adapters.validation import (
    as_token_ids,
    check_attention_dropout,
    check_positions,
    check_state,
)
from longstraw_core.kinds.base import LayerState, Produced
from longstraw_core.offload import OffloadPolicy, stream_layers
from longstraw_core.state.prefix import BranchCache, BranchRecord, PrefixState

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


class ModelAdapter(PublicPasses, ShardedPasses, StagedForwardPasses, StagedBackwardPasses, ABC):
    """Prefill once, score many branches: the per-architecture engine behind LongStraw.

    The public passes (``prefill``, ``score``, ``backprop_prompt``, ``decode``) come from
    ``PublicPasses``; ``parallel`` and the passes over a sharded model from
    ``ShardedPasses``; ``stage`` and the passes on a pipeline stage from
    ``StagedForwardPasses`` (no autograd) and ``StagedBackwardPasses`` (replay, exact sweep)."""

    # The family this adapter serves (``longstraw_core.adapters.family``): the model types and what
    # config, tiny models, planner and offload read about them. ``model_types``: the family's,
    # set when a subclass names its family.
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "family" in vars(cls):
            cls.model_types = cls.family.model_types

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.causal_lm = unwrap_causal_lm(model)
        self.config = self.causal_lm.config
        self.decoder = self.causal_lm.get_decoder()
        self.embed_tokens = self.causal_lm.get_input_embeddings()
        self.lm_head = self.causal_lm.get_output_embeddings()
        check_attention_dropout(self.config.get_text_config())
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

    # --- checks -----------------------------------------------------------------------------

    def check_state(self, state: PrefixState) -> None:
        """Refuse a state of another model, or on another device (``validation.check_state``)."""
        check_state(state, self.owner_id, self.device)

    def _check_positions(self, prompt_length: int, response_length: int) -> None:
        check_positions(self.max_positions, prompt_length, response_length)
