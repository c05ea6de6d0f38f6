"""A step's GRPO groups over the ranks: each rank's share of them, each group's share of the
step's loss (``loss_scale``), and the std of every reward of the step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from longstraw_core.distributed.collectives import sum_over_ranks
from longstraw_core.grpo.losses import normaliser_share
from longstraw_core.schema.grpo import GRPOConfig

Group = TypeVar("Group")


def spread_groups(groups: Sequence[Group], rank: int, world_size: int) -> list[Group]:
    """This rank's share of a step's groups: every ``world_size``-th, from ``rank``.

    Every rank must run the same number of groups (their collectives pair up), so the
    number of groups must be a multiple of ``world_size``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if len(groups) % world_size:
        raise ValueError(
            f"{len(groups)} groups cannot be spread evenly over {world_size} ranks: every rank "
            "runs the same number of groups; use a multiple of the world size"
        )
    return list(groups[rank::world_size])


def group_loss_scales(
    completion_lengths: Sequence[Sequence[int]],
    config: GRPOConfig,
    truncated: Sequence[Sequence[bool] | None] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """``loss_scale`` for ``grpo_step`` of each of this rank's groups in one optimizer step.

    ``completion_lengths[k]`` (and ``truncated[k]``) describe this rank's group ``k``. The
    step's loss is TRL's over all the step's responses (the package docstring): each group's loss
    weighted by its share of the step's normaliser (``losses.normaliser_share``: active tokens
    for ``bnpo``/``dapo``/``cispo``/``vespo``, responses for ``grpo``/``sapo``/``dr_grpo``/
    ``luspo``), shares summed over every rank. FSDP averages the ranks' gradients, so each
    share is multiplied by the world size. Collective when a process group is initialised:
    every rank calls it, with its own groups. (``generation.GenerationBatch`` does the same
    for groups that arrive one at a time.)
    """
    if truncated is None:
        truncated = [None] * len(completion_lengths)
    if len(truncated) != len(completion_lengths):
        raise ValueError(
            f"truncated has {len(truncated)} entries for {len(completion_lengths)} groups"
        )
    counts = [
        normaliser_share(lengths, flags, config)
        for lengths, flags in zip(completion_lengths, truncated, strict=True)
    ]
    total, world_size = sum_over_ranks(float(sum(counts)), group=group)
    return [world_size * count / max(total, 1.0) for count in counts]


def step_reward_std(
    rewards: Sequence[Sequence[float] | torch.Tensor], *, group: dist.ProcessGroup | None = None
) -> float:
    """TRL's ``scale_rewards="batch"`` std: Bessel-corrected, over every reward of the
    optimizer step, this rank's groups ``rewards[k]`` and every other rank's, NaN rewards
    (unscorable rows) left out as TRL's ``nanstd`` does. Two passes (the mean, then the squared
    deviations from it), each one collective of two float64 numbers. NaN with fewer than two
    rewards, as TRL. Collective: every rank calls it, with its own groups.
    """
    # A rank with no groups (or groups of no rows) still joins both collectives with zeros.
    parts = [torch.as_tensor(r, dtype=torch.float64).flatten() for r in rewards]
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    values = values[~torch.isnan(values)]
    (count, total), _ = sum_over_ranks([float(values.numel()), float(values.sum())], group=group)
    mean = total / count if count else math.nan
    (squares,), _ = sum_over_ranks([float(((values - mean) ** 2).sum())], group=group)
    if count < 2:
        return math.nan
    return math.sqrt(squares / count * (count / (count - 1)))
