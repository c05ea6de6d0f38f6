"""The step's bookkeeping around a recipe's GRPO loop: the optimizer step behind the
non-finite guard, skipped steps, the step's peak memory, and its metrics.

Why apart from the loop: none of this is GRPO. A recipe's ``train_rollout`` calls
``optimizer_step`` and ``step_metrics`` once per optimizer step, ``skip_rollout`` for a
rollout that cannot be trained on, and ``start_step`` / ``note_peak`` around its passes; the
metric names are ``longstraw_core.metrics.names``' (TRL's where TRL has them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import longstraw_core as ls
from longstraw_core import distributed
from longstraw_core.data import samples as data
from longstraw_core.grpo import generation
from longstraw_core.metrics import names
from longstraw_core.process import guard
from longstraw_core.process.failpoints import failpoint
from longstraw_core.rewards import RewardResult, RewardSet
from longstraw_core.training import tracking

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from longstraw_core.config import RunConfig
    from longstraw_core.models.mixed_precision import FullPrecision, WorkingWeights
    from longstraw_core.parallel.topology import RunTopology
    from longstraw_core.process.progress import StepProgress


class Rollout(NamedTuple):
    """One group of a step, as rolled out and scored (its prompt state is not kept)."""

    sample: data.Sample
    out: ls.RolloutOutput
    completions: list[str]
    scored: RewardResult
    state_bytes: dict[str, int]  # the prompt's prefix state by layer type
    tool_counts: tuple[int, int] | None = None  # an agent run's tool calls and failed calls


def policy_lengths(group: generation.CollectedGroup) -> list[int]:
    """Each response's length as TRL's ``completions/*`` count it: the policy's own tokens
    (an agent's tool results, loss mask 0, left out)."""
    masks = group.loss_masks or [None] * len(group.responses)
    return [
        len(r) if m is None else int(m.sum()) for r, m in zip(group.responses, masks, strict=True)
    ]


def state_bytes(state: ls.PrefixState) -> dict[str, int]:
    """The prefix state's size by layer type, as the step's ``state_bytes/<kind>`` metrics."""
    return {
        names.STATE_BYTES_BY_TYPE.format(kind): v["bytes"] for kind, v in state.summary().items()
    }


class StepBookkeeping:
    """What every optimizer step does besides the GRPO loss (``Session`` sets the fields)."""

    cfg: RunConfig
    accelerator: Accelerator
    topology: RunTopology
    grpo: ls.GRPOConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: FullPrecision | WorkingWeights
    guard: guard.NonFiniteGuard
    logger: tracking.RunLogger
    progress: StepProgress
    rewards: RewardSet
    world_size: int
    step: int
    step_peak: int = 0
    updates: int = 0  # optimizer steps of this process that changed the weights

    def start_step(self) -> None:
        """A new optimizer step: its peak memory counts from here (prefill to optimizer)."""
        failpoint("step.start", self.step + 1)  # fault-injection tests (a no-op otherwise)
        names.reset_peak_memory(self.accelerator.device)
        self.step_peak = 0

    def note_peak(self, peak_bytes: int | None = None) -> None:
        """Fold a pass's own peak (``peak_bytes``: ``grpo_step``'s, measured apart from the
        device's) into the step's; None: the device's peak so far."""
        if peak_bytes is None:
            peak_bytes = names.peak_memory_bytes(self.accelerator.device)
        self.step_peak = max(self.step_peak, peak_bytes)

    def optimizer_step(self, loss: float) -> tuple[float, str | None]:
        """Clip and step; a non-finite loss or gradient norm (on any rank) skips the update.
        Returns the gradient norm and why the update was skipped (None: it was not)."""
        with self.progress.phase("optimizer"):
            return self._optimizer_step(loss)

    def _optimizer_step(self, loss: float) -> tuple[float, str | None]:
        self.precision.to_masters()  # float32 weights and gradients for the clip and AdamW
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        # Replicas of a stage average their gradients; the clip uses the whole model's norm.
        norm = self.topology.finish_gradients(parameters, self.cfg.optim.max_grad_norm)
        reason = guard.non_finite_reason(loss, norm)
        if distributed.any_rank(reason is not None):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, reason or "another rank's loss is not finite"
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.passed()
        self.updates += 1
        return norm, None

    def rewards_failed(self, scored: RewardResult) -> str | None:
        """Why a group cannot be trained on: every reward function failed on every completion
        of ``scored`` on some rank (None: on none). A reduction, so every rank decides the
        same, and the reason names the ranks where it happened."""
        ranks = distributed.ranks_where(scored.all_failed)
        if not ranks:
            return None
        where = ""
        if self.world_size > 1:
            listed = ", ".join(map(str, ranks))
            where = f" on rank{'s' if len(ranks) > 1 else ''} {listed} of {self.world_size}"
        return f"every reward function failed on every completion{where}"

    def step_metrics(
        self,
        batch: ls.GenerationBatch,
        rollouts: list[Rollout],
        results: list[ls.GRPOStepResult],
        grad_norm: float,
        skip_reason: str | None,
        *,
        first: bool,
    ) -> dict[str, float]:
        """This rank's metrics of the optimizer step just taken (``first``: the rollouts'
        first update, which counts their tokens); logs the completions table when due."""
        if first:  # the rollouts' reward failures, one line per function
            self.rewards.report_failures(f"step {self.step + 1}")
        every = self.cfg.train.completions_every
        if every and (self.step + 1) % every == 0:
            rows = [
                row
                for k, ro in enumerate(rollouts)
                for row in tracking.completion_rows(
                    ro.scored,
                    batch.advantages(k),
                    sample=ro.sample.id,
                    **tracking.answer_columns(ro.sample),
                )
            ]
            rows = distributed.gather_rows(self.topology.rows_to_log(rows))  # one per replica
            self.logger.log_completions(self.step + 1, rows)
        # grpo_step's metrics (no prefill_seconds: the prefill is the recipe's, time/prefill)
        # and the reward set's (TRL's reward and reward_std), over this rank's groups.
        groups = generation.combine_group_metrics(
            [r.metrics() for r in results]
            + [ro.scored.metrics() | ro.state_bytes for ro in rollouts]
        )
        advantages = [abs(a) for k in range(len(rollouts)) for a in batch.advantages(k)]
        speed = [ro.out.stats["tokens_per_second"] for ro in rollouts]
        # TRL's reward and completions/* metrics over every replica's groups (collectives);
        # num_tokens once per rollout
        scale = self.grpo.scale_rewards
        batch_rewards = self.topology.reward_metrics([ro.scored for ro in rollouts], scale)
        completions = self.topology.completion_metrics(
            [(len(g.prompt_ids), policy_lengths(g), g.truncated) for g in batch.groups]
        )
        if any(ro.tool_counts is not None for ro in rollouts):  # every rank of an agent run
            completions |= self.topology.tool_metrics(
                [(*ro.tool_counts, len(ro.out.responses)) for ro in rollouts if ro.tool_counts]
            )
        if not first:
            completions[names.NUM_TOKENS] = 0.0
        return {
            **groups,
            names.LOSS: batch.step_loss(),  # averaged over ranks: the step's loss
            names.ADVANTAGE_ABS_MEAN: sum(advantages) / len(advantages),
            names.GRAD_NORM: grad_norm,
            names.LEARNING_RATE: self.scheduler.get_last_lr()[0],
            names.ROLLOUT_TOKENS_PER_SECOND: sum(speed) / len(speed),
            **batch_rewards,
            **completions,
            names.STEP_PEAK_MEMORY_BYTES: max(
                self.step_peak, names.peak_memory_bytes(self.accelerator.device)
            ),
            **(self._skip(skip_reason) if skip_reason else self._passed()),
        }

    def skip_rollout(self, reason: str, *, rewards: bool = False) -> Iterator[dict[str, float]]:
        """A rollout that cannot be trained on: each of its optimizer steps is skipped.
        ``rewards``: because its rewards failed (``rewards_failed``), which the stop after
        too many skips names instead of divergence."""
        self.rewards.report_failures(f"step {self.step + 1}")
        fix = guard.REWARDS_FIX if rewards else guard.DIVERGED_FIX
        for _ in range(self.grpo.num_iterations):
            yield self._skip(reason, fix=fix)

    def _passed(self) -> dict[str, float]:
        return {names.SKIPPED: 0.0, names.SKIPPED_STEPS: float(self.guard.skipped)}

    def _skip(self, reason: str, fix: str = guard.DIVERGED_FIX) -> dict[str, float]:
        """This step changes nothing (no update, no scheduler step): count it, say why."""
        self.precision.to_masters()
        self.optimizer.zero_grad(set_to_none=True)
        write = self.progress.write if self.accelerator.is_main_process else lambda line: None
        self.guard.skip(self.step + 1, reason, write=write, fix=fix)  # raises past the limit
        return {names.SKIPPED: 1.0, names.SKIPPED_STEPS: float(self.guard.skipped)}
