"""The world as S pipeline stages x D data-parallel replicas, and an adapter put on its stage.

Ranks form a 2-D ``DeviceMesh`` ``("replica", "stage")`` of shape ``(D, S)``: global rank
``d * S + s`` is stage ``s`` of replica ``d``, so a pipeline's stages are neighbouring ranks
(one node's GPUs, linked by NVLink, for S up to 8). Each replica trains its own prompt; the
stages of a replica exchange hidden states (``transport``), the replicas of a stage average
their gradients (``gradients``).

Typical use under ``torchrun``::

    dist.init_process_group("gloo")  # "nccl" on GPUs
    mesh = pipeline_mesh(stages=2)
    adapter = stage_adapter(ls.adapt(model), mesh)  # before the optimizer is built
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longstraw_core.adapters.stage_cut import stage_model
from longstraw_core.distributed.processes import group_timeout
from longstraw_core.pipeline.layout import (
    StageLayout,
    check_stage_count,
)
from longstraw_core.pipeline.transport import StageLink

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter

REPLICA, STAGE = "replica", "stage"


def pipeline_mesh(
    stages: int, device_type: str | None = None, timeout: timedelta | None = None
) -> DeviceMesh:
    """The ``(replicas, stages)`` mesh over every rank of the default process group.

    Its groups are made here with ``timeout`` (default: the world's, which the recipes set
    from ``distributed.timeout_minutes``): ``init_device_mesh`` would make them with torch's
    default (NCCL's 10 minutes), and FSDP's replica groups and the clip's stage groups are
    these. A dimension spanning the whole world reuses the default group, as
    ``init_device_mesh`` does. On CUDA the rank's GPU must be current before the call
    (``torch.cuda.set_device``; accelerate sets it; here it is set from ``LOCAL_RANK`` when
    nothing has used CUDA yet, as ``init_device_mesh`` does).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "pipeline stages need a process group: run under torchrun and call "
            "torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or world % stages:
        raise ValueError(
            f"distributed.pipeline_stages={stages!r} must divide the {world} processes "
            "(the world is stages x data-parallel replicas)"
        )
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    if device_type == "cuda" and not torch.cuda.is_initialized() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timeout or group_timeout()
    ranks = torch.arange(world).reshape(world // stages, stages)
    # Every rank makes every group, in the same order (new_group's rule): the replica groups
    # (the mesh's columns), then the pipelines (its rows).
    groups = [
        _dimension_group(ranks.T.tolist(), timeout),
        _dimension_group(ranks.tolist(), timeout),
    ]
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=(REPLICA, STAGE))


def _dimension_group(members: list[list[int]], timeout: timedelta | None) -> dist.ProcessGroup:
    """This rank's group among ``members`` (each a list of ranks, together every rank once),
    made with ``timeout``; the default group when one list holds the world."""
    if len(members) == 1:
        return dist.group.WORLD
    mine, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
    return mine


def stage_link(
    mesh: DeviceMesh, device: torch.device, timeout: timedelta | None = None
) -> StageLink:
    """This rank's link to the other stages of its replica.

    Each pair of stages that exchange (``s`` and ``s + 1``, and the ring's last and first)
    gets a 2-rank process group of its own, so that each pair's batched point-to-point ops
    run on their own NCCL stream (``transport``'s docstring says why one group per pipeline
    hangs). That is ``S`` communicators per pipeline (one at ``S = 2``), two per rank.
    Every rank creates every pipeline's pair groups, in the same order, as ``new_group``
    requires, with ``timeout`` (default: the world's, ``group_timeout``); a barrier in
    each of its own then initialises them, in an order that cannot wait in a circle (pair
    ``k`` joins stages ``k`` and ``k + 1``; each rank takes its lower pair first, so the
    ring's pair ``S - 1`` waits for stage 0's pair 0 only).
    """
    timeout = timeout or group_timeout()
    group = mesh.get_group(STAGE)
    stages = mesh.size(mesh.mesh_dim_names.index(STAGE))
    stage = mesh.get_local_rank(STAGE)
    rank, world = dist.get_rank(), dist.get_world_size()
    pair_groups: dict[int, dist.ProcessGroup] = {}
    for first in range(0, world, stages):
        for a, b in stage_pairs(stages):
            pair = dist.new_group([first + a, first + b], timeout=timeout)
            if rank in (first + a, first + b):
                pair_groups[b if stage == a else a] = pair
    for peer in sorted(pair_groups, key=lambda p: _pair_index(stage, p, stages)):
        dist.barrier(group=pair_groups[peer])
    return StageLink(
        ranks=dist.get_process_group_ranks(group),
        stage=stage,
        group=group,
        device=device,
        pair_groups=pair_groups,
    )


def stage_pairs(stages: int) -> list[tuple[int, int]]:
    """The pairs of stages that exchange, ``(k, k + 1 mod S)``: neighbours carry hidden
    states and their gradients, the ring's ``(S - 1, 0)`` rollout's tokens. One pair at
    ``S = 2`` (both directions share it), none at ``S = 1``."""
    if stages < 2:
        return []
    count = 1 if stages == 2 else stages
    return [(k, (k + 1) % stages) for k in range(count)]


def _pair_index(stage: int, peer: int, stages: int) -> int:
    """Pair ``k`` of ``stage_pairs`` joining ``stage`` and ``peer``."""
    pairs = stage_pairs(stages)
    return next(k for k, pair in enumerate(pairs) if set(pair) == {stage, peer})


def replica_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks holding the same stage in every replica (they average gradients)."""
    return mesh.get_group(REPLICA)


def default_layout(adapter: ModelAdapter, stages: int, gradient: str = "detached") -> StageLayout:
    """The planner's stage boundaries for ``adapter``'s model (``plan.stage_layout``: each
    stage's prefix state, weights and compute balanced), read from the adapter's own records
    and layers; ``gradient="exact"`` counts exact mode's ``dS`` with the state."""
    from longstraw_core.plan import stage_layout
    from longstraw_core.plan.model import ModelSpec

    spec = ModelSpec.from_model(adapter.causal_lm, adapter.config.model_type)
    return stage_layout(spec, stages, gradient=gradient)


def stage_adapter(
    adapter: ModelAdapter,
    mesh: DeviceMesh,
    starts: Sequence[int] | None = None,
    gradient: str = "detached",
    replay_pieces: int | None = None,
) -> ModelAdapter:
    """Put ``adapter`` on this rank's stage of ``mesh`` (``stage_model``), in place.

    ``starts``: each stage's first layer (config ``distributed.stage_starts``); default: the
    planner's balanced ``default_layout`` for the ``gradient`` mode. Every rank must pass the
    same model, ``starts``, ``gradient`` and ``replay_pieces`` (pieces per replayed
    branch; ``None``: the schedule's choice, ``Stage.pieces_for``).
    """
    stages = mesh.size(mesh.mesh_dim_names.index(STAGE))
    num_layers = len(adapter.decoder.layers)
    check_stage_count(stages, num_layers)
    if starts is not None:
        layout = StageLayout.from_starts(starts, num_layers)
        if layout.stages != stages:
            raise ValueError(
                f"distributed.stage_starts={list(starts)} gives {layout.stages} stages, but "
                f"distributed.pipeline_stages={stages}"
            )
    else:
        layout = default_layout(adapter, stages, gradient)
    return stage_model(adapter, layout, stage_link(mesh, adapter.device), replay_pieces)
