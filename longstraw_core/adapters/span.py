"""``Span``: where a run of tokens sits in the prefix state (a prefill chunk or a branch).

Its own module: the adapter base, its staged passes and the families all speak of spans, and
the staged passes are a base of the adapter, so neither can import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
