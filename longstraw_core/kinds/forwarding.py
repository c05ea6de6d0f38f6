"""The reads of every layer kind, answered by another object: the base of the wrappers a
pass hands adapters instead of a record (``StreamedRecord`` below, an
offloaded record's device copy; ``longstraw_core.adapters.base.LayerRecord``, a record under
activation checkpointing).

Each method is declared (no ``__getattr__``): together they are the union of the kinds'
read protocols (``AttentionReads``, ``RecurrentReads``, ``LatentReads`` in
``longstraw_core.kinds.base``), so a read an adapter starts to make must be added here.
This module imports nothing of the package: ``longstraw_core.offload`` and the kinds use it.
"""

from __future__ import annotations

from typing import Any

import torch


class ForwardedReads:
    """Every kind's reads, forwarded to ``_reads_target()``; writes are the subclass's."""

    def _reads_target(self) -> Any:
        raise NotImplementedError

    @property
    def kind(self) -> str:
        return self._reads_target().kind

    @property
    def length(self) -> int:
        return self._reads_target().length

    def reading(self) -> Any:
        """The record whose tensors the reads return."""
        return self._reads_target().reading()

    # full attention (``AttentionReads``)

    @property
    def keeps_outputs(self) -> bool:
        return self._reads_target().keeps_outputs

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._reads_target().segments(end)

    def grad_segments(
        self, end: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return self._reads_target().grad_segments(end)

    def output_for(self, start: int, length: int) -> Any:
        return self._reads_target().output_for(start, length)

    # Gated DeltaNet (``RecurrentReads``)

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._reads_target().read(start)

    # MLA + DSA (``LatentReads``)

    def latent_prefix(self, end: int) -> torch.Tensor:
        return self._reads_target().latent_prefix(end)

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        return self._reads_target().index_key_prefix(end)

    def latent_grad(self, end: int) -> torch.Tensor | None:
        return self._reads_target().latent_grad(end)


class StreamedRecord(ForwardedReads):
    """An offloaded record during one layer of a pass: reads (the kinds' declared reads,
    ``ForwardedReads``) come from its device copy, writes (a prefill chunk's) go to its home
    in CPU memory."""

    def __init__(self, local: Any, home: Any) -> None:
        self._local, self._home = local, home

    def _reads_target(self) -> Any:
        if self._local is None:
            raise RuntimeError(f"a streamed {type(self._home).__name__} was read after release")
        return self._local

    def reading(self) -> Any:
        """The device copy this layer reads (``LayerState.reading``)."""
        return self._reads_target()

    def with_record(self, copy: Any) -> StreamedRecord:
        """The same home reading ``copy`` instead (``LayerState.with_record``)."""
        return StreamedRecord(copy, self._home)

    def write(self, *args: Any) -> None:
        self._home.write(*args)

    def update(self, *args: Any) -> None:
        self._home.update(*args)

    def write_output(self, *args: Any) -> None:
        self._home.write_output(*args)

    def release(self) -> None:
        self._local = None
