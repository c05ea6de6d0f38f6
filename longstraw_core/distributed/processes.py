"""What a run of several processes needs to start and end: the check that they share the
model, the process group's timeout, and a finished rank's exit."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from longstraw_core.config.schema import ConfigError

if TYPE_CHECKING:
    from accelerate.utils import InitProcessGroupKwargs


def require_sharding(world_size: int, fsdp: bool, pipeline_stages: int = 1) -> None:
    """Refuse a run of several processes that would not share the model.

    Unsharded and unstaged, each process would train its own copy of the model on its own
    groups and nothing would average their gradients: ``world_size`` diverging runs that look
    like one. Pipeline stages share it (each owns its layers; replicas average gradients).
    """
    if world_size > 1 and not fsdp and pipeline_stages == 1:
        raise ConfigError(
            "distributed.fsdp",
            f"{world_size} processes run this recipe but the model is neither sharded nor "
            "staged, so each would train its own copy with nothing averaging their gradients; "
            "set distributed.fsdp=true or distributed.pipeline_stages, or run a single process",
        )


def process_group_kwargs(timeout_minutes: float) -> InitProcessGroupKwargs:
    """What the recipes hand accelerate for ``init_process_group``: the run's
    ``distributed.timeout_minutes``. NCCL's default (10 minutes) is shorter than rank 0
    writing a large checkpoint while the others wait (``checkpoint.ranks``)."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))


def world_timeout() -> timedelta | None:
    """The default process group's timeout (None without one, or when it can't be read)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def exit_ranks() -> None:
    """End a rank of a finished distributed run at once, with status 0.

    Call it last, once the process group is destroyed and everything is written. It skips
    the interpreter's teardown: gloo's worker threads may still free finished work (which
    needs the GIL) while Python finalises, and that aborts the process now and then (torch
    2.13), turning a finished run into a failed one.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
