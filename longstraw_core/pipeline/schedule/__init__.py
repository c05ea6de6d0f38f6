"""Pipeline schedules as programs: each stage's exact order of computes and transfers.

A pass over the stages (prefill, scoring, rollout, replay, exact mode's sweep) is a set of
computes: the forward ``F`` or backward ``B`` of one microbatch on one stage, each receiving
messages from other stages and sending its own. A schedule fixes every stage's order of
computes (``*_orders``), and ``programs`` turns those orders into each stage's **program**,
the exact sequence of steps its rank runs (``longstraw_core.pipeline.runner``) and the
simulator plays (``longstraw_core.pipeline.simulate``):

- ``Exchange``: one ``batch_isend_irecv`` per peer: the messages the previous compute produced for
  other stages, fused with the ones the next compute needs. Fusing is what keeps a schedule
  live under NCCL's rules (one in-order stream per rank pair, each pair of stages a
  process group of its own: ``transport``, a send completes only when
  the peer's stream reaches the matching receive, ops of one batch progress together):
  in 1F1B's steady state stage ``s`` sends forward ``k + 1`` and receives backward ``k``
  while stage ``s + 1`` sends backward ``k`` and receives forward ``k + 1``; unbatched, the
  two sends face each other and neither stream moves. PyTorch's ``Schedule1F1B`` fuses the
  same pairs "for deadlock avoidance".
- ``Wait``: wait for exchanges (each as a whole: NCCL completes a group as one): those holding
  what the next compute receives, or the oldest of the sends still in flight, which bounds
  them (a long prefill would otherwise keep every chunk's hidden states alive).
- ``Collective``: a collective every stage joins (rollout's stop check, one every ``check_every`` generated tokens).
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

The package: ``steps`` (what programs and orders are made of: messages, computes, the steps,
the costs orders are chosen with), ``programs`` (orders -> programs, and the message order
check), ``orders`` (the forward and replay orders) and ``ring`` (rollout's ring).
"""

# Each submodule's public names (its ``__all__``), so that each lists them once.
from longstraw_core.pipeline.schedule import orders, ring, steps
from longstraw_core.pipeline.schedule.orders import *  # noqa: F403
from longstraw_core.pipeline.schedule.programs import check_message_order, programs, stage_program
from longstraw_core.pipeline.schedule.ring import *  # noqa: F403
from longstraw_core.pipeline.schedule.steps import *  # noqa: F403

__all__ = [
    *orders.__all__,
    *ring.__all__,
    *steps.__all__,
    "check_message_order",
    "programs",
    "stage_program",
]
