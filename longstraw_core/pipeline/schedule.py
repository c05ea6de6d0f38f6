"""The 1F1B pipeline schedule, over any microbatches with a forward and a backward.

Both passes with autograd run through it: branch replay (microbatches: the replayed
branches; the loss on the last stage) and exact mode's reverse sweep (microbatches: the
prompt's chunks, last to first; every stage also seeds its backward with the ``dS`` of the
state the chunk wrote). Stage ``s`` of ``S`` runs ``S - s - 1`` forwards ahead (warm-up),
then alternates one forward and one backward, then drains the backwards, so it holds at most
``S - s`` microbatch graphs of its own layers at once: the activation memory of a stage stays
about one whole-model microbatch's, whatever the number of microbatches, and the stages work
on different microbatches at the same time (the pipeline bubble is ``S - 1`` microbatches).
With one stage it is the plain loop: forward, backward, next.

Backwards run in microbatch order on every stage, which exact mode's sweep relies on: a
chunk's backward adds into ``dS`` of earlier chunks, which their own backward (later on the
same stage) reads.

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` runs a module's ``forward``
on microbatches split from one batch tensor of fixed shape, with the loss as a function of
the last stage's output. Here a stage's forward reads and writes its own prefix-state
records (closures, exact-mode views), microbatches differ in length (branches, the last
chunk), and the sweep's backward is seeded on every stage, not only by a loss on the last;
plain point-to-point transfers (``transport.StageLink``) fit that directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from longstraw_core.pipeline.transport import Message, StageLink

# forward(microbatch, received) -> (message for the next stage, what backward needs)
Forward = Callable[[int, Message | None], tuple[Message | None, Any]]
# backward(microbatch, context, gradient message from the next stage) -> message to the previous
Backward = Callable[[int, Any, Message | None], Message | None]


def one_f_one_b(link: StageLink, count: int, forward: Forward, backward: Backward) -> None:
    """Run ``count`` microbatches through this rank's stage with the 1F1B schedule.

    ``forward`` gets the previous stage's message (``None`` on the first stage) and returns
    the message for the next stage (ignored on the last) and a context for ``backward``;
    ``backward`` gets the next stage's gradient message (``None`` on the last stage) and
    returns the message for the previous stage (ignored on the first).
    """
    in_flight: deque[tuple[int, Any]] = deque()

    def run_forward(microbatch: int) -> None:
        received = None if link.is_first else link.recv_forward()
        message, context = forward(microbatch, received)
        if not link.is_last:
            link.send_forward(message or ())
        in_flight.append((microbatch, context))

    def run_backward() -> None:
        microbatch, context = in_flight.popleft()
        gradient = None if link.is_last else link.recv_backward()
        message = backward(microbatch, context, gradient)
        if not link.is_first:
            link.send_backward(message or ())

    warmup = min(link.stages - link.stage - 1, count)
    for microbatch in range(warmup):
        run_forward(microbatch)
    for microbatch in range(warmup, count):
        run_forward(microbatch)
        run_backward()
    while in_flight:
        run_backward()
    link.wait()


def forward_only(
    link: StageLink, count: int, forward: Forward, exchanged: int | None = None
) -> None:
    """``count`` microbatches forward through the stages, without backward (prefill,
    no-grad scoring): stage ``s`` works on microbatch ``k`` while stage ``s - 1`` works on
    ``k + 1``. Only the first ``exchanged`` (default: all) cross the stages; the others run
    on each stage alone (``forward(k, None)``, its message dropped): idle passes that pad a
    replica to its FSDP peers' count. They run before the sends are drained, as a peer may
    still need them to reach its own sends' receiver."""
    exchanged = count if exchanged is None else exchanged
    for microbatch in range(count):
        crosses = microbatch < exchanged
        received = None if link.is_first or not crosses else link.recv_forward()
        message, _ = forward(microbatch, received)
        if crosses and not link.is_last:
            link.send_forward(message or ())
    link.wait()
