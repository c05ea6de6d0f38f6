"""``Span``: where a run of tokens sits in the prefix state (a prefill chunk or a branch).

Its own module: the adapter base, its staged passes and the families all speak of spans, and
the staged passes are a base of the adapter, so neither can import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_core.kinds.rows import Rows

__all__ = ["Rows", "Span"]


@dataclass(frozen=True)
class Span:
    """Where a run of tokens sits: its first position, and whether it extends the state.

    ``write=True`` is a prefill chunk: its keys/values are written into the state and it
    attends to the state before ``start``. ``write=False`` is a branch: it attends to the
    whole state and leaves it untouched. ``rows`` (decode only): a ragged step, each row at
    its own branch position; ``start`` is then at least the furthest row's (``prefix +
    rows.most``), so ``start + length`` still bounds every position of the span.
    """

    start: int
    length: int
    write: bool
    rows: Rows | None = None

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """``[1, T]``, or ``[B, T]`` for a ragged step."""
        if self.rows is not None:
            return (self.rows.prefix + self.rows.query_positions(self.length)).to(device)
        return torch.arange(self.start, self.start + self.length, device=device)[None]
