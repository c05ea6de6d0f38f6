"""What a run of several processes needs to start and end: the check that they share the
model, the process groups' timeout, a gloo group for objects, and a finished rank's exit."""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from longstraw_core.schema.run_config import ConfigError

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
    # "nccl", "gloo", or a device map such as "cpu:gloo,cuda:nccl": read the GPU backend's.
    device = torch.device("cuda" if "nccl" in str(dist.get_backend()) else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def group_timeout() -> timedelta | None:
    """The timeout every process group the code creates is made with
    (``dist.new_group(ranks, timeout=group_timeout())``): the world's, which the recipes set
    from ``distributed.timeout_minutes``.

    Why: ``new_group`` and ``init_device_mesh`` do not inherit the world's timeout; they take
    torch's default for their backend (NCCL 10 minutes, gloo 30), so a stage or replica group
    would time out while rank 0 writes a large checkpoint, or wait on past the run's limit.
    None (torch's default) without a process group or when the world's can't be read.
    """
    return world_timeout()


def cpu_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank with the world's timeout, for object collectives and waits
    on the CPU: None (the default group) when that is gloo already, else one side group per
    default group, made on first use (a collective: every rank's first call must be the same
    one). Objects sent through it never touch a GPU (NCCL's object collectives pickle onto the
    current CUDA device, which must have been set), and a rank waiting in it has no NCCL
    collective pending whose watchdog could abort the job."""
    if dist.get_backend() == "gloo":
        return None
    return _gloo_group(dist.distributed_c10d._get_default_group(), group_timeout())


@functools.lru_cache(maxsize=1)
def _gloo_group(world: dist.ProcessGroup, timeout: timedelta | None) -> dist.ProcessGroup:
    """One gloo side group per default group (``world`` keys the cache)."""
    return dist.new_group(backend="gloo", timeout=timeout)


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
