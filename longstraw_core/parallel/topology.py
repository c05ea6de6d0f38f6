"""How a recipe's rank takes part in a run: which prompt it trains, which stage it runs.

``RunTopology.from_config`` reads ``distributed.pipeline_stages`` and the world. One process
and FSDP runs (S=1): every rank is its own replica (its own prompts each step), and FSDP
averages the gradients. Pipeline runs (S>1): the world is S stages x D replicas; the S ranks
of a replica train its prompts together, its stages exchanging hidden states, and the
replicas of each stage average their gradients here, or, with ``distributed.fsdp=true``,
FSDP2 shards each stage over its replicas (``shard_mesh``) and averages them itself.
Recipes make the same few calls either way: ``place`` the adapter, shard it over
``shard_mesh()``, take samples ``data_position + replica * prompts_per_step + k``,
``finish_gradients`` before the optimizer step, ``reduce`` the metrics, ``completion_metrics``
for the step's completions, ``rows_to_log`` for the completions table, ``gather_replicas`` for
what every replica found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longstraw_core.config import ConfigError
from longstraw_core.distributed import gather_rows, reduce_metrics
from longstraw_core.metrics import names
from longstraw_core.parallel.fsdp import shard_model
from longstraw_core.parallel.mesh import REPLICA, STAGE, pipeline_mesh, stage_adapter
from longstraw_core.pipeline.gradients import average_over_replicas, clip_grad_norm
from longstraw_core.pipeline.layout import StageLayoutError, check_stage_count
from longstraw_core.rewards import RewardResult, batch_columns, reward_metrics

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.config import DistributedSection

Row = TypeVar("Row")
# Per-rank byte counts of what a stage holds: summed over a pipeline's stages.
_STAGE_SUMS = (names.STATE_BYTES, names.STATE_GRAD_BYTES, names.ATTENTION_OUTPUT_BYTES)
_PEAKS = (names.PEAK_MEMORY_BYTES, names.STEP_PEAK_MEMORY_BYTES)
_EXTREMES = {key: "min" for key in names.MIN_OVER_RANKS} | {
    key: "max" for key in names.MAX_OVER_RANKS
}


@dataclass
class RunTopology:
    """This rank's replica and stage (``replicas x stages`` = the world)."""

    replicas: int
    replica: int
    stages: int = 1
    stage: int = 0
    mesh: DeviceMesh | None = None
    stage_starts: Sequence[int] | None = None
    replay_pieces: int | None = None  # distributed.replay_pieces (None: the schedule's choice)
    gradient: str = "detached"  # the gradient mode the stage boundaries are balanced for
    fsdp: bool = False  # FSDP2 shards the model (with stages: each stage over its replicas)

    @classmethod
    def from_config(
        cls, distributed: DistributedSection, world: int, rank: int, gradient: str = "detached"
    ) -> RunTopology:
        """Check ``distributed.pipeline_stages`` against the world, before any model loads;
        ``gradient``: the run's ``grpo.gradient`` (exact mode balances ``dS`` too)."""
        stages = distributed.pipeline_stages
        try:
            check_stage_count(stages, world_size=world)
        except StageLayoutError as error:
            raise ConfigError("distributed.pipeline_stages", str(error)) from None
        if stages == 1:
            return cls(replicas=world, replica=rank, fsdp=distributed.fsdp)
        mesh = pipeline_mesh(stages)
        return cls(
            replicas=world // stages,
            replica=mesh.get_local_rank(REPLICA),
            stages=stages,
            stage=mesh.get_local_rank(STAGE),
            mesh=mesh,
            stage_starts=distributed.stage_starts,
            replay_pieces=distributed.replay_pieces,
            gradient=gradient,
            fsdp=distributed.fsdp,
        )

    @property
    def staged(self) -> bool:
        return self.mesh is not None

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def place(self, adapter: ModelAdapter) -> ModelAdapter:
        """Put ``adapter`` on this rank's stage (no-op without stages); a model with fewer
        layers than stages is refused naming ``distributed.pipeline_stages``."""
        if not self.staged:
            return adapter
        try:
            return stage_adapter(
                adapter, self.mesh, self.stage_starts, self.gradient, self.replay_pieces
            )
        except StageLayoutError as error:
            key = "distributed.stage_starts" if self.stage_starts else "distributed.pipeline_stages"
            raise ConfigError(key, str(error)) from None

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks whose prompts make one optimizer step's batch, for one stage."""
        return self.mesh.get_group(REPLICA) if self.staged else None

    def shard_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over (``shard_model(..., mesh=)``): a stage's replicas with
        stages, every rank (``None``, the default) without."""
        return self.mesh[REPLICA] if self.staged else None

    def shard(
        self,
        adapter: ModelAdapter,
        distributed: DistributedSection,
        device: torch.device | None = None,
    ) -> ModelAdapter:
        """With ``distributed.fsdp``: FSDP2 over ``shard_mesh()`` with the config's settings
        (after ``place``, before the optimizer is built; ``device``: where a model still on
        ``meta`` will be materialised); else ``adapter`` as it is."""
        if not distributed.fsdp:
            return adapter
        return shard_model(
            adapter,
            mixed_precision=distributed.mixed_precision,
            reshard_after_forward=distributed.reshard_after_forward,
            mesh=self.shard_mesh(),
            device=device,
        )

    def finish_gradients(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float | None
    ) -> float:
        """Average the gradients over the replicas (stages without FSDP; FSDP did it already)
        and clip by the whole model's norm; returns that norm."""
        parameters = list(parameters)
        limit = max_norm or float("inf")
        if not self.staged:
            return float(torch.nn.utils.clip_grad_norm_(parameters, limit))
        if self.fsdp:  # each rank holds a shard of its stage's averaged gradients
            return float(clip_grad_norm(parameters, limit, dist.group.WORLD))
        average_over_replicas(parameters, self.replica_group())
        return float(clip_grad_norm(parameters, limit, self.mesh.get_group(STAGE)))

    def reduce(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The step's metrics over the ranks: the mean over replicas (TRL's minima and maxima:
        the smallest and largest); with stages, what a stage holds summed over its pipeline
        first, and peak memory the largest rank's."""
        if not self.staged:
            return reduce_metrics(metrics, ops=_EXTREMES)
        stage_group = self.mesh.get_group(STAGE)
        summed_keys = [k for k in metrics if k in _STAGE_SUMS or k.startswith("state_bytes/")]
        pipeline = reduce_metrics({k: metrics[k] for k in summed_keys}, "sum", group=stage_group)
        summed = reduce_metrics(pipeline)  # the mean over the replicas' pipelines
        peaks = reduce_metrics({k: metrics[k] for k in _PEAKS if k in metrics}, "max")
        return reduce_metrics(metrics, ops=_EXTREMES) | summed | peaks

    def rows_to_log(self, rows: Sequence[Row]) -> list[Row]:
        """This rank's share of the completions table: its replica's rows, from one stage."""
        return list(rows) if self.is_last_stage else []

    def gather_replicas(self, rows: Sequence[Row]) -> list[Row]:
        """Every replica's ``rows`` (picklable; from one stage each: a pipeline's stages hold
        the same) on every rank, in replica order. Collective: every rank calls it."""
        return gather_rows(self.rows_to_log(rows))

    def reward_metrics(
        self, results: Sequence[RewardResult], scale_rewards: str | bool
    ) -> dict[str, float]:
        """TRL's reward metrics (``rewards.reward_metrics``) over every replica's groups of the
        step, gathered: the batch's nan-means and stds as TRL logs them, not averages of each
        group's; the same on every rank. Collective."""
        groups = self.gather_replicas([batch_columns(result) for result in results])
        return reward_metrics(groups, scale_rewards)

    def tool_metrics(self, groups: Sequence[tuple[int, int, int]]) -> dict[str, float]:
        """TRL's ``tools/*`` over every replica's groups of the step: ``groups`` holds this
        replica's ``(calls, failed calls, completions)`` per prompt; counts summed over the
        replicas first, as TRL gathers them. Collective."""
        rows = self.gather_replicas(list(groups))
        calls, failures, completions = (sum(r[i] for r in rows) for i in range(3))
        return names.tool_metrics(calls, failures, completions)

    def completion_metrics(
        self, groups: Sequence[tuple[int, Sequence[int], Sequence[bool]]]
    ) -> dict[str, float]:
        """TRL's ``completions/*`` over every replica's completions of the step (gathered: the
        exact minima, maxima and means of the whole batch, as TRL's over its gathered
        batch), and the step's ``num_tokens`` (each completion with its prompt); the same on
        every rank. ``groups``: this replica's ``(prompt tokens, completion lengths,
        truncation flags)`` per prompt. Collective."""
        rows = self.gather_replicas(
            [
                (prompt_tokens, int(n), bool(cut))
                for prompt_tokens, lengths, truncated in groups
                for n, cut in zip(lengths, truncated, strict=True)
            ]
        )
        step_tokens = sum(prompt + length for prompt, length, _ in rows)
        return names.completion_metrics([r[1] for r in rows], [r[2] for r in rows]) | {
            names.NUM_TOKENS: float(step_tokens)
        }
