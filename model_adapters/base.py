"""The adapter contract: prefill a prompt once without autograd, then score branches from it.

An adapter wraps a transformers causal LM (plain or PEFT-wrapped) and reuses its modules and
parameter names, so checkpoints, LoRA and sharding keep working; it only drives the
per-layer computation with an explicit ``PrefixState``. Subclasses implement three hooks:
which state each layer keeps (``new_layer_states``), how one decoder layer runs over a span
of positions (``run_layers``), and optional model checks (``check_model``).

Decoding (``longstraw_core.rollout``) runs the same ``run_layers`` on a batch of branches
with a ``BranchCache``: each layer reads the shared prefix record and its own branch record.
Scoring is the one-branch case without a cache: the branch's positions are the span itself.

Sharding. ``run_layers`` drives a decoder layer's submodules, never the layer itself, so a
sharded model (``longstraw_core.distributed.shard_model``) could not see where a layer's work
starts and ends. Every layer's work therefore goes through ``call_layer`` and every pass over
the model through ``_call_model``: plain calls in one process, the layer's and the root's
registered FSDP forward methods when sharded. Ranks of a sharded model must also run the same
number of passes of each kind (their collectives pair up), so the loops whose length depends
on the data go through ``in_step``, which pads a rank's share with idle passes.

Offload. ``prefill(..., offload=OffloadPolicy(...))`` keeps chosen layer types' state in CPU
memory; ``run_layers`` takes each pass's records from ``layer_records``, which streams those
layers to the device one at a time (``longstraw_core.offload``) and is ``state.layers``
itself when nothing is offloaded.

Activation checkpointing. With ``adapter.activation_checkpointing = True``, the passes that
run with autograd (``score`` with grad enabled, and each chunk recompute of exact mode's
``backprop_prompt``) wrap every decoder layer's work in ``torch.utils.checkpoint`` (the
non-reentrant variant): the graph keeps only each layer's input, and backward recomputes one
layer at a time. ``call_layer`` applies it inside the layer's work, so on a sharded model it
runs inside the layer's FSDP forward method (torchtitan's order: FSDP gathers, then the
checkpointed work). The recompute reads the layer's record through a ``LayerRecord`` that
``layer_records`` hands out for those passes: its writes (a recomputed chunk's keys/values
handed to the sweep, a recurrent state's update) are dropped, since the first run made them;
an offloaded record's device copy, released after the layer's forward, goes into the
checkpoint as an input, so the offload stream's saved-tensor hooks keep a handle to it and
fetch it again when backward recomputes that layer. Gradients are unchanged: the recomputed
forward only rebuilds the saved tensors of the first one's graph, whose nodes (with exact
mode's ``dS`` sinks) are the ones backward runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from longstraw_core.exact import Produced, StateGrad, exact_state
from longstraw_core.kinds.forwarding import ForwardedReads
from longstraw_core.offload import OffloadPolicy, stream_layers
from longstraw_core.state import BranchCache, BranchRecord, LayerState, PrefixState
from model_adapters.family import ModelFamily

_OWNER_ATTRIBUTE = "_longstraw_owner_id"
Item = TypeVar("Item")
# ``score`` runs the LM head in row chunks of at most this many logits (``[rows, vocab]``, at
# least one row): about 256 MB in float32, instead of ``[T, vocab]`` for the whole branch
# (2 GB per copy for 2048 tokens of a 248K vocabulary). See ``_head_log_probs``.
HEAD_CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Span:
    """Where a run of tokens sits: its first position, and whether it extends the state.

    ``write=True`` is a prefill chunk: its keys/values are written into the state and it
    attends to the state before ``start``. ``write=False`` is a branch: it attends to the
    whole state and leaves it untouched.
    """

    start: int
    length: int
    write: bool

    def position_ids(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.length, device=device)[None]


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


def as_token_ids(ids: torch.Tensor | Sequence[int], name: str, vocab_size: int) -> torch.Tensor:
    """Validate a 1-D sequence of token ids; errors name the argument and the fix."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D tensor of token ids (one sequence), got shape "
            f"{tuple(ids.shape)}; pass ids[0] for a batch of one"
        )
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty: it needs at least one token")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
            "was it tokenized with another tokenizer?"
        )
    return ids.long()


class Parallel(Protocol):
    """How a sharded model runs; ``longstraw_core.distributed.shard_model`` puts one on
    ``ModelAdapter.parallel``."""

    param_dtype: torch.dtype | None  # the dtype layers compute in, when it is not the params'

    def run_model(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` as the root module's forward."""

    def run_layer(
        self,
        layer: nn.Module,
        fn: Callable[[torch.Tensor], Any],
        hidden: torch.Tensor,
        produced: Produced | None,
    ) -> Any:
        """``fn(hidden)`` as ``layer``'s forward; ``produced``: exact mode's recompute list."""

    def most(self, count: int) -> int:
        """The largest ``count`` over the ranks."""

    def everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""

    def reshard(self) -> None:
        """Free every gathered parameter (the next pass gathers the current values)."""


class ModelAdapter(ABC):
    """Prefill once, score many branches: the per-architecture engine behind LongStraw."""

    # The family this adapter serves (``model_adapters.family``): the model types and what
    # config, tiny models, planner and offload read about them. ``model_types`` repeats the
    # family's (``register_adapter`` checks that they agree).
    family: ClassVar[ModelFamily]
    model_types: ClassVar[tuple[str, ...]] = ()
    # The decoder's RMSNorm: Llama's ``weight * x.to(dtype)`` (True), or Qwen3.5's
    # ``(x * (1 + weight)).to(dtype)`` in fp32 (False). The planner sizes saved norms by it.
    llama_norm: ClassVar[bool] = True
    # Set by ``longstraw_core.distributed.shard_model``. None: one process, plain calls.
    parallel: Parallel | None = None
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

    @abstractmethod
    def new_layer_states(
        self, capacity: int, offload: OffloadPolicy | None = None
    ) -> list[LayerState]:
        """Empty per-layer records sized for ``capacity`` prompt positions, each allocated
        where ``offload`` keeps its layer type (``longstraw_core.offload.home_options``)."""

    @abstractmethod
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
        layer's work goes through ``call_layer``, with the record it reads; the records come
        from ``layer_records``.

        Returns the last layer's output, or ``None`` for a span that writes (a prefill chunk
        or its recompute): nothing reads that output, so the last layer computes only the
        state it writes (``writes_only``), which skips its MLP and, for attention, the
        queries' attention and output projection.
        """

    def layer_records(
        self, state: PrefixState, span: Span
    ) -> AbstractContextManager[Sequence[LayerState]]:
        """``with adapter.layer_records(state, span) as records``: each layer's record as the
        pass over ``span`` reads it. Offloaded layers arrive one by one on the device (a
        record is valid until the next one is taken); the others are ``state.layers``."""
        records = stream_layers(state, span.start if span.write else None, self.device)
        if not self._checkpoints_layers():
            return records
        return _recomputable(records, state.layers)

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
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layers compute in (and the state is kept in)."""
        if self.parallel is not None and self.parallel.param_dtype is not None:
            return self.parallel.param_dtype  # FSDP mixed precision: params gathered in it
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
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
        """Logits ``[B, T, vocab]`` of the next ``T`` positions of every branch in ``branch``.

        ``input_ids`` ``[B, T]`` are appended to the branches' records; the first position of
        a branch is the prompt's last token (``state.last_token``). Runs with whatever
        autograd mode is active (rollout: ``no_grad``).
        """
        if branch.prefix_length != state.length:
            raise ValueError(
                f"branch cache was made for a prefix of {branch.prefix_length} positions, "
                f"not this state's {state.length}; use adapter.new_branch_cache(state, ...)"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != branch.batch:
            raise ValueError(
                f"input_ids must be [{branch.batch}, T] for a cache of {branch.batch} branches, "
                f"got {tuple(input_ids.shape)}"
            )
        span = Span(start=state.length + branch.length, length=input_ids.shape[1], write=False)

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
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if checkpoints not in (None, "device", "cpu"):
            raise ValueError(f"checkpoints must be None, 'device' or 'cpu', got {checkpoints!r}")
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities of a response given the prompt held by ``state``.

        ``logps[t] = log p(response[t] | prompt, response[:t])``, differentiable with respect
        to the parameters. The branch replays the last prompt token first, so every logit
        that scores a response token runs with autograd. ``state`` is only read. With
        ``return_entropy`` also returns the (detached) entropy of each predictive distribution.
        With ``state_grad`` (exact mode), backward also adds ``dL/dstate`` into it. The LM head
        runs in row chunks of at most ``HEAD_CHUNK_ELEMENTS`` logits, each recomputed in
        backward when there are several (``_head_log_probs``).
        """
        self.check_state(state)
        response_ids = as_token_ids(response_ids, "response_ids", self.vocab_size)
        self._check_positions(state.prompt_length, len(response_ids))
        response_ids = response_ids.to(self.device)
        inputs = torch.cat([state.last_token, response_ids[:-1]])
        span = Span(start=state.length, length=len(inputs), write=False)
        reads = state if state_grad is None else exact_state(state, state_grad, produced=None)

        def replay() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self.run_layers(self.embed_tokens(inputs[None]), span, reads)
            hidden = self.decoder.norm(hidden[0])
            return _head_log_probs(self.lm_head, hidden, response_ids, return_entropy)

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
                    (out, torch.zeros_like(grad) if idle else grad)
                    for out, grad in produced
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

    # --- sharded models: passes over the model, ranks in step --------------------------------

    def _call_model(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, one pass over the model; on a sharded model it runs as the root module's
        FSDP forward, which gathers the parameters outside the decoder layers."""
        if self.parallel is None:
            return fn()
        return self.parallel.run_model(fn)

    def in_step(self, items: Sequence[Item]) -> Iterator[Item | None]:
        """``items``, then ``None`` while another rank still has items of this kind.

        FSDP gathers and reduces parameters with collectives that every rank must join, so the
        ranks of a sharded model run the same number of passes of each kind (prefill chunks,
        replayed branches, sweep chunks) even when their groups differ. The most any rank has
        is agreed before the first item; a ``None`` asks the caller for an idle pass of the
        same kind (``idle_forward``, ``idle_branch``, a zero-gradient chunk recompute). In one
        process: just ``items``.
        """
        extra = 0 if self.parallel is None else self.parallel.most(len(items)) - len(items)
        yield from items
        yield from itertools.repeat(None, extra)

    def idle_forward(self) -> None:
        """A pass that computes nothing and joins the collectives of a no-grad pass (a prefill
        chunk, a decoding step, a reference score)."""
        self._call_model(
            lambda: [self.call_layer(layer, _nothing, None) for layer in self.decoder.layers]
        )

    def idle_branch(self, state: PrefixState, state_grad: StateGrad | None = None) -> None:
        """A branch of weight zero: a one-token replay from ``state`` and its backward. Its
        collectives are a replayed branch's (the same parameters gathered and reduced, in the
        same order); it adds zeros to the gradients (and to ``state_grad``)."""
        logps = self.score(state, state.last_token, state_grad=state_grad)
        (logps.sum() * 0.0).backward()

    def everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of a sharded model (in one process: ``flag``);
        a loop that stops on it stops on every rank at once."""
        return flag if self.parallel is None else self.parallel.everywhere(flag)

    def release_parameters(self) -> None:
        """Free the parameters a sharded model still holds gathered (FSDP keeps the root's and
        the last layer's after a no-grad pass), so that an optimizer step cannot leave them
        stale. A backward frees them too. No-op in one process."""
        if self.parallel is not None:
            self.parallel.reshard()

    # --- checks -----------------------------------------------------------------------------

    def check_state(self, state: PrefixState) -> None:
        if not isinstance(state, PrefixState):
            raise ValueError(f"state must be a PrefixState from adapter.prefill, got {type(state)}")
        if state.owner != self.owner_id:
            raise ValueError(
                "state was prefilled by another model; prefill the prompt with this adapter "
                "(states cannot be shared between models)"
            )
        if state.device != self.device:
            raise ValueError(
                f"state is on {state.device} but the model is on {self.device}; "
                f"move it with state.to({str(self.device)!r})"
            )

    def _check_positions(self, prompt_length: int, response_length: int) -> None:
        limit = self.max_positions
        total = prompt_length + response_length
        if limit is not None and total > limit:
            raise ValueError(
                f"prompt ({prompt_length} tokens) + response ({response_length} tokens) = "
                f"{total} positions exceeds the model's limit of {limit} "
                "(config.max_position_embeddings); shorten the prompt or use a model "
                "configured for longer contexts"
            )


def _nothing(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


# --- the LM head in row chunks -------------------------------------------------------------------


def head_rows(tokens: int, vocab: int) -> int:
    """Rows per chunk of ``score``'s LM head: as few chunks as ``HEAD_CHUNK_ELEMENTS``
    allows (one row at least), of equal size but the last."""
    limit = max(1, HEAD_CHUNK_ELEMENTS // max(vocab, 1))
    chunks = max(1, -(-tokens // limit))
    return -(-tokens // chunks)


def _head_log_probs(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets[t])`` ``[T]`` from the final normed ``hidden`` ``[T, width]``, and the
    detached entropy of each distribution (``with_entropy``; else ``None``).

    The logits ``[T, vocab]`` are computed ``head_rows`` rows at a time, so only one chunk's
    are alive. With autograd and more than one chunk, each chunk runs under non-reentrant
    ``torch.utils.checkpoint``: its graph keeps only its input rows (views of ``hidden``) and
    backward recomputes its logits, one chunk at a time; a single chunk runs plainly (no
    recompute), as do chunks without autograd. The math is the unchunked one, row by row.
    """
    rows = head_rows(len(hidden), _head_width(head, hidden))
    if rows >= len(hidden):
        return _head_chunk(head, with_entropy, hidden, targets)
    recompute = torch.is_grad_enabled()
    pieces = []
    for rows_hidden, rows_targets in zip(hidden.split(rows), targets.split(rows), strict=True):
        if recompute:
            pieces.append(_checkpointed_head_chunk(head, with_entropy, rows_hidden, rows_targets))
        else:
            pieces.append(_head_chunk(head, with_entropy, rows_hidden, rows_targets))
    logps = torch.cat([logps for logps, _ in pieces])
    entropy = torch.cat([entropy for _, entropy in pieces]) if with_entropy else None
    return logps, entropy


def _head_width(head: nn.Module, hidden: torch.Tensor) -> int:
    """The number of logits ``head`` computes per row (its ``out_features``, or a probe's)."""
    out = getattr(head, "out_features", None)
    if isinstance(out, int):
        return out
    with torch.no_grad():
        return head(hidden[:1]).shape[-1]


def _head_chunk(
    head: nn.Module, with_entropy: bool, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of rows: ``log_softmax`` in ``promote_types(logits, float32)``, gathered
    at ``targets``; the entropy under ``no_grad``. The logits and their promoted copy are
    temporaries (freed as soon as ``log_softmax`` has run)."""
    log_probs = torch.log_softmax(_promoted(head(hidden)), -1)
    logps = log_probs.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return logps, None
    with torch.no_grad():
        product = log_probs.exp()
        entropy = -product.mul_(log_probs).sum(-1)
    return logps, entropy


def _promoted(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _checkpointed_head_chunk(
    head: nn.Module, with_entropy: bool, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_head_chunk`` under non-reentrant checkpointing: backward recomputes the chunk's
    logits and ``log_softmax`` (not its entropy, which the first run returned)."""
    calls = 0

    def run(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        nonlocal calls
        calls += 1
        return _head_chunk(head, with_entropy and calls == 1, hidden, targets)

    return checkpoint(run, hidden, targets, use_reentrant=False)


# --- activation checkpointing --------------------------------------------------------------------


class LayerRecord(ForwardedReads):
    """One layer's record in a pass whose layers are checkpointed (``layer_records``).

    Reads (the kinds' declared reads, ``ForwardedReads``) go to the record the pass gave (``record``: the state's own, an exact-mode view,
    or the offload stream's device copy). Writes go there too, except while backward
    recomputes the layer (``replaying``): the first run already handed them over, and a
    second ``update`` of an exact-mode recurrent view would clear the ``dS`` its backward
    is about to fill. ``streamed``: the record is the stream's short-lived copy (released
    after the layer's forward), so the recompute reads a copy fetched again instead.
    """

    def __init__(self, record: Any, home: Any) -> None:
        self._record = record
        self._replay: Any = None
        self.streamed = record is not home
        self._names: list[str] = []
        self._fields: dict[str, Any] = {}
        self._type: type | None = None
        if self.streamed:
            home = home.reading()  # the stored record (behind an exact view)
            reader = record.reading()  # the device copy
            self._type = type(home)
            for field in dataclasses.fields(home):
                if field.init:
                    value = getattr(reader, field.name)
                    if isinstance(value, torch.Tensor):
                        self._names.append(field.name)
                    else:
                        self._fields[field.name] = value

    def _reads_target(self) -> Any:
        return self._replay if self._replay is not None else self._record

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """A streamed record's tensors (the device copy), for the checkpoint to keep: the
        offload hooks turn them into handles and fetch them again for the recompute."""
        if not self.streamed:
            return ()
        reader = self._record.reading()
        return tuple(getattr(reader, name) for name in self._names)

    @contextmanager
    def replaying(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Reads from ``tensors`` (the streamed copy fetched again) or the record itself,
        writes dropped, while backward recomputes the layer."""
        target = self._record
        if self.streamed:
            copy = self._type(**self._fields, **dict(zip(self._names, tensors, strict=True)))
            target = self._record.with_record(copy)
        self._replay = target
        try:
            yield
        finally:
            self._replay = None

    def write(self, *args: Any) -> None:
        if self._replay is None:
            self._record.write(*args)

    def update(self, *args: Any) -> None:
        if self._replay is None:
            self._record.update(*args)

    def write_output(self, *args: Any) -> None:
        self._reads_target().write_output(*args)


class _RecomputableRecords:
    """The records of a checkpointed pass, each as a ``LayerRecord`` (iterated once)."""

    def __init__(self, records: Sequence[Any], homes: Sequence[Any]) -> None:
        self.records, self.homes = records, homes

    def __len__(self) -> int:
        return len(self.homes)

    def __iter__(self) -> Iterator[LayerRecord]:
        for record, home in zip(self.records, self.homes, strict=True):
            yield LayerRecord(record, home)


@contextmanager
def _recomputable(
    records: AbstractContextManager[Sequence[Any]], homes: Sequence[Any]
) -> Iterator[_RecomputableRecords]:
    with records as layers:
        yield _RecomputableRecords(layers, homes)


def _checkpointed(
    fn: Callable[[torch.Tensor], Any], record: LayerRecord, hidden: torch.Tensor
) -> Any:
    """``fn(hidden)`` under non-reentrant activation checkpointing.

    The first call is the forward; a later one is backward's recompute, which reads
    ``record`` replayed (writes dropped; a streamed record from its copy fetched again,
    which the checkpoint received as inputs).
    """
    calls = 0

    def run(hidden: torch.Tensor, *tensors: torch.Tensor) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(hidden)
        with record.replaying(tensors):
            return fn(hidden)

    return checkpoint(run, hidden, *record.tensors(), use_reentrant=False)
