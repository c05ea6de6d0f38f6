"""What one rank's emulated NCCL streams hold, and how a hang report shows them (the rules are
in ``nccl_rules``; ``nccl_rules_state.RankStreams`` runs them).

A rank has one in-order stream per communicator ProcessGroupNCCL would use:

- ``(group, peer)``: the unbatched ops (``isend``, ``irecv``, ``send``, ``recv``) between
  this rank and ``peer`` on ``group``, which NCCL runs on the pair's own two-rank
  communicator (keyed ``"rankA:rankB"``);
- ``(group, None)``: the group's device communicator, which runs every
  ``batch_isend_irecv`` batch on ``group`` (coalesced, whatever its peers) and the group's
  collectives, one after another in issue order.

Each entry (one op, one batch, or a collective) sits in exactly one stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

Key = tuple[str, int, int, int]  # (group name, source rank, destination rank, sequence number)
Meta = tuple[str, tuple[int, ...], bool]  # (dtype, shape, batched)
Stream = tuple[str, int | None]  # (group name, peer), or (group name, None): batches+collectives

# Entries of a stream a report shows (from the head): the hang is at the heads.
SHOWN_ENTRIES = 4


class NcclRulesError(RuntimeError):
    """A point-to-point pattern that NCCL would hang on or misroute."""


@dataclass(eq=False)
class Op:
    """One send or receive, numbered per (group, source, destination) in issue order, over
    batched and unbatched ops alike (a batched op meeting an unbatched one is an error)."""

    kind: str  # "send" | "recv"
    src: int
    dst: int
    group_name: str
    seq: int
    tensor: torch.Tensor  # the caller's tensor (as gloo sees it: complex as real pairs)
    wire: torch.Tensor  # the contiguous buffer gloo reads or fills
    batched: bool = False
    entry: Entry | None = None
    at_head: bool = False
    posted: bool = False
    done: bool = False

    @property
    def peer(self) -> int:
        return self.dst if self.kind == "send" else self.src

    @property
    def key(self) -> Key:
        return (self.group_name, self.src, self.dst, self.seq)

    @property
    def meta(self) -> Meta:
        dtype = str(self.tensor.dtype).removeprefix("torch.")
        return (dtype, tuple(self.tensor.shape), self.batched)

    def describe(self) -> str:
        what = "send to" if self.kind == "send" else "recv from"
        dtype, shape, _ = self.meta
        return f"{what} rank {self.peer} #{self.seq} {dtype}{list(shape)} (group {self.group_name})"


@dataclass(eq=False)
class Entry:
    """What one call issued (a single op, a whole batch, or a collective, which has no ops):
    it leaves its stream when all its ops are done (a collective: when it returns)."""

    label: str  # the torch.distributed function that issued it
    ops: list[Op]
    stream: Stream
    collective: bool = False
    issued: float = field(default_factory=time.monotonic)
    remaining: int = 0
    error: BaseException | None = None
    done: bool = False
    futures: list[torch.futures.Future] = field(default_factory=list)


def stream_title(stream: Stream) -> str:
    group, peer = stream
    if peer is None:
        return f"group {group}, batches and collectives (the group's communicator)"
    return f"group {group}, unbatched ops with rank {peer} (the pair's communicator)"


def wire_tensor(tensor: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor as gloo sees it, contiguous buffer for the transfer)``: complex tensors travel
    as real pairs (as torch sends them); a strided send is copied now, a strided receive is
    filled through a buffer copied back on completion."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_contiguous():
        return tensor, tensor
    return tensor, tensor.contiguous() if kind == "send" else torch.empty_like(
        tensor, memory_format=torch.contiguous_format
    )


def _how(batched: bool) -> str:
    if batched:
        return "batched (batch_isend_irecv, on the group's communicator)"
    return "unbatched (isend/irecv/send/recv, on the pair's own communicator)"


def mismatch(send: Op | Meta, recv: Op | Meta, key: Key) -> str | None:
    """The error for a matched send/receive pair that differ in kind (batched or not), dtype
    or element count."""
    group, src, dst, seq = key
    send_meta = send.meta if isinstance(send, Op) else send
    recv_meta = recv.meta if isinstance(recv, Op) else recv
    (send_dtype, send_shape, send_batched) = send_meta
    (recv_dtype, recv_shape, recv_batched) = recv_meta
    where = f"send #{seq} from rank {src} to rank {dst} (group {group})"
    if send_batched != recv_batched:
        return (
            f"NCCL rules: {where} is {_how(send_batched)} but the receive it meets on rank "
            f"{dst} is {_how(recv_batched)}: on NCCL the two sit on different communicators "
            f"and never meet (the send would wait forever); issue the transfers between two "
            f"ranks on one group either all batched or all unbatched"
        )
    if send_dtype == recv_dtype and _numel(send_shape) == _numel(recv_shape):
        return None
    return (
        f"NCCL rules: {where} is {send_dtype}{list(send_shape)} but the receive it meets on "
        f"rank {dst} is {recv_dtype}{list(recv_shape)}: NCCL ignores tags and pairs the n-th "
        f"send from a rank with the n-th receive from it, so both ranks must issue their "
        f"transfers between them in the same order"
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def settle(future: torch.futures.Future, entry: Entry) -> None:
    """Complete ``future`` (``work.get_future()``) with ``entry``'s outcome."""
    if entry.error is not None:
        future.set_exception(entry.error)
    else:
        future.set_result([op.tensor for op in entry.ops])


# --- reports -------------------------------------------------------------------------------------


def stream_lines(streams: dict[Stream, list[Entry]], now: float) -> list[str]:
    """The report's lines for one rank's pending entries, stream by stream."""
    lines = []
    for stream in sorted(streams, key=lambda s: (s[0], -1 if s[1] is None else s[1])):
        pending = streams[stream]
        if not pending:
            continue
        entries = f"{len(pending)} {'entry' if len(pending) == 1 else 'entries'}"
        lines.append(f"  {stream_title(stream)}: {entries} in this rank's stream")
        for index, entry in enumerate(pending):
            if index == SHOWN_ENTRIES:
                lines.append(f"    ... and {len(pending) - index} more entries behind these")
                break
            place = "head" if index == 0 else f"#{index + 1}"
            lines.extend(_entry_lines(entry, place, index == 0, now))
    return lines


def _entry_lines(entry: Entry, place: str, head: bool, now: float) -> list[str]:
    pending = f"pending {now - entry.issued:.1f} s"
    if entry.collective:
        state = "running (in gloo)" if head else "waiting for the batches ahead of it"
        return [f"    [{place}] {entry.label}: a collective on group {entry.stream[0]}, "
                f"{pending}: {state}"]  # fmt: skip
    lines = []
    batch = f" (1 of {len(entry.ops)} in its batch)" if len(entry.ops) > 1 else ""
    for op in entry.ops:
        if op.done:
            state = "done, its entry waits for the rest of the batch"
        elif op.posted:
            state = f"rank {op.peer} reached it; data moving"
        elif op.at_head:
            theirs = "receive" if op.kind == "send" else "send"
            state = f"waiting for rank {op.peer} to reach its matching {theirs}"
        else:
            state = "behind the head"
        lines.append(f"    [{place}] {entry.label}: {op.describe()}{batch}, {pending}: {state}")
    return lines


def report(
    rank: int,
    timeout: float,
    hard_limit: int,
    what: str,
    waited: float,
    dumps: dict[int, dict],
    world_size: int,
    gone: set[int],
    running: list[int],
) -> str:
    """The hang report: the verdict, then every rank's state and pending ops. Its first and
    last lines are how ``launch.with_report_last`` finds it in a torchrun log."""
    if not running:
        headline = "NCCL rules: a hang (every rank is blocked; on NCCL this run would never end)"
    else:
        headline = (
            f"NCCL rules: a wait past {hard_limit} x the timeout while rank(s) "
            f"{sorted(running)} still make progress or wait where the harness cannot see"
        )
    lines = [
        "=" * 20 + f" {headline} " + "=" * 20,
        f"rank {rank} waited {waited:.1f} s in {what} "
        f"(bound: LONGSTRAW_NCCL_RULES_TIMEOUT={timeout:g} s)",
    ]
    for peer in range(world_size):
        if peer not in dumps:
            lines.append(
                f"rank {peer}: {'gone (connection closed)' if peer in gone else 'no answer'}"
            )
            continue
        dump = dumps[peer]
        state = (
            "running (not in a harness wait or collective)"
            if dump["blocked"] is None
            else f"blocked {dump['blocked_for']:.1f} s in {dump['blocked']}"
        )
        lines.append(f"rank {peer}: {state}; no progress for {dump['idle']:.1f} s")
        lines.extend(dump["lines"] or ["  no pending point-to-point ops or collectives"])
    lines.append("=" * 20 + " end of the NCCL rules report " + "=" * 20)
    return "\n".join(lines)
