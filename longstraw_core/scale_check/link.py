"""A ``StageLink`` for one stage run alone on fake tensors: sends are dropped, receives
return fake tensors shaped like what the neighbour would have sent.

Why: a dry run measures one pipeline stage at a time, with no other ranks. The stage's own
code (``model_adapters.staged``, the 1F1B schedule) runs unchanged; only the wire is fake:

- a forward receive returns empty tensors with the shapes and dtypes the previous stage
  sent (``incoming``: that stage's ``sent_forward`` log, run before this one);
- a backward receive returns the gradient of what this stage sent forward with autograd,
  in send order (1F1B's backwards come in the order of their forwards);
- broadcasts from the last stage return tensors shaped like ``like`` (or the value itself
  on the last stage), and picklable results a stand-in ``objects`` gives.

Sent tensors stay referenced as long as a real ``isend`` keeps them (``_MAX_IN_FLIGHT``),
so the memory they hold is counted like a real run's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longstraw_core.pipeline import transport
from longstraw_core.pipeline.transport import Message, StageLink

# (shape, dtype) of each tensor of a message, None for a None entry
Shape = tuple[tuple[int, ...], torch.dtype] | None


@dataclass
class FakeStageLink(StageLink):
    """Stage ``stage`` of ``len(ranks)`` with nobody on the other end (see the module)."""

    incoming: Sequence[tuple[Shape, ...]] = ()
    objects: Callable[[], object] | None = None
    sent_forward: list[tuple[Shape, ...]] = field(default_factory=list)
    _awaiting_grad: deque[Message] = field(default_factory=deque)

    def _send(self, peer: int, direction: int, tensors: Message) -> None:
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors)
        if direction == transport._FORWARD:
            self.sent_forward.append(shapes)
            if tensors and tensors[0] is not None and tensors[0].requires_grad:
                self._awaiting_grad.append(tensors)
        self._sent[direction] += 1
        payload = [t.detach() for t in tensors if t is not None]
        self._pending.append(([], payload))
        while len(self._pending) > transport._MAX_IN_FLIGHT:
            self._pending.popleft()

    def _recv(self, peer: int, direction: int) -> Message:
        sequence = self._received[direction]
        self._received[direction] += 1
        if direction == transport._BACKWARD:
            sent = self._awaiting_grad.popleft()
            return (torch.empty_like(sent[0]),)
        if sequence >= len(self.incoming):
            raise RuntimeError(
                f"stage {self.stage} receives message {sequence} forward, but the previous "
                f"stage's run sent {len(self.incoming)}: run the stages in order"
            )
        return tuple(
            None if s is None else torch.empty(s[0], dtype=s[1], device=self.device)
            for s in self.incoming[sequence]
        )

    def from_last(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if self.is_last:
            assert tensor is not None
            return tensor
        return torch.empty_like(like, device=self.device)

    def objects_from_last(self, value: object) -> object:
        if self.is_last or self.objects is None:
            return value
        return self.objects()
