"""A batch's rewards (``RewardResult``) and TRL's reward metrics of a batch of groups
(``reward_metrics``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from longstraw_core.metrics import names as metric_names
from longstraw_core.rewards.inputs import Completion
from longstraw_core.schema.grpo import normalize_scale_rewards

# --------------------------------------------------------------------------- combination


@dataclass
class RewardResult:
    """Rewards of one batch (the recipes score one group per call).

    ``rewards``: the weighted nansum per completion; NaN where every function gave NaN (the
    row is unscorable: zero advantage, left out of the group's statistics, as in TRL).
    ``rewards_per_func``: [N][F] raw values, NaN where a function returned None, failed, or
    gave a non-finite value. ``unscorable``: the all-NaN rows. ``failed``: function name ->
    ids of the samples in each batch where it raised. ``prompts``/``completions``: as the
    functions got them. ``extra_columns``: what they logged with ``log_extra``;
    ``logged_metrics``: with ``log_metric``, each name's values in call order.
    """

    names: list[str]
    rewards: list[float]
    rewards_per_func: list[list[float]]
    unscorable: list[int] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    prompts: list[Any] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)

    @property
    def all_failed(self) -> bool:
        """Every reward function failed on this batch: the rewards carry no signal."""
        return bool(self.names) and len(self.failed) == len(self.names)

    def columns(self) -> dict[str, list[float]]:
        """Per-function columns, e.g. for a completions table."""
        return {n: [row[i] for row in self.rewards_per_func] for i, n in enumerate(self.names)}

    def metrics(self) -> dict[str, float]:
        """TRL's reward metrics (names in ``longstraw_core.metrics.names``), this batch taken as one
        group: per-function nan-mean/std, the rewards' nan-mean/std (unscorable rows left
        out), whether the group's std is zero; LongStraw's counts; ``log_metric`` means."""
        m = metric_names
        out = reward_metrics([self])
        out[m.REWARD_UNSCORABLE_COUNT] = float(len(self.unscorable))
        out[m.REWARD_FAILED_FUNCS] = float(len(self.failed))
        for name, values in self.logged_metrics.items():
            out[name] = sum(values) / len(values)
        return out


def reward_metrics(
    groups: Sequence[RewardResult], scale_rewards: str | bool = "group"
) -> dict[str, float]:
    """TRL's reward metrics of a batch of groups (one ``RewardResult`` per prompt, all from
    one ``RewardSet``), as ``GRPOTrainer`` logs a batch: each function's nan-mean and std and
    the weighted rewards' (unscorable rows left out) over every completion, and the share of
    completions whose reward std is zero: their group's (``scale_rewards`` "group" or
    "none"; a group of one counts as zero, as TRL's eval with ``num_generations_eval=1``),
    or with "batch" the whole batch's, as TRL scales it."""
    m = metric_names
    names = groups[0].names if groups else []
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        column = [row[i] for group in groups for row in group.rewards_per_func]
        out[m.REWARD_FUNC_MEAN.format(name)] = _nanmean(column)
        out[m.REWARD_FUNC_STD.format(name)] = _nanstd(column)
    rewards = [r for group in groups for r in group.rewards]
    out[m.REWARD] = _nanmean(rewards)
    out[m.REWARD_STD] = _nanstd(rewards)
    # TRL: torch.isclose(std_rewards, 0) per completion, averaged; a NaN std is not close.
    if normalize_scale_rewards(scale_rewards) == "batch":
        std = _nanstd(rewards) if len(rewards) > 1 else 0.0
        zero_std = len(rewards) * math.isclose(std, 0.0, abs_tol=1e-8)
    else:
        zero_std = 0
        for group in groups:
            std = _nanstd(group.rewards) if len(group.rewards) > 1 else 0.0
            zero_std += len(group.rewards) * math.isclose(std, 0.0, abs_tol=1e-8)
    out[m.FRAC_REWARD_ZERO_STD] = zero_std / len(rewards) if rewards else math.nan
    return out


def batch_columns(result: RewardResult) -> RewardResult:
    """Only what ``reward_metrics`` reads (the functions' names and values, the weighted
    rewards): what replicas exchange to log one batch's metrics (no prompts: a million-token
    prompt must not travel)."""
    return RewardResult(result.names, list(result.rewards), result.rewards_per_func)


def _nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _nanstd(values: Sequence[float]) -> float:
    """Bessel-corrected std ignoring NaN, as TRL's ``nanstd`` (NaN below two values)."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return math.nan
    mean = sum(kept) / len(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
