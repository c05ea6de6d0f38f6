"""One rank of ``test_nccl_rules``, run under ``nccl_rules_run.py`` by torchrun.

``complete OUT`` runs every pattern NCCL completes (3 ranks) and writes each rank's findings
to ``OUT/rank-R.json``; ``facing_sends SECONDS`` (run without the runner: it installs the
harness itself, after ``init_process_group``), ``batch_then_collective`` (2 ranks) and
``ring_on_one_group`` (3 ranks) issue a pattern NCCL hangs on, which the harness must report.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import nccl_rules
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

BIG = 2048  # elements: 8 KiB of float32, past any eager-send threshold


def batched_exchange(rank: int) -> dict:
    """Ranks 0 and 1 send each other a tensor inside one batch: NCCL completes it."""
    if rank > 1:
        return {}
    peer = 1 - rank
    mine = torch.full((BIG,), float(rank))
    theirs = torch.empty(BIG)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
    )
    for work in works:
        work.wait()
    return {
        "batched_exchange": theirs.unique().tolist(),
        "work_type": isinstance(works[0], dist.Work),
    }


def tags_are_ignored(rank: int) -> dict:
    """Two sends tagged 1 and 2, received with tags 2 and 1: filled in send order."""
    if rank == 0:
        dist.send(torch.tensor([10.0]), 1, tag=1)
        dist.send(torch.tensor([20.0]), 1, tag=2)
        return {}
    if rank == 1:
        first, second = torch.empty(1), torch.empty(1)
        dist.recv(first, 0, tag=2)
        dist.recv(second, 0, tag=1)
        return {"tags": [first.item(), second.item()]}
    return {}


def mismatch(rank: int) -> dict:
    """Send #k of float32[4, 8] met by a receive of int64[16]: the error, on both ranks."""
    if rank > 1:
        return {}
    try:
        if rank == 0:
            dist.send(torch.zeros(4, 8), 1)
        else:
            dist.recv(torch.zeros(16, dtype=torch.int64), 0)
    except nccl_rules.NcclRulesError as error:
        return {"mismatch": str(error)}
    return {"mismatch": None}


def ring(rank: int, world: int) -> dict:
    """Every rank's batch sends to the next rank and receives from the previous one: a batch
    spanning two peers."""
    received = torch.empty(BIG)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((BIG,), float(rank)), (rank + 1) % world),
            dist.P2POp(dist.irecv, received, (rank - 1) % world),
        ]
    )
    for work in works:
        work.wait()
    return {"ring": received.unique().tolist()}


def kinds_never_meet(rank: int) -> dict:
    """An unbatched send met by a batched receive: on NCCL they sit on different
    communicators (the pair's, the group's) and never meet; the error, on both ranks."""
    if rank > 1:
        return {}
    try:
        if rank == 0:
            dist.send(torch.zeros(BIG), 1)
        else:
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(BIG), 0)])
            works[0].wait()
    except nccl_rules.NcclRulesError as error:
        return {"kinds": str(error)}
    return {"kinds": None}


def token_ring(rank: int, group_of: dict[frozenset[int], dist.ProcessGroup | None]) -> dict:
    """The ring rollout's pattern at 3 stages: rank 0 waits for the token from rank 2
    before it sends the next branch to rank 1; rank 2 issues its batch receiving that
    branch from rank 1 before its batch sending the token to rank 0. ``group_of[{a, b}]``:
    the group the pair's batches use. One group for all: rank 2's stream holds the receive
    ahead of the send, rank 1 waits on rank 0, rank 0 on the token, and NCCL hangs. A
    two-rank group per pair: each pair has its own stream, and it completes."""

    def batch(op: Callable, tensor: torch.Tensor, peer: int) -> dist.Work:
        return dist.batch_isend_irecv(
            [dist.P2POp(op, tensor, peer, group_of[frozenset((rank, peer))])]
        )[0]

    received = torch.empty(BIG)
    if rank == 0:
        batch(dist.irecv, received, 2).wait()  # the token
        batch(dist.isend, torch.full((BIG,), 1.0), 1).wait()  # the next branch
    elif rank == 1:
        batch(dist.irecv, received, 0).wait()
        batch(dist.isend, received + 1.0, 2).wait()
    else:
        branch = batch(dist.irecv, received, 1)
        token = batch(dist.isend, torch.full((BIG,), 2.0), 0)
        branch.wait()
        token.wait()
    return {"token_ring": received.unique().tolist()}


def collective_beside_streams(rank: int, pair: dist.ProcessGroup | None) -> dict:
    """A collective does not wait for what is not on its group's stream: an unbatched send
    on the same group (the pair's communicator), nor a batch on another group. Rank 0
    issues each, then all-reduces on the default group; rank 1 receives only after that."""
    value = torch.ones(1)
    if rank == 0:
        unbatched = dist.isend(torch.full((BIG,), 3.0), 1)
        dist.all_reduce(value)
        unbatched.wait()
        (batched,) = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((BIG,), 4.0), 1, pair)]
        )
        dist.all_reduce(value)
        batched.wait()
        return {}
    dist.all_reduce(value)
    if rank != 1:
        dist.all_reduce(value)
        return {}
    first, second = torch.empty(BIG), torch.empty(BIG)
    dist.recv(first, 0)
    dist.all_reduce(value)
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, second, 0, pair)])[0].wait()
    return {"beside": [first[0].item(), second[0].item()]}


def background_progress(rank: int, pair: dist.ProcessGroup | None) -> dict:
    """Issued ops complete while their rank computes or sits in a gloo collective."""
    if rank == 0:
        work = dist.isend(torch.full((BIG,), 7.0), 1)
        time.sleep(1.0)  # "computing", without waiting for the send
        computed_until = time.time()
        work_done_before_wait = work.is_completed()
        second = dist.isend(torch.full((BIG,), 8.0), 1)
        dist.barrier(group=pair)  # rank 1 receives before it enters the barrier
        in_collective = second.is_completed()
        work.wait()
        second.wait()
        return {
            "computed_until": computed_until,
            "done_while_computing": work_done_before_wait,
            "done_while_in_collective": in_collective,
        }
    if rank == 1:
        first, second = torch.empty(BIG), torch.empty(BIG)
        dist.recv(first, 0)
        received_at = time.time()
        time.sleep(0.5)
        dist.recv(second, 0)
        dist.barrier(group=pair)
        return {"received_at": received_at, "values": [first[0].item(), second[0].item()]}
    return {}


def stress(rank: int, pair: dist.ProcessGroup | None) -> dict:
    """Many small batched exchanges between ranks 0 and 1 on their own group, each still in
    flight while the main thread runs a gloo all-reduce on the default group (which does not
    wait for them): the harness's gloo traffic beside the caller's collectives."""
    total = 0.0
    for step in range(200):
        works, theirs = [], torch.empty(3)
        if rank <= 1:
            peer = 1 - rank
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, torch.full((3,), float(step + rank)), peer, pair),
                    dist.P2POp(dist.irecv, theirs, peer, pair),
                ]
            )
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == dist.get_world_size()
        for work in works:
            work.wait()
        total += theirs.sum().item() if works else 0.0
    return {"stress": total}


def one_f_one_b(rank: int, pair: dist.ProcessGroup | None) -> dict:
    """torch.distributed.pipelining's Schedule1F1B on a two-stage MLP (ranks 0 and 1), its
    gradients against the whole model in one process."""
    if rank > 1:
        return {}
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    inputs, targets = torch.randn(8, 8), torch.randn(8, 4)
    chunks = 4
    reference = [
        F.mse_loss(model(x), y)
        for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks), strict=True)
    ]
    (sum(reference) / chunks).backward()
    part = model[:2] if rank == 0 else model[2:]  # keeps the layers' names
    expected = {name: p.grad.clone() for name, p in part.named_parameters()}
    part.zero_grad(set_to_none=True)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=pair)
    schedule = Schedule1F1B(stage, chunks, loss_fn=F.mse_loss)
    if rank == 0:
        schedule.step(inputs)
    else:
        losses: list[torch.Tensor] = []
        schedule.step(target=targets, losses=losses)
    errors = {
        name: (p.grad - expected[name]).abs().max().item() for name, p in part.named_parameters()
    }
    return {"one_f_one_b": errors}


def complete(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    results = {"installed": nccl_rules.installed()}
    results |= batched_exchange(rank)
    results |= tags_are_ignored(rank)
    results |= mismatch(rank)
    results |= kinds_never_meet(rank)
    results |= ring(rank, world)
    pairs = [frozenset(ranks) for ranks in ((0, 1), (1, 2), (0, 2))]
    group_of = {ranks: dist.new_group(sorted(ranks)) for ranks in pairs}  # same order on all
    results |= token_ring(rank, group_of)
    results |= collective_beside_streams(rank, pair if rank <= 1 else None)
    results |= background_progress(rank, pair if rank <= 1 else None)
    results |= stress(rank, pair if rank <= 1 else None)
    results |= one_f_one_b(rank, pair if rank <= 1 else None)
    dist.barrier()
    (out / f"rank-{rank}.json").write_text(json.dumps(results))


def facing_sends() -> None:
    """Each rank isends 8 KiB to the other, then receives: NCCL hangs (the sends wait for
    receives queued behind them)."""
    rank = dist.get_rank()
    peer = 1 - rank
    work = dist.isend(torch.full((BIG,), float(rank)), peer)
    theirs = torch.empty(BIG)
    dist.recv(theirs, peer)
    work.wait()
    print(f"rank {rank}: facing sends completed", flush=True)


def batch_then_collective() -> None:
    """Rank 0 sends to 1 in a batch, then broadcasts on the same group; rank 1 broadcasts,
    then receives: NCCL hangs (rank 0's broadcast waits behind its batch on the group's
    stream, whose receive rank 1 issues only after the broadcast)."""
    rank = dist.get_rank()
    value = torch.zeros(1)
    if rank == 0:
        (work,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(BIG), 1)])
        dist.broadcast(value, src=0)
        work.wait()
    else:
        dist.broadcast(value, src=0)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(BIG), 0)])[0].wait()
    print(f"rank {rank}: batch then collective completed", flush=True)


def ring_on_one_group() -> None:
    """``token_ring`` with every batch on the default group: NCCL hangs."""
    token_ring(dist.get_rank(), defaultdict(lambda: None))
    print(f"rank {dist.get_rank()}: ring on one group completed", flush=True)


def main() -> None:
    case, *rest = sys.argv[1:]
    dist.init_process_group("gloo")
    if case == "facing_sends":
        # Launched without the runner: the harness installed right after the group exists,
        # with its bound given here (the other cases install before, through the runner).
        assert not nccl_rules.installed()
        nccl_rules.install(float(rest[0]))
    if case == "complete":
        complete(Path(rest[0]))
    elif case == "facing_sends":
        facing_sends()
    elif case == "batch_then_collective":
        batch_then_collective()
    elif case == "ring_on_one_group":
        ring_on_one_group()
    else:
        raise SystemExit(f"unknown case {case!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
