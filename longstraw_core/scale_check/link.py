"""A ``StageLink`` for one stage run alone on fake tensors: sends are dropped, receives
return fake tensors shaped as the schedule's plan says the neighbour sends.

Why: a dry run measures one pipeline stage at a time, with no other ranks. The stage's own
code (``longstraw_core.adapters.staged_forward`` and ``staged_backward``, the schedules' programs) runs unchanged; only the wire is
fake: an exchange keeps what it sends until it is waited for (as a real one does, so the
memory it holds is counted like a real run's) and returns empty tensors of the planned
shapes; rollout's stop signal never stops early (a dry run's fake tokens never end a
response); broadcasts from the last stage return tensors shaped like ``like`` (or the value
itself on the last stage), and picklable results a stand-in ``objects`` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from longstraw_core.pipeline.transport import (
    MessageShapeError,
    MessageSpec,
    Payload,
    PendingExchange,
    StageLink,
    spec_of,
)


@dataclass
class FakeStageLink(StageLink):
    """Stage ``stage`` of ``len(ranks)`` with nobody on the other end (see the module)."""

    objects: Callable[[], object] | None = None

    def exchange(
        self,
        sends: Sequence[tuple[int, Payload, MessageSpec]],
        recvs: Sequence[tuple[int, MessageSpec]],
    ) -> PendingExchange:
        sent = []
        for stage, payload, spec in sends:
            if spec_of(payload) != spec:
                raise MessageShapeError(
                    f"stage {self.stage} would send stage {stage} tensors {spec_of(payload)} "
                    f"where the schedule's plan says {spec}"
                )
            sent += [t.detach() for t in payload if t is not None]
        received = [_empty(spec, self.device) for _, spec in recvs]
        self.exchanges += 1
        return PendingExchange([], sent, received)

    def signal_any(self, flags: torch.Tensor, every_replica: bool = False) -> list[int]:
        return [1] + [0] * (len(flags) - 1)  # go on; nothing non-finite

    def from_last(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if self.is_last:
            assert tensor is not None
            return tensor
        return torch.empty_like(like, device=self.device)

    def objects_from_last(self, value: object) -> object:
        if self.is_last or self.objects is None:
            return value
        return self.objects()


def _empty(spec: MessageSpec, device: torch.device) -> Payload:
    return tuple(None if s is None else torch.empty(s[0], dtype=s[1], device=device) for s in spec)


def _empty(spec: MessageSpec, device: torch.device) -> Payload:
    return tuple(None if s is None else torch.empty(s[0], dtype=s[1], device=device) for s in spec)
