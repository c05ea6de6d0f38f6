"""Chunk-start checkpoints of a fixed-size record: the state at every prefill chunk's start,
which exact mode's reverse sweep restarts chunks from (a fixed-size state is overwritten as
prefill goes on, so the sweep cannot read it back otherwise).

``ChunkCheckpoints`` holds what the kinds keeping such a state (``kinds.window``'s
``WindowKV``, ``kinds.recurrent``'s ``RecurrentState``) share, so they answer the
``LayerState`` checkpoint calls one way: keep, look up and count the checkpoints.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from longstraw_core.kinds.base import RecordBase, tensor_nbytes
from longstraw_core.tensors.pinned import pinned_copy


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; pinned when it goes from pinned memory to the CPU
    (offloaded checkpoints stream to the device like the state)."""
    if device.type == "cpu" and tensor.device.type == "cpu" and tensor.is_pinned():
        return pinned_copy(tensor)  # exactly sized, not the caching host allocator's
    return tensor.to(device, copy=True)


class ChunkCheckpoints(RecordBase):
    """``RecordBase`` for a record whose state is a pair of fixed-size tensors, with the
    state at each chunk start kept when ``checkpoint_device`` is set.

    The deriving dataclass declares the fields named here (so that its constructor, fields
    and ``vars`` stay its own) and ``state_name``, which its errors say.
    """

    state_name: ClassVar[str]

    length: int
    checkpoint_device: torch.device | None
    checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def check_order(self, start: int, count: int) -> None:
        """Raise unless a chunk of ``count`` positions at ``start`` follows the last one:
        the state folds chunks in order, and exact mode's sweep relies on it."""
        if start != self.length:
            raise RuntimeError(
                f"prefill wrote positions {start}..{start + count} into a {self.state_name} "
                f"holding {self.length} positions; chunks must be written in order"
            )

    def keep_checkpoint(self, start: int, first: torch.Tensor, second: torch.Tensor) -> None:
        """Keep copies of the state at ``start`` (before a chunk overwrites it) when
        checkpoints are asked for (``keep_checkpoints``)."""
        if self.checkpoint_device is not None:
            self.checkpoints[start] = (
                copy_to(first, self.checkpoint_device),
                copy_to(second, self.checkpoint_device),
            )

    def checkpoint(
        self, start: int, devices: tuple[torch.device, torch.device]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state kept at chunk start ``start``, moved to ``devices`` (the state's own);
        an error naming the kept starts if there is none there."""
        if start in self.checkpoints:
            first, second = self.checkpoints[start]
            return first.to(devices[0]), second.to(devices[1])
        raise RuntimeError(
            f"no {self.state_name} at position {start} (state holds {self.length} positions and "
            f"checkpoints at {sorted(self.checkpoints)}); prefill with checkpoints for exact mode"
        )

    def checkpoint_nbytes(self) -> int:
        return sum(tensor_nbytes(a) + tensor_nbytes(b) for a, b in self.checkpoints.values())

    def summary_bytes(self) -> dict[str, int]:
        return {"checkpoint_bytes": self.checkpoint_nbytes()}

    def keep_checkpoints(self, device: torch.device) -> None:
        self.checkpoint_device = device

    def needs_checkpoints(self) -> bool:
        return bool(self.length and not self.checkpoints)
