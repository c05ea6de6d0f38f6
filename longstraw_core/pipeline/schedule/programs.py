"""Orders -> programs: each stage's exact sequence of exchanges, waits and computes, with one
order of messages per pair of stages (NCCL's rule), and the check that every pair agrees."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from longstraw_core.pipeline.schedule.steps import (
    Collective,
    Compute,
    Drain,
    Exchange,
    Key,
    Message,
    MessageOrderError,
    ScheduleError,
    Step,
    UnitCosts,
    Wait,
)


def programs(
    orders: Sequence[Sequence[Compute]],
    max_open_sends: int | None = None,
    collectives: dict[tuple[int, int], Sequence[Key]] | None = None,
    costs: UnitCosts | None = None,
) -> list[list[Step]]:
    """Each stage's program for ``orders`` (each stage's computes, in the order it runs them).

    **One order per pair of stages.** NCCL runs a pair's ops in the order each side issues
    them, so both sides must issue the messages between them (both directions) in one
    order. It is the order in which their producers finish in a dataflow run of ``orders``
    (``costs``): a stage that needs message ``Y`` before it can produce ``X`` has ``Y``
    first, and so does its peer, for whom ``X`` comes after ``Y`` was produced.

    Before each compute, one ``Exchange`` holds, per peer it receives from, every op of that
    pair's order up to the last message the compute needs (sends among them were produced
    already), then a ``Wait``: waiting for the sends ordered before a needed receive costs
    nothing more (the peer sends after receiving them). The sends that come next in a pair's
    order and are ready go in a second exchange that is not waited for, so no stage waits for
    a peer to take a message it will only need later. With ``max_open_sends``, a ``Wait``
    for the oldest keeps at most that many such exchanges open.
    ``collectives[(stage, i)]``: collectives that stage joins right after issuing the
    exchanges that follow its ``i``-th compute (before waiting for them).
    """
    pair_order = _pair_orders(orders, _dataflow_finish(orders, costs or UnitCosts()))
    result = [
        _build(stage, order, pair_order, max_open_sends, collectives or {})
        for stage, order in enumerate(orders)
    ]
    check_message_order(result)
    return result


def stage_program(
    orders: Sequence[Sequence[Compute]],
    stage: int,
    max_open_sends: int | None = None,
    collectives: dict[tuple[int, int], Sequence[Key]] | None = None,
    costs: UnitCosts | None = None,
) -> list[Step]:
    """Stage ``stage``'s program alone (what its rank runs): ``programs(...)[stage]``, without
    building the others' (their pair orders still come from every stage's order)."""
    pair_order = _pair_orders(orders, _dataflow_finish(orders, costs or UnitCosts()))
    return _build(stage, orders[stage], pair_order, max_open_sends, collectives or {})


def _build(
    stage: int,
    order: Sequence[Compute],
    pair_order: dict[tuple[int, int], list[Message]],
    max_open_sends: int | None,
    collectives: dict[tuple[int, int], Sequence[Key]],
) -> list[Step]:
    builder = _ProgramBuilder(stage, pair_order, max_open_sends)
    for index, compute in enumerate(order):
        if compute.stage != stage:
            raise ScheduleError(f"stage {stage}'s order holds a compute of {compute.stage}")
        waits = builder.issue_for(compute.recv)
        for name in collectives.get((stage, index - 1), ()):
            builder.steps.append(Collective(name))
        if waits:
            builder.steps.append(Wait(waits))
        builder.steps.append(compute)
        builder.produced(compute.send)
    builder.issue_for(())
    for name in collectives.get((stage, len(order) - 1), ()):
        builder.steps.append(Collective(name))
    builder.steps.append(Drain())
    if builder.unsent():
        raise ScheduleError(f"stage {stage} never sends {builder.unsent()}")
    return builder.steps


def _dataflow_finish(orders: Sequence[Sequence[Compute]], costs: UnitCosts) -> dict[Message, float]:
    """When each message's producer finishes, running ``orders`` as soon as messages arrive
    (no transfer rules): what orders each pair's messages. A stage that waits for a message
    is woken when it is produced (linear in the number of computes)."""
    produced: dict[Message, float] = {}
    position = [0] * len(orders)
    clock = [0.0] * len(orders)
    waiting: dict[Message, int] = {}  # a message not yet produced -> the stage waiting for it
    ready = list(range(len(orders)))
    while ready:
        stage = ready.pop()
        order = orders[stage]
        while position[stage] < len(order):
            compute = order[position[stage]]
            missing = next((m for m in compute.recv if m not in produced), None)
            if missing is not None:
                waiting[missing] = stage
                break
            start = max([clock[stage], *(produced[m] for m in compute.recv)])
            clock[stage] = start + (costs.forward if compute.kind == "F" else costs.backward)
            for message in compute.send:
                produced[message] = clock[stage]
                if message in waiting:
                    ready.append(waiting.pop(message))
            position[stage] += 1
    stuck = {s: order[position[s]] for s, order in enumerate(orders) if position[s] < len(order)}
    if stuck:
        raise ScheduleError(f"the orders wait on each other: {stuck}")
    return produced


def _pair_orders(
    orders: Sequence[Sequence[Compute]], finish: dict[Message, float]
) -> dict[tuple[int, int], list[Message]]:
    """Per unordered pair ``(low, high)``: its messages, both directions, in one order."""
    pairs: dict[tuple[int, int], list[Message]] = {}
    for order in orders:
        for compute in order:
            for message in compute.send:
                pair = (min(message.src, message.dst), max(message.src, message.dst))
                pairs.setdefault(pair, []).append(message)
    for messages in pairs.values():
        messages.sort(key=lambda m: (finish[m], m.src, m.dst, repr(m.key)))
    return pairs


class _ProgramBuilder:
    """One stage's steps: each pair's ops issued in the pair's order, in runs.

    Consecutive receives of a pair go in one exchange, consecutive sends in another, in the
    pair's order: a batch of a receive and a later receive, say, would hold its second
    receive at the head of the stream while the peer waits for a send of ours queued behind
    it. Waiting for an exchange then waits for nothing a later step produces.
    """

    def __init__(
        self,
        stage: int,
        pair_order: dict[tuple[int, int], list[Message]],
        max_open_sends: int | None,
    ) -> None:
        self.stage = stage
        self.streams = {
            (b if a == stage else a): messages
            for (a, b), messages in pair_order.items()
            if stage in (a, b)
        }
        self.place = {m: i for stream in self.streams.values() for i, m in enumerate(stream)}
        # next_send[peer][i]: the first position >= i of a message this stage sends
        self.next_send: dict[int, list[int]] = {}
        for peer, stream in self.streams.items():
            following = [len(stream)] * (len(stream) + 1)
            for i in range(len(stream) - 1, -1, -1):
                following[i] = i if stream[i].src == stage else following[i + 1]
            self.next_send[peer] = following
        self.cursor = dict.fromkeys(self.streams, 0)
        self.ready: set[Message] = set()
        self.posted: dict[Message, int] = {}  # a receive issued already -> its exchange
        self.waited: set[int] = set()
        self.steps: list[Step] = []
        self.exchanges = 0
        self.max_open_sends = max_open_sends
        self.open_sends: list[int] = []

    def produced(self, sends: Sequence[Message]) -> None:
        self.ready.update(sends)

    def unsent(self) -> list[Message]:
        return sorted(self.ready, key=repr)

    def _exchange(self, sends: list[Message], recvs: list[Message]) -> int:
        if not recvs and self.max_open_sends is not None:
            while len(self.open_sends) >= self.max_open_sends:
                oldest = self.open_sends.pop(0)
                self.waited.add(oldest)
                self.steps.append(Wait((oldest,)))
        ident = self.exchanges
        self.exchanges += 1
        self.steps.append(Exchange(ident, tuple(sends), tuple(recvs)))
        for message in recvs:
            self.posted[message] = ident
        if not recvs:
            self.open_sends.append(ident)
        return ident

    def _issue_runs(self, ops: list[Message]) -> None:
        """``ops`` (one pair's, in its order) as alternating runs of sends and receives."""
        run: list[Message] = []
        for message in ops:
            if run and (run[-1].src == self.stage) != (message.src == self.stage):
                self._issue_run(run)
                run = []
            run.append(message)
        if run:
            self._issue_run(run)

    def _issue_run(self, run: list[Message]) -> None:
        if run[0].src == self.stage:
            self._exchange(run, [])
        else:
            self._exchange([], run)

    def issue_for(self, needed: Sequence[Message]) -> tuple[int, ...]:
        """Issue what the next compute needs and what can go early; the exchanges to wait
        for before it runs."""
        for peer, stream in self.streams.items():
            wanted = [self.place[m] for m in needed if m.src == peer and m not in self.posted]
            ops: list[Message] = []
            while self.cursor[peer] <= max(wanted, default=-1):
                message = stream[self.cursor[peer]]
                if message.src == self.stage:
                    if message not in self.ready:
                        raise ScheduleError(
                            f"stage {self.stage} must send {message.key!r} before it receives "
                            "what its next compute needs, but has not produced it yet"
                        )
                    self.ready.discard(message)
                ops.append(message)
                self.cursor[peer] += 1
            # Early: receives posted ahead only to let ready sends behind them go now.
            following, last_send = self.next_send[peer], None
            send = following[self.cursor[peer]]
            while send < len(stream) and stream[send] in self.ready:
                last_send, send = send, following[send + 1]
            if last_send is not None:
                early = stream[self.cursor[peer] : last_send + 1]
                self.ready.difference_update(early)
                ops.extend(early)
                self.cursor[peer] = last_send + 1
            self._issue_runs(ops)
        waits = {self.posted.pop(m) for m in needed} - self.waited
        self.waited |= waits
        return tuple(sorted(waits))


def check_message_order(stage_programs: Sequence[Sequence[Step]]) -> None:
    """Every ordered pair of stages issues its sends in the order the receiver issues the
    matching receives, and every message is sent once and received once."""
    sent: dict[tuple[int, int], list[Key]] = {}
    received: dict[tuple[int, int], list[Key]] = {}
    for program in stage_programs:
        for step in program:
            if isinstance(step, Exchange):
                for message in step.sends:
                    sent.setdefault((message.src, message.dst), []).append(message.key)
                for message in step.recvs:
                    received.setdefault((message.src, message.dst), []).append(message.key)
    for pair in sorted(set(sent) | set(received)):
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        if sends != recvs:
            index = next(
                (i for i, (a, b) in enumerate(zip(sends, recvs, strict=False)) if a != b),
                min(len(sends), len(recvs)),
            )
            raise MessageOrderError(
                f"stage {pair[0]} sends stage {pair[1]} {len(sends)} messages and stage "
                f"{pair[1]} receives {len(recvs)}; they first differ at message {index} "
                f"(sent {sends[index] if index < len(sends) else 'nothing'}, received "
                f"{recvs[index] if index < len(recvs) else 'nothing'})"
            )
        repeated = [key for key, count in Counter(sends).items() if count > 1]
        if repeated:
            raise MessageOrderError(f"stage {pair[0]} sends {repeated[0]!r} twice")
