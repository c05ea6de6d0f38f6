"""One generation batch: the groups of an optimizer step, and the updates taken on them.

TRL generates ``prompts x num_generations`` completions at once (its generation batch, every
rank's prompts together), normalises the loss over that whole batch, and takes
``num_iterations`` optimizer steps on it. LongStraw rolls out a rank's
``train.prompts_per_step`` groups one after another, because the prefix states of several
million-token prompts do not fit side by side, and replays each group right after its rollout,
so that its prompt is prefilled once. ``GenerationBatch`` makes that equal TRL's batch
(``docs/design.md``, "Several prompts and updates per step"):

- **The loss normaliser** (all the step's active tokens, or responses; ``losses``) is known
  only after the last rollout on every rank. Group ``k`` replays with the provisional
  ``loss_scale = world x share_k / D``, ``D = prompts x`` the first round's total over the
  ranks; once every group is in, ``finish`` multiplies the accumulated gradient by
  ``D / N``, ``N`` the step's true total. Exact: the gradient is linear in the scale. With
  one prompt per step, or a response-normalised loss (every group has G responses), ``D = N``
  and nothing is multiplied.
- **``scale_rewards="batch"``** divides by the std of every reward of the step. Replays use
  the first round's std ``s1``; ``finish`` multiplies the gradient by
  ``(s1 + eps) / (s + eps)``. Exact when ``beta == 0``: every loss type's policy term is
  positively homogeneous of degree one in the advantage (clipping, sapo's temperature and
  vespo's ``(k, lambda)`` read only its sign). The KL term does not scale with the
  advantage, so with ``beta > 0`` (and several prompts) the replays wait for the last rollout:
  their states are dropped and prefilled again, one more prefill per prompt but the last.
- **Later updates** (``num_iterations > 1``) replay every group again with the step's final
  shares, the first update's log-probs as ``old_logps`` (TRL's ``old_per_token_logps``: the
  weights before any update of this generation; the first update is on-policy, its ratio is 1)
  and the reference log-probs scored once. Each needs a fresh prefill of its prompt, since
  the prefix state depends on the weights.

Every rank calls ``add`` (once per prompt) and ``finish`` the same number of times: they
are collectives over ``group`` (the replicas of a pipeline stage, or every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from longstraw_core.distributed import sum_over_ranks
from longstraw_core.grpo.groups import step_reward_std
from longstraw_core.grpo.losses import (
    ADVANTAGE_STD_EPS,
    check_loss_masks,
    group_advantages,
    loss_mask_counts,
    normaliser_share,
)
from longstraw_core.schema.grpo import GRPOConfig

if TYPE_CHECKING:
    from longstraw_core.grpo.replay import GRPOStepResult


@dataclass(frozen=True)
class Share:
    """What a group's replay scales by: ``grpo_step``'s ``loss_scale`` and, with
    ``scale_rewards="batch"``, ``reward_std``, the std its advantages divide by (None
    otherwise; ``GenerationBatch.reward_std``)."""

    loss_scale: float
    reward_std: float | None


@dataclass
class CollectedGroup:
    """One rolled-out group, kept for the updates of its generation: the prompt's token ids
    (not its state), the responses and their rewards, and after its first replay the
    policy's and reference's per-token log-probs (the later updates' ``old_logps`` and
    ``ref_logps``). ``loss_masks``: the responses' loss masks (``losses.check_loss_masks``:
    bool tensors, None for all ones), None for none."""

    prompt_ids: torch.Tensor
    responses: list[torch.Tensor]
    rewards: list[float]
    truncated: list[bool]
    share: int  # its part of the step's loss normaliser (losses.normaliser_share)
    loss_masks: list[torch.Tensor | None] | None = None
    old_logps: list[torch.Tensor | None] | None = None
    ref_logps: list[torch.Tensor | None] | None = None
    loss: float = 0.0  # its part of the step's loss in its latest replay


class GenerationBatch:
    """The groups one optimizer step trains on: ``prompts`` on this rank, each rank its own.

    Per prompt: ``add`` after its rewards (a collective), then, if it returns a ``Share``,
    ``grpo_step(..., **replay_kwargs(k, group_advantages(rewards, scale_rewards,
    std=reward_std)))`` with the state the rollout used and ``record(k, result)``. After
    the last prompt, ``finish(parameters)`` (a collective), then
    the groups of ``waiting()`` (their replays had to wait) the same way with a fresh prefill
    (the last one's state may still be alive). Every later update of ``num_iterations``:
    every group again, each with a fresh prefill. ``step_loss()`` is the update's loss.
    """

    def __init__(
        self, config: GRPOConfig, prompts: int, *, group: dist.ProcessGroup | None = None
    ) -> None:
        if prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {prompts}")
        self.config, self.prompts, self.group = config, prompts, group
        self.groups: list[CollectedGroup] = []
        batch_std = config.scale_rewards == "batch"
        # With beta > 0 the KL term does not scale with the advantage: see the module docstring.
        self.defers_replay = prompts > 1 and batch_std and config.beta != 0.0
        self.finished = False
        self.gradient_factor = 1.0  # what finish multiplied the gradients by
        self._world = 1
        self._first_total: float | None = None  # the first round's normaliser, every rank
        self._totals: list[float] = []
        self._first_std: float | None = None  # the first round's reward std, every rank
        self._final_std: float | None = None
        self._final_total = 0.0
        self._replayed: list[int] = []  # replays so far, per group
        self._scales: list[float] = []  # the loss_scale of each group's latest replay_kwargs

    # --- the first update --------------------------------------------------------------------

    def add(
        self,
        prompt_ids: torch.Tensor,
        responses: Sequence[torch.Tensor],
        rewards: Sequence[float],
        truncated: Sequence[bool],
        loss_masks: Sequence[torch.Tensor | Sequence[int] | None] | None = None,
    ) -> Share | None:
        """Keep a rolled-out group; the ``Share`` to replay it with now, or None when its
        replay waits for ``finish`` (``defers_replay``). A collective: one small all-reduce
        (two more on the first call with ``scale_rewards="batch"``). ``loss_masks``: the
        responses' loss masks (``grpo_step``'s, e.g. a rollout's ``out.loss_masks``), which
        the step's token normaliser counts and every replay of the group passes on."""
        if self.finished or len(self.groups) == self.prompts:
            raise RuntimeError(f"add called after the step's {self.prompts} groups were in")
        lengths = [len(r) for r in responses]
        masks = None if loss_masks is None else check_loss_masks(loss_masks, lengths)
        counts = lengths if masks is None else loss_mask_counts(masks, lengths)
        share = normaliser_share(counts, truncated, self.config)
        group = CollectedGroup(
            prompt_ids, list(responses), [float(r) for r in rewards], list(truncated), share,
            masks,
        )  # fmt: skip
        self.groups.append(group)
        self._replayed.append(0)
        self._scales.append(0.0)
        (total,), self._world = sum_over_ranks([float(share)], group=self.group)
        self._totals.append(total)
        if self._first_total is None:
            self._first_total = total
            std = self._batch_std([group.rewards])
            # Fewer than two scorable rewards so far: any positive stand-in, finish corrects.
            self._first_std = 1.0 if std is not None and math.isnan(std) else std
        return None if self.defers_replay else self._provisional_share(len(self.groups) - 1)

    def finish(
        self,
        parameters: Iterable[torch.nn.Parameter],
        scale: Callable[[Iterable[torch.nn.Parameter], float], None] | None = None,
    ) -> float:
        """Close the batch once every group is in: the step's true normaliser and reward std
        (a collective), and the accumulated gradients of ``parameters`` multiplied by the
        correction of the provisional shares the replays so far used (by ``scale``, default
        ``scale_gradients``: where the run keeps them, e.g. bf16 working weights' float32
        sums). Returns that factor (1.0: nothing was multiplied)."""
        if len(self.groups) != self.prompts or self.finished:
            raise RuntimeError(
                f"finish needs all {self.prompts} groups, once; have {len(self.groups)}"
            )
        self.finished = True
        self._final_total = sum(self._totals)
        std = self._batch_std([g.rewards for g in self.groups])
        # TRL's std of fewer than two scorable rewards is NaN and its advantages then 0
        # (nan_to_num); an infinite std gives those zeros.
        self._final_std = math.inf if std is not None and math.isnan(std) else std
        if self.defers_replay or not any(self._replayed):
            return 1.0
        factor = self._normaliser_guess() / max(self._final_total, 1.0)
        if self._final_std is not None:
            factor *= (self._first_std + ADVANTAGE_STD_EPS) / (self._final_std + ADVANTAGE_STD_EPS)
        self.gradient_factor = factor
        if factor != 1.0:
            (scale or scale_gradients)(parameters, factor)
            for group, replays in zip(self.groups, self._replayed, strict=True):
                if replays:
                    group.loss *= factor
        return factor

    def waiting(self) -> list[int]:
        """The groups not replayed yet (after ``finish``), the last first: its prefix state
        may still be the rollout's."""
        return sorted((k for k, n in enumerate(self._replayed) if not n), reverse=True)

    # --- every update ------------------------------------------------------------------------

    def share(self, k: int) -> Share:
        """Group ``k``'s final share (after ``finish``)."""
        if not self.finished:
            raise RuntimeError("the final shares are known after finish()")
        return Share(self._scale(self.groups[k].share, self._final_total), self._final_std)

    def replay_kwargs(self, k: int, advantages: Sequence[float]) -> dict[str, Any]:
        """``grpo_step``'s keywords for group ``k``'s next replay: the caller's ``advantages``
        (``group_advantages`` of its rewards with ``reward_std``, or ``advantages(k)``; taken
        here so that no replay can go without them and silently divide by its own group's
        std under ``scale_rewards="batch"``), its truncation flags and loss masks, the loss
        share to use (provisional before ``finish``), and from the second replay on the first
        one's log-probs as ``old_logps`` and ``ref_logps``."""
        group = self.groups[k]
        if self.finished:
            share = self.share(k)
        elif self.defers_replay:
            raise RuntimeError("with defers_replay, groups replay after finish()")
        else:
            share = self._provisional_share(k)
        self._scales[k] = share.loss_scale
        if len(advantages) != len(group.responses):
            raise ValueError(
                f"group {k}: {len(advantages)} advantages for {len(group.responses)} responses"
            )
        return {
            "advantages": advantages,
            "truncated": group.truncated,
            "loss_masks": group.loss_masks,
            "loss_scale": share.loss_scale,
            "old_logps": group.old_logps,
            "ref_logps": group.ref_logps,
        }

    def record(self, k: int, result: GRPOStepResult) -> None:
        """After group ``k``'s replay (with ``replay_kwargs(k, advantages)``): its part of the update's
        loss, and, after its first replay, the log-probs the later updates read."""
        group = self.groups[k]
        group.loss = result.loss * self._scales[k]
        if not self._replayed[k]:
            group.old_logps, group.ref_logps = list(result.logps), list(result.ref_logps)
        self._replayed[k] += 1

    def step_loss(self) -> float:
        """This rank's part of the update's loss (the mean over ranks is the step's loss:
        the shares carry the world size)."""
        return sum(group.loss for group in self.groups)

    @property
    def reward_std(self) -> float | None:
        """What ``scale_rewards="batch"`` divides the advantages by now: the std of every
        reward of the step after ``finish``, the first round's before it (``finish`` corrects
        the gradients); None for ``"group"`` and ``"none"`` (each group's own, or none)."""
        return self._final_std if self.finished else self._first_std

    def advantages(self, k: int) -> list[float]:
        """Group ``k``'s advantages with ``reward_std`` (the step's after ``finish``)."""
        rewards = self.groups[k].rewards
        return group_advantages(rewards, self.config.scale_rewards, std=self.reward_std).tolist()

    # --- internals ---------------------------------------------------------------------------

    def _provisional_share(self, k: int) -> Share:
        return Share(self._scale(self.groups[k].share, self._normaliser_guess()), self._first_std)

    def _normaliser_guess(self) -> float:
        """``D``: the first round's total over the ranks times the prompts (exact with one
        prompt, and for response-normalised losses)."""
        return max(self.prompts * self._first_total, 1.0)

    def _scale(self, share: int, total: float) -> float:
        return self._world * share / max(total, 1.0)

    def _batch_std(self, rewards: Sequence[Sequence[float]]) -> float | None:
        if self.config.scale_rewards != "batch":
            return None
        return step_reward_std(rewards, group=self.group)


def scale_gradients(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every accumulated ``.grad`` by ``factor`` in place (sharded ones too: each
    rank its own shard)."""
    with torch.no_grad():
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(factor)


# Metrics of several groups' grpo_step: the mean over the groups, but these.
_SUMMED = ("_seconds",)
_LARGEST = ("peak",)


def combine_group_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One update's metrics from its groups' (``GRPOStepResult.metrics()``, the reward set's):
    the mean over the groups that report a key, NaN left out as ``reduce_metrics`` does across
    ranks; times (``*_seconds``) summed, peak memory the largest."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in metrics for k in m):
        values = [float(m[key]) for m in metrics if key in m and not math.isnan(float(m[key]))]
        if not values:
            out[key] = math.nan
        elif any(key.endswith(suffix) for suffix in _SUMMED):
            out[key] = sum(values)
        elif any(word in key for word in _LARGEST):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out
