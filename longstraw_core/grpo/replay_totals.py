"""The last pipeline stage's replay totals on every stage, in one tensor broadcast.

Why: the group's loss, its entropy sum and each branch's stats are numbers whose shape
every stage knows (a row per replayed branch; a column each for the loss, the entropy and
every stat ``branch_loss`` gives under the config), so one broadcast of a float64 tensor
sends them: no pickling (``broadcast_object_list`` reads a size back to the host and copies
through it), and the last stage reads them back once, not one ``.item()`` per branch. The
values are the ones the last stage computed (float32 and float64 are exact in float64).
"""

from __future__ import annotations

import math

import torch

from longstraw_core.grpo.losses import branch_loss
from longstraw_core.pipeline.transport import StageLink
from longstraw_core.schema.grpo import GRPOConfig
from longstraw_core.tensors.fake import is_fake, real_values

Totals = tuple[float, float, list[dict[str, torch.Tensor]]]


def stat_keys(config: GRPOConfig) -> list[str]:
    """The stats ``branch_loss`` gives under ``config``, in its order: they depend on the
    config alone, so a one-token probe gives every stage the same keys."""
    with real_values():
        one = torch.zeros(1, dtype=torch.float64)
        _, stats = branch_loss(one, None, one, 0.0, 1.0, config)
    return list(stats)


def totals_from_last(
    link: StageLink,
    branches: int,
    losses: list[torch.Tensor],
    entropies: list[torch.Tensor],
    stats: list[dict[str, torch.Tensor]],
    config: GRPOConfig,
) -> Totals:
    """The sum of the ``branches`` replayed branches' ``losses`` (filled on the last stage
    only), the sum of their ``entropies``, and their ``stats``, on every stage."""
    if branches == 0:
        return 0.0, 0.0, []
    keys = stat_keys(config)
    packed = None
    if link.is_last:
        rows = [
            torch.stack([loss.double(), entropy.double(), *(s[key].double() for key in keys)])
            for loss, entropy, s in zip(losses, entropies, stats, strict=True)
        ]
        packed = torch.stack(rows).to(link.device)
    like = torch.empty(branches, 2 + len(keys), dtype=torch.float64, device=link.device)
    packed = link.from_last(packed, like=like)
    if is_fake(packed):  # a dry run: no values; its stats stay fake (not logged)
        return math.nan, math.nan, [dict(zip(keys, row[2:], strict=True)) for row in packed]
    values = packed.tolist()
    return (
        sum(row[0] for row in values),
        sum(row[1] for row in values),
        [{key: torch.tensor(v, dtype=torch.float64) for key, v in zip(keys, row[2:], strict=True)}
         for row in values],
    )  # fmt: skip
