"""Point-to-point transfers between neighbouring pipeline stages (``torch.distributed``).

Only hidden states cross stage boundaries: a span's activations (and, for GLM-5.x, the DSA
selection a layer hands to the next) go forward, their gradients go back. Each transfer
is a fixed-size ``int64`` header (how many tensors, and each one's dtype and shape; a
``None`` is allowed) followed by the tensors themselves, so the receiver allocates what
comes without knowing the span in advance.

Tags. Every message carries a tag made from a per-direction sequence number that sender and
receiver count alike (forward to the next stage, backward to the previous), so a message is
matched with the receive meant for it however many are in flight (gloo matches by source and
tag; NCCL ignores tags and keeps the order). Sends are non-blocking (``isend``): a stage
goes on with its next microbatch while the last one travels, which is what lets a pipeline
schedule overlap stages; ``wait`` completes them (the tensors are kept alive until then).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_HEADER_SLOTS = 32
_MAX_TENSORS = 4
_MAX_DIMS = 5
_PER_TENSOR = 2 + _MAX_DIMS  # dtype code, ndim, dims
_DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.bool, torch.uint8,
]  # fmt: skip
_NONE = -1
_FORWARD, _BACKWARD = 0, 1
_TAG_WINDOW = 1 << 20
# Messages kept in flight before a send waits for the oldest: bounds the memory of sent
# tensors (a long prefill would otherwise keep every chunk's hidden states until the end).
_MAX_IN_FLIGHT = 8

Message = tuple[torch.Tensor | None, ...]


@dataclass
class StageLink:
    """One rank's links to the neighbouring stages of its pipeline.

    ``ranks``: the global ranks of the pipeline's stages, in stage order; ``stage``: this
    rank's place in it; ``group``: a process group holding (at least) those ranks, for the
    broadcasts from the last stage. ``device``: where headers and received tensors live.
    """

    ranks: list[int]
    stage: int
    group: dist.ProcessGroup | None
    device: torch.device
    _sent: dict[int, int] = field(default_factory=lambda: {_FORWARD: 0, _BACKWARD: 0})
    _received: dict[int, int] = field(default_factory=lambda: {_FORWARD: 0, _BACKWARD: 0})
    _pending: deque[tuple[list[dist.Work], Sequence[torch.Tensor]]] = field(default_factory=deque)

    @property
    def stages(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    # --- neighbours ---------------------------------------------------------------------

    def send_forward(self, tensors: Message) -> None:
        """Send to the next stage (non-blocking)."""
        self._send(self.ranks[self.stage + 1], _FORWARD, tensors)

    def recv_forward(self) -> Message:
        """Receive what the previous stage sent forward."""
        return self._recv(self.ranks[self.stage - 1], _FORWARD)

    def send_backward(self, tensors: Message) -> None:
        """Send to the previous stage (non-blocking): gradients of what it sent us."""
        self._send(self.ranks[self.stage - 1], _BACKWARD, tensors)

    def recv_backward(self) -> Message:
        """Receive what the next stage sent back."""
        return self._recv(self.ranks[self.stage + 1], _BACKWARD)

    def wait(self) -> None:
        """Complete every send in flight (their tensors may then be reused or freed)."""
        while self._pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        works, _ = self._pending.popleft()
        for work in works:
            work.wait()

    # --- the whole pipeline -------------------------------------------------------------

    def from_last(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """``tensor`` of the last stage on every stage (``like``: its shape and dtype, for the
        stages that receive it). A collective of the pipeline's group."""
        if self.stages == 1:
            assert tensor is not None
            return tensor
        buffer = tensor if self.is_last else torch.empty_like(like, device=self.device)
        assert buffer is not None
        dist.broadcast(buffer.contiguous(), src=self.last_rank, group=self.group)
        return buffer

    def objects_from_last(self, value: object) -> object:
        """A picklable ``value`` of the last stage, on every stage."""
        if self.stages == 1:
            return value
        box = [value if self.is_last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]

    # --- wire format --------------------------------------------------------------------

    def _tag(self, direction: int, sequence: int, part: int) -> int:
        return ((sequence % _TAG_WINDOW) * 2 + direction) * (_MAX_TENSORS + 1) + part

    def _send(self, peer: int, direction: int, tensors: Message) -> None:
        if len(tensors) > _MAX_TENSORS:
            raise ValueError(f"a stage sends at most {_MAX_TENSORS} tensors, got {len(tensors)}")
        sequence = self._sent[direction]
        self._sent[direction] += 1
        header = torch.full((_HEADER_SLOTS,), _NONE, dtype=torch.int64)
        header[0] = len(tensors)
        payload = []
        for index, tensor in enumerate(tensors):
            base = 1 + index * _PER_TENSOR
            if tensor is None:
                continue
            if tensor.dim() > _MAX_DIMS:
                raise ValueError(f"a stage sends tensors of at most {_MAX_DIMS} dimensions")
            header[base] = _DTYPES.index(tensor.dtype)
            header[base + 1] = tensor.dim()
            header[base + 2 : base + 2 + tensor.dim()] = torch.tensor(tensor.shape)
            payload.append(tensor.detach().contiguous())
        header = header.to(self.device)
        works = [dist.isend(header, peer, tag=self._tag(direction, sequence, 0))]
        for part, tensor in enumerate(payload, start=1):
            works.append(dist.isend(tensor, peer, tag=self._tag(direction, sequence, part)))
        self._pending.append((works, [header, *payload]))
        while len(self._pending) > _MAX_IN_FLIGHT:
            self._wait_oldest()

    def _recv(self, peer: int, direction: int) -> Message:
        sequence = self._received[direction]
        self._received[direction] += 1
        header = torch.empty(_HEADER_SLOTS, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, tag=self._tag(direction, sequence, 0))
        fields = header.tolist()
        received: list[torch.Tensor | None] = []
        part = 1
        for index in range(fields[0]):
            base = 1 + index * _PER_TENSOR
            if fields[base] == _NONE:
                received.append(None)
                continue
            shape = fields[base + 2 : base + 2 + fields[base + 1]]
            tensor = torch.empty(shape, dtype=_DTYPES[fields[base]], device=self.device)
            dist.recv(tensor, peer, tag=self._tag(direction, sequence, part))
            received.append(tensor)
            part += 1
        return tuple(received)
