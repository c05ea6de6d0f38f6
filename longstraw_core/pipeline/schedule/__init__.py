"""Pipeline schedules as programs: each stage's exact order of computes and transfers.

A pass over the stages (prefill, scoring, rollout, replay, exact mode's sweep) is a set of
computes: the forward ``F`` or backward ``B`` of one microbatch on one stage, each receiving
messages from other stages and sending its own. A schedule fixes every stage's order of
computes (``*_orders``), and ``programs`` turns those orders into each stage's **program**,
the exact sequence of steps its rank runs (``longstraw_core.pipeline.runner``) and the
simulator plays (``longstraw_core.pipeline.simulate``):

- ``Exchange``: one ``batch_isend_irecv``: the messages the previous compute produced for
  other stages, fused with the ones the next compute needs. Fusing is what keeps a schedule
  live under NCCL's rules (one in-order stream per rank pair, a send completes only when
  the peer's stream reaches the matching receive, ops of one batch progress together):
  in 1F1B's steady state stage ``s`` sends forward ``k + 1`` and receives backward ``k``
  while stage ``s + 1`` sends backward ``k`` and receives forward ``k + 1``; unbatched, the
  two sends face each other and neither stream moves. PyTorch's ``Schedule1F1B`` fuses the
  same pairs "for deadlock avoidance".
- ``Wait``: wait for exchanges (each as a whole: NCCL completes a group as one): those holding
  what the next compute receives, or the oldest of the sends still in flight, which bounds
  them (a long prefill would otherwise keep every chunk's hidden states alive).
- ``Collective``: a collective every stage joins (rollout's one per generated token).
- ``Compute``: run ``F`` or ``B`` of a microbatch.
- ``Drain``: wait for every exchange still open, at the end of the pass.

Messages are named (``Message.key``), never tagged: NCCL ignores tags and matches by order,
so ``programs`` checks that every ordered pair of stages issues its sends and the matching
receives in the same order (``MessageOrderError`` otherwise), and each message's shape comes
from the pass's plan on both sides (no header, no host sync per message).

The orders:

- ``forward_orders``: every stage runs the microbatches in order (prefill's chunks, a
  scoring pass); stage ``s`` works on ``k`` while ``s - 1`` works on ``k + 1``.
- ``replay_orders``: microbatches grouped into *branches* of consecutive *pieces*. Forwards
  run in order; a branch's backwards run last piece first (a piece's backward needs the
  gradient of the state the later pieces read, as exact mode's sweep does for prompt
  chunks), and on the last stage only once every piece of the branch has its log-probs (a
  branch's loss may couple its tokens). Each stage runs a backward as soon as it can and a
  forward otherwise, holding at most ``P + min(P, 3) (S - 1 - s)`` pieces' graphs
  (``graphs_in_flight``: a branch, and the forwards that cover a piece's round trip), which
  reaches 1F1B's bubble over all ``G P`` pieces. With one piece per branch this is 1F1B
  (``S - s`` microbatches in flight), which is also the exact sweep's schedule (its
  microbatches: prompt chunks, last first).
- ``ring_program``: rollout's decode steps. The ``G`` branches form ``m = min(G, S)``
  micro-groups that follow each other around the ring of stages: stage ``s`` decodes
  micro-group ``j`` while stage ``s - 1`` decodes ``j + 1``; the last stage samples and
  sends the tokens back to the first point-to-point.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

Key = Hashable
# Exchanges of sends only kept in flight before a stage waits for the oldest: bounds the
# memory of sent tensors (a long prefill, or a sweep over hundreds of chunks, would otherwise
# keep every chunk's hidden states or gradients until the pass ends).
MAX_OPEN_SENDS = 8


class Message(NamedTuple):
    """A message ``key`` from stage ``src`` to stage ``dst`` (a tuple: hashed in C, as a
    rollout's program holds hundreds of thousands)."""

    key: Key
    src: int
    dst: int


@dataclass(frozen=True)
class Compute:
    """``kind`` (``"F"``/``"B"``) of microbatch ``microbatch`` on ``stage``: what it receives
    before it runs and what it sends after."""

    stage: int
    kind: str
    microbatch: Key
    recv: tuple[Message, ...] = ()
    send: tuple[Message, ...] = ()


@dataclass(frozen=True)
class Exchange:
    """One ``batch_isend_irecv``, numbered ``ident`` in its stage's program: ``sends`` and
    ``recvs`` progress together."""

    ident: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True)
class Wait:
    """Wait for the exchanges numbered ``idents`` (each as a whole)."""

    idents: tuple[int, ...]


@dataclass(frozen=True)
class Collective:
    """A collective every stage joins, named for the reports."""

    name: Key


@dataclass(frozen=True)
class Drain:
    """Wait for every exchange still open."""


Step = Compute | Exchange | Wait | Collective | Drain


class MessageOrderError(RuntimeError):
    """Two stages would issue the sends and receives between them in different orders:
    NCCL would match them by position and hang or deliver the wrong tensor."""


class ScheduleError(RuntimeError):
    """An order no stage could run (a dependency cycle, too few graphs allowed in flight)."""


# --- orders -> programs ---------------------------------------------------------------------


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


# --- forward-only passes ------------------------------------------------------------------


def forward_orders(stages: int, count: int, crosses: Callable[[int], bool] | None = None):
    """Each stage runs microbatches ``0..count-1`` forward, in order. A microbatch that does
    not ``cross`` runs on each stage alone (an idle pass padding a replica to its FSDP peers'
    count): no messages."""
    orders: list[list[Compute]] = [[] for _ in range(stages)]
    for stage in range(stages):
        for k in range(count):
            crossing = crosses is None or crosses(k)
            recv = (Message(("F", k), stage - 1, stage),) if crossing and stage > 0 else ()
            last = stage == stages - 1
            send = (Message(("F", k), stage, stage + 1),) if crossing and not last else ()
            orders[stage].append(Compute(stage, "F", k, recv, send))
    return orders


# --- passes with autograd: branches of pieces ---------------------------------------------


@dataclass(frozen=True)
class UnitCosts:
    """The costs a schedule's order is chosen with (and ``simulate`` can replay): a piece's
    forward and backward on one stage, in units of a forward."""

    forward: float = 1.0
    backward: float = 2.0


def replay_orders(
    stages: int,
    pieces: Sequence[int],
    costs: UnitCosts = UnitCosts(),
    in_flight: Sequence[int] | None = None,
) -> list[list[Compute]]:
    """Each stage's order of forwards and backwards for branches of ``pieces[b]`` pieces.

    Microbatch ``m`` numbers the pieces in forward order (branch by branch). Dependencies:
    ``F(s, m)`` after ``F(s - 1, m)``; ``B(s, m)`` after ``F(s, m)``, after ``B(s + 1, m)``
    (the gradient of its output) and after the backward of the branch's next piece on the
    same stage (the gradient of the state it wrote); on the last stage a branch's first
    backward waits for its last piece's forward (the loss). Each stage runs, at each free
    moment of a simulation with ``costs``, the next backward if it is ready, else the next
    forward if it is ready and the stage holds fewer than ``in_flight[s]`` graphs (default:
    ``graphs_in_flight``), else waits. The result depends only on the arguments, so every
    rank computes the same orders.
    """
    if stages < 1 or any(p < 1 for p in pieces):
        raise ScheduleError(f"need stages >= 1 and pieces >= 1, got {stages}, {list(pieces)}")
    first_piece = [0]
    for count in pieces:
        first_piece.append(first_piece[-1] + count)
    total = first_piece[-1]
    branch_of = [b for b, count in enumerate(pieces) for _ in range(count)]
    backward_order = [
        first_piece[b] + p for b, count in enumerate(pieces) for p in reversed(range(count))
    ]
    caps = list(in_flight or graphs_in_flight(stages, max(pieces, default=1), costs))
    inf = float("inf")
    forward_done = [[inf] * total for _ in range(stages)]
    backward_done = [[inf] * total for _ in range(stages)]
    next_forward = [0] * stages
    next_backward = [0] * stages
    free = [0.0] * stages
    orders: list[list[Compute]] = [[] for _ in range(stages)]

    def backward_ready(s: int) -> float:
        if next_backward[s] >= total:
            return inf
        m = backward_order[next_backward[s]]
        ready = forward_done[s][m]
        if s < stages - 1:
            ready = max(ready, backward_done[s + 1][m])
        else:
            ready = max(ready, forward_done[s][first_piece[branch_of[m] + 1] - 1])
        return ready

    def forward_ready(s: int) -> float:
        if next_forward[s] >= total or next_forward[s] - next_backward[s] >= caps[s]:
            return inf
        return 0.0 if s == 0 else forward_done[s - 1][next_forward[s]]

    def next_action(s: int) -> tuple[float, str]:
        """When stage ``s`` can start its next compute, and which: the backward if it is
        ready by then, else the forward."""
        backward = max(free[s], backward_ready(s))
        forward = max(free[s], forward_ready(s))
        return (backward, "B") if backward <= forward else (forward, "F")

    for _ in range(2 * total * stages):
        # The earliest compute any stage can start: dependencies are scheduled before what
        # needs them, so a start time is final once chosen.
        choices = []
        for stage in range(stages):
            if next_backward[stage] < total:
                when, what = next_action(stage)
                choices.append((when, -stage, what, stage))
        start, _, kind, s = min(choices)
        if start == inf:
            raise ScheduleError(
                f"no stage can proceed with at most {caps} graphs in flight per stage"
            )
        if kind == "B":
            m = backward_order[next_backward[s]]
            next_backward[s] += 1
            backward_done[s][m] = free[s] = start + costs.backward
        else:
            m = next_forward[s]
            next_forward[s] += 1
            forward_done[s][m] = free[s] = start + costs.forward
        orders[s].append(_piece_compute(stages, s, kind, m))
    return orders


def graphs_in_flight(
    stages: int,
    pieces: int,
    costs: UnitCosts = UnitCosts(),
    lookahead: int | None = None,
) -> list[int]:
    """Each stage's most graphs in flight in ``replay_orders``: a whole branch of ``pieces``,
    plus ``lookahead`` per stage after it. The default, ``min(pieces, round trip)``, where the
    round trip is a piece's forward and backward in forward units (3), is the least that
    reaches 1F1B's bubble over every piece, ``(S - 1) / (G P + S - 1)``
    (``tests/test_schedule.py``); with one piece it is 1F1B's ``S - s``."""
    if lookahead is None:
        round_trip = math.ceil((costs.forward + costs.backward) / costs.forward)
        lookahead = min(pieces, round_trip)
    return [pieces + lookahead * (stages - 1 - s) for s in range(stages)]


def _piece_compute(stages: int, stage: int, kind: str, m: int) -> Compute:
    if kind == "F":
        recv = (Message(("F", m), stage - 1, stage),) if stage > 0 else ()
        send = (Message(("F", m), stage, stage + 1),) if stage < stages - 1 else ()
    else:
        recv = (Message(("B", m), stage + 1, stage),) if stage < stages - 1 else ()
        send = (Message(("B", m), stage, stage - 1),) if stage > 0 else ()
    return Compute(stage, kind, m, recv, send)


def split_pieces(length: int, pieces: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``pieces`` contiguous pieces of a branch of ``length`` tokens,
    as equal as can be (the first ones one token longer); a branch shorter than ``pieces``
    gets one-token pieces and ``(length, 0)`` for the rest (idle pieces)."""
    base, extra = divmod(length, pieces)
    spans, start = [], 0
    for p in range(pieces):
        size = base + (1 if p < extra else 0)
        spans.append((start, size))
        start += size
    return spans


# --- rollout: micro-groups around the ring -------------------------------------------------


def micro_groups(branches: int, stages: int) -> list[range]:
    """Rows of the ``m = min(branches, stages)`` micro-groups rollout decodes in turn
    (contiguous, sizes differing by at most one)."""
    count = min(branches, stages)
    sizes = [len(s) for s in _even(branches, count)]
    rows, start = [], 0
    for size in sizes:
        rows.append(range(start, start + size))
        start += size
    return rows


def _even(total: int, parts: int) -> list[range]:
    base, extra = divmod(total, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class Ring:
    """The shape of a rollout on ``stages`` stages: ``groups`` micro-groups, at most
    ``max_steps`` decode steps. A stage works on micro-group ``j`` of step ``t`` at tick
    ``t * S + j + s``; every stage joins ``Collective(("stop", t))`` right after its work of
    tick ``t * S + m + S - 2``, when the last stage has sampled every micro-group of step
    ``t``: the one collective of step ``t``, which tells every stage whether to stop. When it
    says stop after ``t``, the run ends after step ``t + 1`` (the first stage has started
    that step already), so steps beyond are never issued (``stop_at``)."""

    stages: int
    groups: int
    max_steps: int
    steps: int | None = field(default=None)  # decided: the run's number of steps

    def __post_init__(self) -> None:
        if self.groups > self.stages:
            raise ScheduleError(f"{self.groups} micro-groups on {self.stages} stages")

    def stop_at(self, t: int) -> None:
        """The collective of step ``t`` said every branch has ended."""
        self.steps = min(self.max_steps, t + 2)

    @property
    def planned_steps(self) -> int:
        return self.max_steps if self.steps is None else self.steps

    def collective_steps(self) -> range:
        """Steps that have a stop collective: later ones cannot end the run any earlier."""
        return range(max(0, self.max_steps - 2))


def ring_orders(ring: Ring) -> list[list[Compute]]:
    """Each stage's decode computes for ``ring.planned_steps`` steps (``F`` of ``(j, t)``):
    hidden states ``("H", j, t)`` forward, the last stage's tokens ``("T", j, t)`` back to
    the first stage for step ``t + 1``."""
    stages, groups, steps = ring.stages, ring.groups, ring.planned_steps
    orders: list[list[Compute]] = [[] for _ in range(stages)]
    last = stages - 1
    for s in range(stages):
        for t in range(steps):
            for j in range(groups):
                recv: list[Message] = []
                send: list[Message] = []
                if s > 0:
                    recv.append(Message(("H", j, t), s - 1, s))
                elif t > 0 and stages > 1:
                    recv.append(Message(("T", j, t - 1), last, 0))
                if s < last:
                    send.append(Message(("H", j, t), s, s + 1))
                elif t < steps - 1 and stages > 1:
                    send.append(Message(("T", j, t), last, 0))
                orders[s].append(Compute(s, "F", (j, t), tuple(recv), tuple(send)))
    return orders


def ring_program(ring: Ring, stage: int | None = None) -> list[list[Step]]:
    """``ring_orders`` as programs, with each step's stop collective in its place (with
    ``stage``: that stage's alone, in a list of one)."""
    orders = ring_orders(ring)
    stages, groups = ring.stages, ring.groups
    collectives: dict[tuple[int, int], list[Key]] = {}
    for s, order in enumerate(orders):
        index = -1  # the stage's last compute at a tick <= the collective's (ticks increase)
        for t in ring.collective_steps():
            if ring.steps is not None and t > ring.steps - 2:
                break
            tick = t * stages + groups + stages - 2
            while index + 1 < len(order) and _tick(order[index + 1], stages, s) <= tick:
                index += 1
            collectives.setdefault((s, index), []).append(("stop", t))
    if stage is not None:
        return [stage_program(orders, stage, MAX_OPEN_SENDS, collectives)]
    return programs(orders, MAX_OPEN_SENDS, collectives)


def ring_steps(ring: Ring, stage: int) -> Iterator[Step]:
    """Stage ``stage``'s program for ``ring``, planned again whenever a stop collective
    decides the number of steps: the steps run so far are the same in the new plan (they
    come before the first step that differs), so the run goes on where it was."""
    planned = ring.steps
    program = ring_program(ring, stage)[0]
    index = 0
    while index < len(program):
        yield program[index]
        index += 1
        if ring.steps != planned:
            replanned = ring_program(ring, stage)[0]
            if replanned[:index] != program[:index]:
                raise ScheduleError("the ring's plan changed before its decision point")
            program, planned = replanned, ring.steps


def _tick(compute: Compute, stages: int, stage: int) -> int:
    j, t = compute.microbatch
    return t * stages + j + stage
