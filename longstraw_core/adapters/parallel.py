"""Sharded models: how one runs (``Parallel``) and the adapter's passes over it.

``longstraw_core.distributed.shard_model`` puts a ``Parallel`` on ``ModelAdapter.parallel``;
every pass over the model then runs as the root module's FSDP forward (``_call_model``). Ranks
of a sharded model must run the same number of passes of each kind (their collectives pair
up), so the loops whose length depends on the data go through ``in_step``, which pads a rank's
share with idle passes. In one process all of this is plain calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from longstraw_core.kinds.base import Produced
from longstraw_core.state.exact import StateGrad
from longstraw_core.state.prefix import PrefixState

Item = TypeVar("Item")


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

    def everywhere_each(self, *flags: bool) -> tuple[bool, ...]:
        """Whether each flag holds on every rank (one collective)."""

    def reshard(self) -> None:
        """Free every gathered parameter (the next pass gathers the current values)."""

    def kept_gathered(self) -> AbstractContextManager[None]:
        """A block whose passes gather each layer once and keep it (then free them)."""


class ShardedPasses:
    """``ModelAdapter``'s passes over a sharded model, and the ranks kept in step (a base of
    ``ModelAdapter``; its methods use the adapter's ``call_layer``, ``decoder`` and ``score``).
    """

    # Set by ``longstraw_core.distributed.shard_model``. None: one process, plain calls.
    parallel: Parallel | None = None

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
        chunk, a decoding step, a reference score). On a pipeline stage it runs the stage's
        own layers and talks to no other stage: every stage of a replica idles together."""
        layers = [self.decoder.layers[index] for index in self.owned_layers()]
        self._call_model(lambda: [self.call_layer(layer, _nothing, None) for layer in layers])

    def idle_branch(self, state: PrefixState, state_grad: StateGrad | None = None) -> None:
        """A branch of weight zero: a one-token replay from ``state`` and its backward. Its
        collectives are a replayed branch's (the same parameters gathered and reduced, in the
        same order); it adds zeros to the gradients (and to ``state_grad``)."""
        logps = self.score(state, state.last_token, state_grad=state_grad)
        (logps.sum() * 0.0).backward()

    def parameters_gathered(self) -> AbstractContextManager[None]:
        """``with adapter.parameters_gathered():`` passes in the block gather a sharded model's
        layers once, at their first pass, and keep them until the block ends: what a rollout
        does (one gather per rollout, not per token; the unsharded model's memory while it
        runs). A no-op in one process and on unsharded pipeline stages."""
        if self.parallel is None:
            return nullcontext()
        return self.parallel.kept_gathered()

    def everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of a sharded model (in one process: ``flag``);
        a loop that stops on it stops on every rank at once."""
        return flag if self.parallel is None else self.parallel.everywhere(flag)

    def everywhere_each(self, *flags: bool) -> tuple[bool, ...]:
        """``everywhere`` of each flag, in one collective."""
        if self.parallel is None:
            return flags
        return self.parallel.everywhere_each(*flags)

    def release_parameters(self) -> None:
        """Free the parameters a sharded model still holds gathered (FSDP keeps the root's and
        the last layer's after a no-grad pass), so that an optimizer step cannot leave them
        stale. A backward frees them too. No-op in one process."""
        if self.parallel is not None:
            self.parallel.reshard()


def _nothing(hidden: torch.Tensor) -> torch.Tensor:
    return hidden
