"""``Rows``: a ragged decode step, each branch of the batch at its own position.

Here, below the adapters, because the branch records of every kind read it (``Span.rows``).
Everything a record needs is worked out once per step on the host (``Rows.build``), so the
layers index with ready tensors and never wait on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """A ragged decode step of ``T`` inputs per row.

    ``offsets`` ``[B]``: branch positions each row has run so far; ``counts`` ``[B]``: how many
    of the step's ``T`` inputs are the row's (the rest pad it to ``T``; ``0``: the row sits
    the step out, e.g. while its tool runs). A row's input ``t`` sits at branch position
    ``offsets + t``; its padding is computed but never kept (records take the first
    ``counts`` inputs only) and its outputs are ignored. ``kept_rows``/``kept_inputs``/
    ``kept_slots`` ``[N]``: each kept input's row, index in the step and branch slot;
    ``most``: the largest offset; ``read``: branch slots the step's attention reads;
    ``prefix``: the prefix's positions (a branch's position 0 sits at ``prefix``).
    """

    offsets: torch.Tensor
    counts: torch.Tensor
    kept_rows: torch.Tensor
    kept_inputs: torch.Tensor
    kept_slots: torch.Tensor
    most: int
    read: int
    prefix: int

    @classmethod
    def build(
        cls,
        offsets: Sequence[int],
        counts: Sequence[int],
        length: int,
        capacity: int,
        prefix: int,
        device: torch.device,
    ) -> Rows:
        """The step for rows at ``offsets`` taking ``counts`` of ``length`` inputs, in
        branch records of ``capacity`` positions (every row's end must fit)."""
        if len(offsets) != len(counts):
            raise ValueError(f"{len(counts)} counts for {len(offsets)} rows")
        if any(count < 0 or count > length for count in counts):
            raise ValueError(f"counts {list(counts)} must lie in [0, {length}]")
        ends = [offset + count for offset, count in zip(offsets, counts, strict=True)]
        if max(ends, default=0) > capacity:
            raise RuntimeError(
                f"branch cache holds {capacity} positions per branch; this step would run "
                f"branch {ends.index(max(ends))} to {max(ends)}"
            )
        kept = [(row, t) for row, count in enumerate(counts) for t in range(count)]
        rows = [row for row, _ in kept]
        inputs = [t for _, t in kept]
        as_long = {"dtype": torch.long, "device": device}
        most = max(offsets, default=0)
        return cls(
            offsets=torch.tensor(list(offsets), **as_long),
            counts=torch.tensor(list(counts), **as_long),
            kept_rows=torch.tensor(rows, **as_long),
            kept_inputs=torch.tensor(inputs, **as_long),
            kept_slots=torch.tensor([offsets[r] + t for r, t in kept], **as_long),
            most=most,
            read=min(capacity, most + length),
            prefix=prefix,
        )

    def query_positions(self, length: int) -> torch.Tensor:
        """Branch position of each row's ``length`` inputs, ``[B, length]``."""
        return self.offsets[:, None] + torch.arange(length, device=self.offsets.device)
