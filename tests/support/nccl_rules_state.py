"""One rank's emulated NCCL point-to-point streams (the rules are in ``nccl_rules``).

``RankStreams`` keeps, per peer, the in-order queue of this rank's issued entries (a single
op, or a whole ``batch_isend_irecv`` batch), tells the peer when an op reaches the head of
its queue (``ready``), moves an op's data through a private gloo backend once both ends are
at their heads, and completes entries in the background: a completer thread waits for the
gloo transfers, a listener thread (``nccl_rules_wire``) takes the peers' messages, and a
watchdog thread finds hangs and has every rank's pending ops printed.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
import traceback
import zlib
from collections import Counter, defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from nccl_rules_wire import Wire

# Seconds a rank whose main thread is not in a harness wait keeps running after a hang was
# reported (its output flushed) before it exits; a rank in a harness wait raises at once.
EXIT_GRACE = 10.0
# The watchdog's verdict waits for every rank to have made no progress for this share of
# the timeout, so that a message still in flight is never taken for a hang.
GRACE_SHARE = 0.5
# With no proof that every rank is blocked (a rank may be computing, or stuck where the
# harness cannot see), a wait is reported anyway after this many timeouts.
HARD_LIMIT_TIMEOUTS = 3

# Entries of a queue a report shows (from the head): the hang is at the heads.
SHOWN_ENTRIES = 4

Key = tuple[str, int, int, int]  # (group name, source rank, destination rank, sequence number)
Meta = tuple[str, tuple[int, ...]]  # (dtype, shape)


class NcclRulesError(RuntimeError):
    """A point-to-point pattern that NCCL would hang on or misroute."""


@dataclass(eq=False)
class Op:
    """One send or receive, numbered per (group, source, destination) in issue order."""

    kind: str  # "send" | "recv"
    src: int
    dst: int
    group_name: str
    seq: int
    tensor: torch.Tensor  # the caller's tensor (as gloo sees it: complex as real pairs)
    wire: torch.Tensor  # the contiguous buffer gloo reads or fills
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
        return (str(self.tensor.dtype).removeprefix("torch."), tuple(self.tensor.shape))

    def describe(self) -> str:
        what = "send to" if self.kind == "send" else "recv from"
        dtype, shape = self.meta
        return f"{what} rank {self.peer} #{self.seq} {dtype}{list(shape)} (group {self.group_name})"


@dataclass(eq=False)
class Entry:
    """What one call issued: it leaves every queue it is in when all its ops are done."""

    label: str  # the torch.distributed function that issued it
    ops: list[Op]
    issued: float = field(default_factory=time.monotonic)
    remaining: int = 0
    error: BaseException | None = None
    done: bool = False
    futures: list[torch.futures.Future] = field(default_factory=list)

    @property
    def peers(self) -> list[int]:
        return list(dict.fromkeys(op.peer for op in self.ops))


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


def mismatch(send: Op | Meta, recv: Op | Meta, key: Key) -> str | None:
    """The error for a matched send/receive pair that differ in dtype or element count."""
    group, src, dst, seq = key
    send_meta = send.meta if isinstance(send, Op) else send
    recv_meta = recv.meta if isinstance(recv, Op) else recv
    (send_dtype, send_shape), (recv_dtype, recv_shape) = send_meta, recv_meta
    if send_dtype == recv_dtype and _numel(send_shape) == _numel(recv_shape):
        return None
    return (
        f"NCCL rules: send #{seq} from rank {src} to rank {dst} (group {group}) is "
        f"{send_dtype}{list(send_shape)} but the receive it meets on rank {dst} is "
        f"{recv_dtype}{list(recv_shape)}: NCCL ignores tags and pairs the n-th send from a "
        f"rank with the n-th receive from it, so both ranks must issue their transfers "
        f"between them in the same order"
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class RankStreams:
    """This rank's side of every rank pair. All state is guarded by ``_cond``."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = store
        self._cond = threading.Condition()
        self._queues: dict[int, deque[Entry]] = defaultdict(deque)
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._ops: dict[Key, Op] = {}  # issued, not done
        self._ready: dict[Key, Meta] = {}  # peers' ops at their heads, not yet met here
        self._open: Counter[str] = Counter()  # uncompleted ops per group
        # thread id -> (what it waits in, since, whether inside gloo rather than a harness wait)
        self._blocked: dict[int, tuple[str, float, bool]] = {}
        self._last_progress = time.monotonic()
        self._gone: set[int] = set()
        self._aborted: NcclRulesError | None = None
        self._answers: dict[int, dict[int, dict]] = {}
        self._requests = itertools.count()
        self._stop = threading.Event()
        self._completions: queue.SimpleQueue = queue.SimpleQueue()

        self._wire = Wire(rank, world_size, self._on_message, self._on_gone)
        host, port = self._wire.address
        store.set(f"address/{rank}", f"{host}:{port}")
        # Constructing the backend waits for every rank (a rendezvous through the store).
        self._data = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store), rank, world_size, timedelta(minutes=30)
        )
        peers = {}
        for peer in range(world_size):
            if peer != rank:
                peer_host, peer_port = store.get(f"address/{peer}").decode().rsplit(":", 1)
                peers[peer] = (peer_host, int(peer_port))
        self._wire.start(peers)
        self._threads = [
            threading.Thread(target=self._complete, name="nccl-rules-completer", daemon=True),
            threading.Thread(target=self._watch, name="nccl-rules-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop the threads and close the connections (pending ops are dropped)."""
        self._stop.set()
        self._completions.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._wire.close()
        self._data = None  # type: ignore[assignment]

    # --- issuing and waiting ------------------------------------------------------------

    def issue(self, label: str, ops: list[tuple[str, int, str, torch.Tensor]]) -> Entry:
        """Queue one entry of ``(kind, peer, group name, tensor)`` ops; numbers them."""
        built = []
        for kind, peer, group_name, tensor in ops:
            if peer == self.rank:
                raise NcclRulesError(
                    f"NCCL rules: rank {self.rank} {label} to itself is not emulated"
                )
            seen, buffer = wire_tensor(tensor, kind)
            src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
            built.append(Op(kind, src, dst, group_name, 0, seen, buffer))
        entry = Entry(label, built, remaining=len(built))
        with self._cond:
            self._raise_if_aborted()
            for op in built:
                count = (op.group_name, op.peer, op.kind)
                op.seq = self._counts[count]
                self._counts[count] += 1
                op.entry = entry
                self._ops[op.key] = op
                self._open[op.group_name] += 1
            self._last_progress = time.monotonic()
            for peer in entry.peers:
                self._queues[peer].append(entry)
            for peer in entry.peers:
                if self._queues[peer][0] is entry:
                    self._reach_head(entry, peer)
        return entry

    def wait(self, entry: Entry, what: str, timeout: float | None = None) -> None:
        """Block until ``entry`` is done (NCCL's ``work.wait``); raise its error."""
        with self._cond:
            if not entry.done:
                deadline = None if timeout is None else time.monotonic() + timeout
                with self._blocking(what):
                    while not entry.done:
                        self._raise_if_aborted()
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise RuntimeError(f"NCCL rules: {what} timed out after {timeout} s")
                        self._cond.wait(1.0 if left is None else min(left, 1.0))
            if entry.error is not None:
                raise entry.error

    def future(self, entry: Entry) -> torch.futures.Future:
        """A future completed with the entry (``work.get_future()``)."""
        future: torch.futures.Future = torch.futures.Future()
        with self._cond:
            if entry.done:
                _settle(future, entry)
            else:
                entry.futures.append(future)
        return future

    @contextmanager
    def collective(self, name: str, group_name: str) -> Iterator[None]:
        """Around a collective on ``group_name``: first wait for this rank's uncompleted
        point-to-point ops on that group (NCCL runs them on the group's stream before it),
        then count as blocked in the collective while it runs."""
        with self._cond:
            if self._open[group_name]:
                what = (
                    f"{name} on group {group_name}, which first waits for this rank's "
                    f"{self._open[group_name]} uncompleted point-to-point ops on that group"
                )
                with self._blocking(what):
                    while self._open[group_name]:
                        self._raise_if_aborted()
                        self._cond.wait(1.0)
            thread = threading.get_ident()
            self._blocked[thread] = (
                f"{name} on group {group_name} (in gloo)",
                time.monotonic(),
                True,
            )
        try:
            yield
        finally:
            with self._cond:
                self._blocked.pop(thread, None)

    @contextmanager
    def _blocking(self, what: str) -> Iterator[None]:
        thread = threading.get_ident()
        self._blocked[thread] = (what, time.monotonic(), False)
        try:
            yield
        finally:
            self._blocked.pop(thread, None)

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise self._aborted

    # --- matching (every method below runs under self._cond) -----------------------------

    def _reach_head(self, entry: Entry, peer: int) -> None:
        """``entry`` is now first in the queue with ``peer``: its ops with that peer may meet
        the peer's, once the peer's are at the head of its own queue too."""
        for op in entry.ops:
            if op.peer == peer and not op.at_head:
                op.at_head = True
                if not self._wire.send(peer, ("ready", op.key, op.meta)):
                    self._gone.add(peer)
                self._match(op)

    def _match(self, op: Op) -> None:
        if not op.at_head or op.posted or op.done or op.key not in self._ready:
            return
        other = self._ready.pop(op.key)
        pair = (op, other) if op.kind == "send" else (other, op)
        error = mismatch(*pair, op.key)
        if error is not None:
            self._finish(op, NcclRulesError(error))
            return
        group_id = zlib.crc32(op.group_name.encode()) & 0x3FF
        tag = (group_id << 20) | (op.seq & 0xFFFFF)
        if op.kind == "send":
            work = self._data.send([op.wire], op.peer, tag)
        else:
            work = self._data.recv([op.wire], op.peer, tag)
        op.posted = True
        self._completions.put((op, work))

    def _finish(self, op: Op, error: BaseException | None) -> None:
        op.done = True
        self._ops.pop(op.key, None)
        self._open[op.group_name] -= 1
        if not self._open[op.group_name]:
            del self._open[op.group_name]
        self._last_progress = time.monotonic()
        entry = op.entry
        assert entry is not None
        entry.remaining -= 1
        if error is not None and entry.error is None:
            entry.error = error
        if entry.remaining:
            return
        entry.done = True
        for future in entry.futures:
            _settle(future, entry)
        for peer in entry.peers:
            pending = self._queues[peer]
            assert pending[0] is entry, "an entry completed before the ones ahead of it"
            pending.popleft()
            if pending:
                self._reach_head(pending[0], peer)
        self._cond.notify_all()

    # --- background threads -------------------------------------------------------------

    def _complete(self) -> None:
        """Wait for each posted gloo transfer (both ends have agreed to it, so each finishes
        without anything else from this rank) and complete its op."""
        while (item := self._completions.get()) is not None:
            op, work = item
            error = None
            try:
                work.wait()
                if op.kind == "recv" and op.wire is not op.tensor:
                    op.tensor.copy_(op.wire)
            except Exception as exc:  # gloo reports a dead peer as RuntimeError
                error = NcclRulesError(f"NCCL rules: {op.describe()} failed in gloo: {exc}")
            with self._cond:
                self._finish(op, error)

    def _on_message(self, peer: int, message: tuple) -> None:
        try:
            self._take(peer, message)
        except Exception:  # a harness bug must show, not silently stop the listener
            traceback.print_exc()

    def _take(self, peer: int, message: tuple) -> None:
        with self._cond:
            if message[0] == "ready":
                _, key, meta = message
                self._ready[key] = meta
                self._last_progress = time.monotonic()
                if key in self._ops:
                    self._match(self._ops[key])
            elif message[0] == "dump?":
                self._wire.send(peer, ("dump", message[1], self._dump()))
            elif message[0] == "dump":
                self._answers.setdefault(message[1], {})[peer] = message[2]
                self._cond.notify_all()
            elif message[0] == "abort":
                _, reporter = message
                self._abort(
                    NcclRulesError(
                        f"NCCL rules: rank {reporter} found a hang this rank is part of "
                        f"(its report, every rank's pending ops, is in the log)"
                    )
                )

    def _on_gone(self, peer: int) -> None:
        with self._cond:
            self._gone.add(peer)
            self._cond.notify_all()

    def _abort(self, error: NcclRulesError) -> None:
        """Fail this rank: a harness wait raises ``error`` now; a main thread elsewhere (in a
        gloo collective, or past an exception it swallowed) ends with the process."""
        if self._aborted is not None:
            return
        self._aborted = error
        self._cond.notify_all()
        main = self._blocked.get(threading.main_thread().ident)
        waiting_here = main is not None and not main[2]
        timer = threading.Timer(EXIT_GRACE if waiting_here else 1.0, _exit_failed)
        timer.daemon = True
        timer.start()

    # --- hangs --------------------------------------------------------------------------

    def _watch(self) -> None:
        interval = max(0.1, min(self.timeout / 4, 5.0))
        next_check = 0.0
        while not self._stop.wait(interval):
            with self._cond:
                main = self._blocked.get(threading.main_thread().ident)
                if self._aborted is not None or main is None:
                    continue
                what, since, _ = main
            waited = time.monotonic() - since
            if waited < self.timeout or time.monotonic() < next_check:
                continue
            report = self._check(what, waited)
            next_check = time.monotonic() + self.timeout * GRACE_SHARE
            if report is None:
                continue
            if self._store.add("reporter", 1) != 1:
                next_check = float("inf")  # another rank reports; its abort reaches this one
                continue
            print(report, file=sys.stderr, flush=True)
            with self._cond:
                for peer in range(self.world_size):
                    if peer != self.rank and peer not in self._gone:
                        self._wire.send(peer, ("abort", self.rank))
                headline = report.strip().splitlines()[0].strip("= ")
                self._abort(NcclRulesError(f"{headline} (report above)"))

    def _check(self, what: str, waited: float) -> str | None:
        """Every rank's state; a report when they are all stuck (or this wait is past the
        hard limit), else None."""
        request = next(self._requests)
        with self._cond:
            asked = [r for r in range(self.world_size) if r != self.rank and r not in self._gone]
            for peer in asked:
                if not self._wire.send(peer, ("dump?", request)):
                    self._gone.add(peer)
            mine = self._dump()
            deadline = time.monotonic() + max(2.0, self.timeout * GRACE_SHARE)
            while time.monotonic() < deadline and not all(
                p in self._answers.get(request, {}) or p in self._gone for p in asked
            ):
                self._cond.wait(deadline - time.monotonic())
            dumps = {self.rank: mine, **self._answers.pop(request, {})}
            gone = set(self._gone)
        grace = self.timeout * GRACE_SHARE
        # A rank that did not answer (its listener starved of the GIL, say) may be running.
        running = [
            r
            for r in range(self.world_size)
            if r not in gone
            and (
                r not in dumps
                or dumps[r]["blocked"] is None
                or dumps[r]["blocked_for"] < grace
                or dumps[r]["idle"] < grace
            )
        ]
        if running and waited < self.timeout * HARD_LIMIT_TIMEOUTS:
            return None
        return _report(self, what, waited, dumps, gone, running)

    def _dump(self) -> dict:
        now = time.monotonic()
        main = self._blocked.get(threading.main_thread().ident)
        lines = []
        for peer in sorted(self._queues):
            pending = self._queues[peer]
            if not pending:
                continue
            entries = f"{len(pending)} {'entry' if len(pending) == 1 else 'entries'}"
            lines.append(f"  with rank {peer}: {entries} in this rank's queue")
            for index, entry in enumerate(pending):
                if index == SHOWN_ENTRIES:
                    lines.append(f"    ... and {len(pending) - index} more entries behind these")
                    break
                place = "head" if index == 0 else f"#{index + 1}"
                others = [p for p in entry.peers if p != peer]
                batch = f" (a batch also with ranks {others})" if others else ""
                for op in entry.ops:
                    if op.peer != peer:
                        continue
                    if op.done:
                        state = "done, its entry waits for the rest of the batch"
                    elif op.posted:
                        state = f"rank {peer} reached it; data moving"
                    elif op.at_head:
                        theirs = "receive" if op.kind == "send" else "send"
                        state = f"waiting for rank {peer} to reach its matching {theirs}"
                    else:
                        state = "behind the head"
                    lines.append(
                        f"    [{place}] {entry.label}: {op.describe()}{batch}, pending "
                        f"{now - entry.issued:.1f} s: {state}"
                    )
        return {
            "blocked": None if main is None else main[0],
            "blocked_for": 0.0 if main is None else now - main[1],
            "idle": now - self._last_progress,
            "lines": lines,
        }


def _report(
    streams: RankStreams,
    what: str,
    waited: float,
    dumps: dict[int, dict],
    gone: set[int],
    running: list[int],
) -> str:
    """The hang report: the verdict, then every rank's state and pending ops. Its first and
    last lines are how ``launch.with_report_last`` finds it in a torchrun log."""
    if not running:
        headline = "NCCL rules: a hang (every rank is blocked; on NCCL this run would never end)"
    else:
        headline = (
            f"NCCL rules: a wait past {HARD_LIMIT_TIMEOUTS} x the timeout while rank(s) "
            f"{sorted(running)} still make progress or wait where the harness cannot see"
        )
    lines = [
        "=" * 20 + f" {headline} " + "=" * 20,
        f"rank {streams.rank} waited {waited:.1f} s in {what} "
        f"(bound: LONGSTRAW_NCCL_RULES_TIMEOUT={streams.timeout:g} s)",
    ]
    for peer in range(streams.world_size):
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
        lines.extend(dump["lines"] or ["  no pending point-to-point ops"])
    lines.append("=" * 20 + " end of the NCCL rules report " + "=" * 20)
    return "\n".join(lines)


def _settle(future: torch.futures.Future, entry: Entry) -> None:
    if entry.error is not None:
        future.set_exception(entry.error)
    else:
        future.set_result([op.tensor for op in entry.ops])


def _exit_failed() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
