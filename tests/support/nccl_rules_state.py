"""One rank's emulated NCCL streams (the rules are in ``nccl_rules``; what a stream holds, and
the hang report, in ``nccl_rules_streams``).

``RankStreams`` keeps this rank's in-order streams (one per group and peer for unbatched ops;
one per group for its batches and collectives), tells the peer when an op reaches the head
of its stream (``ready``), moves an op's data through a private gloo backend once both ends
are at their heads, and completes entries in the background: a completer thread waits for
the gloo transfers, a listener thread (``nccl_rules_wire``) takes the peers' messages, and a
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
from datetime import timedelta

import torch
import torch.distributed as dist
from nccl_rules_streams import (
    Entry,
    Key,
    Meta,
    NcclRulesError,
    Op,
    Stream,
    mismatch,
    report,
    settle,
    stream_lines,
    wire_tensor,
)
from nccl_rules_wire import Wire

__all__ = ["Entry", "NcclRulesError", "RankStreams"]

# Seconds a rank whose main thread is not in a harness wait keeps running after a hang was
# reported (its output flushed) before it exits; a rank in a harness wait raises at once.
EXIT_GRACE = 10.0
# The watchdog's verdict waits for every rank to have made no progress for this share of
# the timeout, so that a message still in flight is never taken for a hang.
GRACE_SHARE = 0.5
# With no proof that every rank is blocked (a rank may be computing, or stuck where the
# harness cannot see), a wait is reported anyway after this many timeouts.
HARD_LIMIT_TIMEOUTS = 3


def gloo_tag(key: Key) -> int:
    """The tag of ``key``'s transfer on the data backend: unique among the transfers in flight
    between two ranks (several groups' streams move at once). Group names are torch's
    numbers (a hash only for ``use_local_synchronization`` groups); 11 bits of the group and
    20 of the sequence number keep it a positive C ``int``."""
    group, _, _, seq = key
    number = int(group) if group.isdigit() else zlib.crc32(group.encode())
    return ((number & 0x7FF) << 20) | (seq & 0xFFFFF)


class RankStreams:
    """This rank's streams (``nccl_rules_streams``). All state is guarded by ``_cond``."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = store
        self._cond = threading.Condition()
        self._streams: dict[Stream, deque[Entry]] = defaultdict(deque)
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._ops: dict[Key, Op] = {}  # issued, not done
        self._ready: dict[Key, Meta] = {}  # peers' ops at their heads, not yet met here
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

    def issue(
        self, label: str, ops: list[tuple[str, int, str, torch.Tensor]], batched: bool
    ) -> Entry:
        """Queue one entry of ``(kind, peer, group name, tensor)`` ops (all on one group; one
        op unless ``batched``) on its stream; numbers them."""
        built = []
        for kind, peer, group_name, tensor in ops:
            if peer == self.rank:
                raise NcclRulesError(
                    f"NCCL rules: rank {self.rank} {label} to itself is not emulated"
                )
            seen, buffer = wire_tensor(tensor, kind)
            src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
            built.append(Op(kind, src, dst, group_name, 0, seen, buffer, batched))
        group = built[0].group_name
        stream: Stream = (group, None) if batched else (group, built[0].peer)
        entry = Entry(label, built, stream, remaining=len(built))
        with self._cond:
            self._raise_if_aborted()
            for op in built:
                count = (op.group_name, op.peer, op.kind)
                op.seq = self._counts[count]
                self._counts[count] += 1
                op.entry = entry
                self._ops[op.key] = op
            self._last_progress = time.monotonic()
            pending = self._streams[stream]
            pending.append(entry)
            if pending[0] is entry:
                self._reach_head(entry)
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
                settle(future, entry)
            else:
                entry.futures.append(future)
        return future

    @contextmanager
    def collective(self, name: str, group_name: str) -> Iterator[None]:
        """Around a collective on ``group_name``: it joins the group's stream of batches and
        collectives, first waits for this rank's batches ahead of it there (NCCL runs them on
        that stream before it; another thread's collective ahead does not hold it), counts as
        blocked in the collective while it runs, and holds the batches issued behind it."""
        stream: Stream = (group_name, None)
        entry = Entry(name, [], stream, collective=True)
        thread = threading.get_ident()
        with self._cond:
            self._raise_if_aborted()
            pending = self._streams[stream]
            pending.append(entry)
            try:
                ahead = self._batches_ahead(entry)
                if ahead:
                    what = (
                        f"{name} on group {group_name}, which first waits for this rank's "
                        f"{ahead} uncompleted {'batch' if ahead == 1 else 'batches'} "
                        f"ahead of it on that group's stream"
                    )
                    with self._blocking(what):
                        while self._batches_ahead(entry):
                            self._raise_if_aborted()
                            self._cond.wait(1.0)
            except BaseException:
                self._leave(entry)
                raise
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
                self._last_progress = time.monotonic()
                self._leave(entry)

    def _batches_ahead(self, entry: Entry) -> int:
        ahead = 0
        for other in self._streams[entry.stream]:
            if other is entry:
                return ahead
            ahead += not other.collective
        raise AssertionError("a collective's entry left its stream before it returned")

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

    def _reach_head(self, entry: Entry) -> None:
        """``entry`` is now first in its stream: its ops may meet the peers', once those are
        at the head of their own streams too (a collective's thread is told by the notify)."""
        for op in entry.ops:
            if not op.at_head:
                op.at_head = True
                if not self._wire.send(op.peer, ("ready", op.key, op.meta)):
                    self._gone.add(op.peer)
                self._match(op)
        self._cond.notify_all()

    def _match(self, op: Op) -> None:
        if not op.at_head or op.posted or op.done or op.key not in self._ready:
            return
        other = self._ready.pop(op.key)
        pair = (op, other) if op.kind == "send" else (other, op)
        error = mismatch(*pair, op.key)
        if error is not None:
            self._finish(op, NcclRulesError(error))
            return
        tag = gloo_tag(op.key)
        if op.kind == "send":
            work = self._data.send([op.wire], op.peer, tag)
        else:
            work = self._data.recv([op.wire], op.peer, tag)
        op.posted = True
        self._completions.put((op, work))

    def _finish(self, op: Op, error: BaseException | None) -> None:
        op.done = True
        self._ops.pop(op.key, None)
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
            settle(future, entry)
        assert self._streams[entry.stream][0] is entry, "an entry completed before its head"
        self._leave(entry)

    def _leave(self, entry: Entry) -> None:
        """Take ``entry`` out of its stream (a batch from its head; a collective from
        wherever it is); the entry now first reaches the head."""
        pending = self._streams[entry.stream]
        was_head = pending[0] is entry
        pending.remove(entry)
        if was_head and pending:
            self._reach_head(pending[0])
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
        return report(
            self.rank, self.timeout, HARD_LIMIT_TIMEOUTS, what, waited, dumps,
            self.world_size, gone, running,
        )  # fmt: skip

    def _dump(self) -> dict:
        now = time.monotonic()
        main = self._blocked.get(threading.main_thread().ident)
        streams = {stream: list(pending) for stream, pending in self._streams.items()}
        return {
            "blocked": None if main is None else main[0],
            "blocked_for": 0.0 if main is None else now - main[1],
            "idle": now - self._last_progress,
            "lines": stream_lines(streams, now),
        }


def _exit_failed() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
