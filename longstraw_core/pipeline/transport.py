"""Point-to-point transfers between the stages of a pipeline (``torch.distributed``).

Only hidden states cross stage boundaries: a span's activations (and, for GLM-5.x, the DSA
selection a layer hands to the next) go forward, their gradients go back, and rollout's
sampled tokens go from the last stage to the first. Every transfer is an ``exchange``: one
``batch_isend_irecv`` of the sends and receives a schedule fused (``schedule.programs``),
following NCCL's rules, which gloo does not enforce:

- **No headers, no tags.** A receive is allocated from the shape the pass's plan gives
  (``MessageSpec``, e.g. ``[1, piece, hidden]`` for a replayed piece), so nothing is read
  back to the host per message, and every op has tag 0: NCCL ignores tags and matches a
  pair's ops by order, which the schedule keeps the same on both sides. A sender checks its
  tensors against the same plan, so a wrong shape is a clear error here, not a hang there.
- **A process group per pair of stages.** On NCCL a ``batch_isend_irecv`` runs on its
  group's device communicator, whose one stream per rank carries all of that group's
  batches, whatever their peers, and its collectives, in issue order. With one group for
  the pipeline a stage's receive from ``s - 1`` would queue behind its send to ``s + 1``
  (and the ring rollout with fewer micro-groups than stages hangs at ``S >= 3``:
  ``pipeline.simulate``'s ``ONE_GROUP``). So each pair of stages that talk has a 2-rank
  group of its own (``pair_groups``, made by ``pipeline.mesh.stage_link``), an exchange
  issues one batch per peer, and each pair's ops run on their own in-order stream.
  Collectives (the last stage's results, rollout's stop signal) use ``group`` and the
  default group, other communicators again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# (shape, dtype) of one tensor of a message; None: the message has no tensor there
TensorSpec = tuple[tuple[int, ...], torch.dtype]
MessageSpec = tuple[TensorSpec | None, ...]
Payload = tuple[torch.Tensor | None, ...]


class MessageShapeError(RuntimeError):
    """A stage was about to send something other than what its peer will receive."""


def spec_of(payload: Payload) -> MessageSpec:
    """The spec a payload matches."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in payload)


@dataclass
class PendingExchange:
    """An issued ``batch_isend_irecv``: its works, the tensors it sends (kept alive until it
    completes, as NCCL reads them asynchronously) and the buffers it receives into."""

    works: list[dist.Work]
    sent: list[torch.Tensor]
    received: list[Payload]

    def wait(self) -> list[Payload]:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        return self.received


@dataclass
class StageLink:
    """One rank's links to the other stages of its pipeline.

    ``ranks``: the global ranks of the pipeline's stages, in stage order; ``stage``: this
    rank's place in it; ``group``: a process group holding (at least) those ranks, for the
    collectives of the pipeline (broadcasts from the last stage); ``pair_groups``: the
    2-rank group of each stage this rank exchanges with (a stage not in it: the default
    group; see the module docstring). ``device``: where received tensors live.
    """

    ranks: list[int]
    stage: int
    group: dist.ProcessGroup | None
    device: torch.device
    pair_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    exchanges: int = field(default=0, init=False)  # issued so far (for reports and tests)

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

    # --- point to point ------------------------------------------------------------------

    def exchange(
        self,
        sends: Sequence[tuple[int, Payload, MessageSpec]],
        recvs: Sequence[tuple[int, MessageSpec]],
    ) -> PendingExchange:
        """Issue the exchange: each ``(stage, payload, spec)`` of ``sends`` to that stage
        (checked against ``spec``, the receiver's plan), and each ``(stage, spec)`` of
        ``recvs`` from it, as one batch per peer on that pair's group. Returns at once;
        ``wait()`` completes it and gives the received payloads."""
        ops: dict[int, list[dist.P2POp]] = {}
        sent: list[torch.Tensor] = []
        for stage, payload, spec in sends:
            if spec_of(payload) != spec:
                raise MessageShapeError(
                    f"stage {self.stage} would send stage {stage} tensors {spec_of(payload)} "
                    f"where the schedule's plan says {spec}"
                )
            for tensor in payload:
                if tensor is not None:
                    tensor = tensor.detach().contiguous()
                    sent.append(tensor)
                    ops.setdefault(stage, []).append(self._op(dist.isend, tensor, stage))
        received: list[Payload] = []
        for stage, spec in recvs:
            buffers = tuple(
                None if s is None else torch.empty(s[0], dtype=s[1], device=self.device)
                for s in spec
            )
            for buffer in buffers:
                if buffer is not None:
                    ops.setdefault(stage, []).append(self._op(dist.irecv, buffer, stage))
            received.append(buffers)
        self.exchanges += 1
        works = [work for batch in ops.values() for work in dist.batch_isend_irecv(batch)]
        return PendingExchange(works, sent, received)

    def _op(self, op: Callable, tensor: torch.Tensor, stage: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, self.ranks[stage], self.pair_groups.get(stage))

    # --- the whole pipeline ----------------------------------------------------------------

    def from_last(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """``tensor`` of the last stage on every stage (``like``: its shape and dtype, for the
        stages that receive it). A collective of the pipeline's group."""
        if self.stages == 1:
            assert tensor is not None
            return tensor
        buffer = tensor if self.is_last else torch.empty_like(like, device=self.device)
        assert buffer is not None
        buffer = buffer.contiguous()
        dist.broadcast(buffer, src=self.last_rank, group=self.group)
        return buffer

    def signal_any(self, flags: torch.Tensor, every_replica: bool = False) -> list[int]:
        """The elementwise maximum of ``flags`` over the pipeline's stages, or with
        ``every_replica`` over every rank of the run (replicas that FSDP shards together run
        their passes in step): one ``all_reduce``, which its ranks join at the same point of
        the same schedule (rollout's stop signal)."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=None if every_replica else self.group)
        return flags.tolist()

    def objects_from_last(self, value: object) -> object:
        """A picklable ``value`` of the last stage, on every stage: for Python objects of no
        shape known ahead only (an agent's environments); numbers go as tensors
        (``from_last``), as this pickles and reads the size back to the host."""
        if self.stages == 1:
            return value
        box = [value if self.is_last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]
