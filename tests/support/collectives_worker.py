"""One rank of ``test_collectives_empty``: every collective helper on two CPU ranks where one
rank's input is empty (no gradients, no parameters, an empty list, zero rows), under the
NCCL-rules harness. A tap on ``torch.distributed``'s collectives (it records, then calls the
real function) logs each tensor a helper hands a collective: its dtype, element count,
device, group, and the device ``collective_device`` says that group needs. Writes
``ARGV[1]/rank<R>.pt``: the helpers' results and the tap's log.

The inputs are functions of the rank alone, so the test rebuilds every rank's in one process
and runs the one-process reference over them.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longstraw_core import config
from longstraw_core.checkpoint import ranks
from longstraw_core.distributed import (
    any_rank,
    exit_ranks,
    gather_rows,
    max_over_ranks,
    reduce_metrics,
    sum_over_ranks,
)
from longstraw_core.distributed.collectives import collective_device
from longstraw_core.grpo.groups import group_loss_scales, step_reward_std
from longstraw_core.launch import same_run
from longstraw_core.parallel.fsdp import FSDPRun
from longstraw_core.pipeline.gradients import average_over_replicas, clip_grad_norm
from longstraw_core.schema.grpo import GRPOConfig

RANKS = 2
MAX_NORM = 0.5  # below every case's total norm, so the clip scales
TAPPED = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_gather_object", "broadcast_object_list", "gather_object",
)  # fmt: skip
# Clipping over a pipeline's two stages (each rank its own parameters): rank 1 holds
# parameters without gradients, no parameters at all, or neither rank holds a gradient.
CLIP_CASES = ("rank1-no-grads", "rank1-no-params", "no-grads-anywhere")
# Averaging over two replicas (the same parameters): rank 1 holds no gradient, or each rank
# holds gradients of other parameters; parameter 1 never gets one.
AVERAGE_CASES = ("rank1-no-grads", "disjoint")


# --- inputs: functions of the rank ---------------------------------------------------------------


def stage_parameters(rank: int, case: str) -> list[torch.nn.Parameter]:
    """Stage ``rank``'s parameters (rank 0 holds a float64 one: the ranks' gradients differ
    in dtype) with their gradients in clip ``case``."""
    generator = torch.Generator().manual_seed(100 + rank)
    if rank == 0:
        shapes = [((3, 4), torch.float32), ((5,), torch.float64), ((2, 2), torch.float32)]
    else:
        shapes = (
            [] if case == "rank1-no-params" else [((4, 4), torch.float32), ((3,), torch.float32)]
        )
    parameters = []
    for shape, dtype in shapes:
        parameter = torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype))
        if rank == 0 and case != "no-grads-anywhere":
            parameter.grad = torch.randn(shape, generator=generator, dtype=dtype)
        parameters.append(parameter)
    return parameters


def replica_parameters(rank: int, case: str) -> list[torch.nn.Parameter]:
    """One stage's parameters (the same on every replica) with replica ``rank``'s gradients
    in average ``case``; parameter 1 has none anywhere."""
    generator = torch.Generator().manual_seed(7)
    dtypes = (torch.float32, torch.float32, torch.float64)
    parameters = [
        torch.nn.Parameter(torch.randn(4, 3, generator=generator, dtype=dtype)) for dtype in dtypes
    ]
    with_grad = {"rank1-no-grads": {0: (0, 2), 1: ()}, "disjoint": {0: (0,), 1: (2,)}}[case][rank]
    grads = torch.Generator().manual_seed(200 + rank)
    for index in with_grad:
        parameter = parameters[index]
        parameter.grad = torch.randn(parameter.shape, generator=grads, dtype=parameter.dtype)
    return parameters


def rows(rank: int) -> list[str]:
    return ["a", "b"] if rank == 0 else []


def metrics(rank: int) -> dict[str, float]:
    return {"x": 1.5, "y": math.nan, "z": 2.0} if rank == 0 else {}


def lengths(rank: int) -> list[list[int]]:
    """Each of this rank's groups' completion lengths (rank 1 has no group)."""
    return [[3, 4], [5]] if rank == 0 else []


def rewards(rank: int, zero_rows: bool) -> list[Any]:
    """This rank's groups' rewards: rank 1 has none, or one group of zero rows."""
    if rank == 0:
        return [torch.tensor([1.0, 2.0, math.nan]), [3.0, 0.5]]
    return [torch.zeros(0)] if zero_rows else []


# --- the tap ---------------------------------------------------------------------------------------


LOG: list[dict[str, Any]] = []  # the tap's: each call, after the helper that made it


def helper(name: str) -> None:
    """Mark the calls that follow in the log as ``name``'s."""
    LOG.append({"name": "helper", "helper": name})


def tap(log: list[dict[str, Any]]) -> None:
    """Log every call of the ``TAPPED`` collectives, then make it."""
    for name in TAPPED:
        original = getattr(dist, name)

        @functools.wraps(original)
        def tapped(*args: Any, _name: str = name, _call: Callable = original, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            log.append(
                {
                    "name": _name,
                    "group": dist.get_process_group_ranks(group or dist.group.WORLD),
                    "dtype": None if tensor is None else str(tensor.dtype),
                    "numel": None if tensor is None else tensor.numel(),
                    "device": None if tensor is None else str(tensor.device),
                    "needs": str(collective_device(group)),
                }
            )
            return _call(*args, **kwargs)

        setattr(dist, name, tapped)


# --- the run ----------------------------------------------------------------------------------------


def run(rank: int) -> dict[str, Any]:
    """Every helper with this rank's inputs; what each returned."""
    results: dict[str, Any] = {}
    for case in CLIP_CASES:
        helper(f"clip/{case}")
        parameters = stage_parameters(rank, case)
        total = clip_grad_norm(parameters, MAX_NORM, dist.group.WORLD)
        results[f"clip/{case}"] = (total, [p.grad for p in parameters])
    for case in AVERAGE_CASES:
        helper(f"average/{case}")
        parameters = replica_parameters(rank, case)
        average_over_replicas(parameters, dist.group.WORLD)
        results[f"average/{case}"] = [p.grad for p in parameters]
    helper("average/no-params")
    average_over_replicas([], dist.group.WORLD)  # a stage with no parameters: nothing to do
    helper("small")
    results["sum/empty"] = sum_over_ranks([])
    results["sum/values"] = sum_over_ranks([float(rank), 0.5])
    results["max"] = max_over_ranks(3 * rank)
    results["any"] = (any_rank(rank == 1), any_rank(False))
    results["gather_rows"] = (gather_rows(rows(rank)), gather_rows([]))
    results["reduce_metrics"] = (reduce_metrics(metrics(rank)), reduce_metrics({}))
    results["loss_scales"] = group_loss_scales(lengths(rank), GRPOConfig())
    results["reward_std"] = [step_reward_std(rewards(rank, zero)) for zero in (False, True)]
    results["checkpoint"] = (
        ranks.gather(None if rank else "mine"),
        ranks.on_rank0(lambda: "written"),
        ranks.agree(None),
    )
    same_run.require_same_run(config.RunConfig())  # the same settings: no error
    fsdp = FSDPRun(None, {}, set(), dist.group.WORLD, torch.device("cpu"), None)  # type: ignore[arg-type]
    results["fsdp"] = (fsdp.most(0 if rank else 4), fsdp.everywhere_each(True, rank == 0))
    return results


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tap(LOG)
    results = run(rank)
    torch.save({"results": results, "tap": LOG}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    exit_ranks()


if __name__ == "__main__":
    if os.environ.get("WORLD_SIZE") != str(RANKS):
        raise SystemExit(f"run on {RANKS} ranks")
    main()
