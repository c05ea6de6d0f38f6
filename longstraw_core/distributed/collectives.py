"""Small collectives a run of several ranks agrees through (the largest value, any flag, every
rank's rows, sums in float64) and the metrics combined over the ranks. Each is a plain
return of its argument without a process group."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from longstraw_core.distributed.processes import cpu_group

Row = TypeVar("Row")


def max_over_ranks(value: int, *, group: dist.ProcessGroup | None = None) -> int:
    """The largest of every rank's ``value`` (a collective when distributed): how ranks agree
    on a decision one of them made alone (a signal received, a step to skip)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def any_rank(flag: bool, *, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` holds on at least one rank (a collective when distributed)."""
    return max_over_ranks(int(flag), group=group) > 0


def ranks_where(flag: bool, *, group: dist.ProcessGroup | None = None) -> list[int]:
    """The ranks of ``group`` (its own numbering) on which ``flag`` holds, the same list on
    every rank: one all-reduce of a one-hot vector, so a decision and the message that says
    where it came from agree everywhere. Without a process group: ``[0]`` or ``[]``."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if flag else []
    votes = [0.0] * dist.get_world_size(group)
    votes[dist.get_rank(group)] = float(flag)
    summed, _ = sum_over_ranks(votes, group=group)
    return [rank for rank, vote in enumerate(summed) if vote > 0]


def gather_rows(rows: Sequence[Row]) -> list[Row]:
    """Every rank's ``rows`` (picklable) on every rank, in rank order: e.g. a completions
    table of every rank's group rather than rank 0's alone. Collective: every rank calls it.
    Without a process group: the rows as they are."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(rows)
    gathered: list[list[Row] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(rows), group=cpu_group())  # pickles stay on the CPU
    return [row for part in gathered if part for row in part]


def sum_over_ranks(
    value: float | Sequence[float], *, group: dist.ProcessGroup | None = None
) -> tuple[Any, int]:
    """``value`` (a number or a list of them) summed over the ranks in float64, and the
    number of ranks. Collective when a process group is initialised; else ``(value, 1)``.
    Every rank passes a value of the same shape; an empty list is returned as it is on every
    rank, with no collective (NCCL is never handed an empty tensor)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value, 1
    if not isinstance(value, (int, float)) and len(value) == 0:
        return [], dist.get_world_size(group)
    values = torch.tensor(value, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(values, group=group)
    return values.tolist(), dist.get_world_size(group)


def reduce_metrics(
    metrics: Mapping[str, Any],
    op: Literal["mean", "sum", "max", "min"] = "mean",
    *,
    group: dist.ProcessGroup | None = None,
    ops: Mapping[str, Literal["mean", "sum", "max", "min"]] | None = None,
) -> dict[str, float]:
    """Scalar metrics combined over the ranks: ``op`` over the ranks that report each key
    (``ops``: another op for some keys, e.g. ``min`` for a minimum).

    Non-scalar values (lists) are dropped. NaN values are left out (a rank that replayed no
    branch has no entropy); a key with none left is NaN. Ranks may report different keys
    (``grpo_step`` omits clip ratios when nothing was replayed). Collective: every rank calls
    it. Without a process group the scalars are returned as they are.
    """
    scalars = {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    if not (dist.is_available() and dist.is_initialized()):
        return scalars
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    # Every rank's: through the gloo side group, off the GPU; another group's: through it.
    dist.all_gather_object(gathered, scalars, group=cpu_group() if group is None else group)
    keys = [key for part in gathered if part for key in part]
    combined = {}
    for key in dict.fromkeys(keys):  # first-seen order
        values = [part[key] for part in gathered if part and key in part]
        values = [value for value in values if not math.isnan(value)]
        combined[key] = _combine(values, (ops or {}).get(key, op)) if values else math.nan
    return combined


def _combine(values: list[float], op: str) -> float:
    if op == "mean":
        return sum(values) / len(values)
    if op == "sum":
        return sum(values)
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    raise ValueError(f"op must be 'mean', 'sum', 'max' or 'min', got {op!r}")


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor this code makes for a collective on ``group`` lives: the current GPU
    when the group runs NCCL (``"nccl"``, or a device map such as ``"cpu:gloo,cuda:nccl"``:
    NCCL refuses CPU tensors), else the CPU. It depends on the group alone, never on what a
    rank holds, so every rank of the group picks the same. On NCCL the rank's GPU must be
    current (``torch.cuda.set_device``; accelerate and torchrun's recipes set it)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
