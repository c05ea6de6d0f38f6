"""One rank of ``test_timeouts``: accelerate starts the process group as the recipes do,
then rank 0 "writes a checkpoint" (sleeps) inside ``on_rank0`` while the others wait. Then
every group the code makes: the pipeline mesh's replica and stage groups (also FSDP's
replica mesh over stages) at every stage count dividing the world, and a group made with
``group_timeout()`` (as ``stage_link``'s). Prints the timeouts it sees, and each mesh
group's ranks, as JSON."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

from longstraw_core import distributed
from longstraw_core.checkpoint import ranks
from longstraw_core.distributed import processes
from longstraw_core.parallel.mesh import REPLICA, STAGE, pipeline_mesh

MARK = "timeouts: "  # before each rank's JSON (the ranks' lines may run together in the log)


def seconds(group: dist.ProcessGroup) -> float:
    """``group``'s timeout in seconds, as its (CPU) backend holds it."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main() -> None:
    minutes = float(sys.argv[1])
    accelerator = Accelerator(cpu=True, kwargs_handlers=[distributed.process_group_kwargs(minutes)])
    result = ranks.on_rank0(lambda: time.sleep(1.0) or "written")
    side = processes._gloo_group(
        dist.distributed_c10d._get_default_group(), processes.group_timeout()
    )
    world = dist.get_world_size()
    meshes = {}
    for stages in (s for s in range(1, world + 1) if world % s == 0):
        mesh = pipeline_mesh(stages)
        groups = {
            REPLICA: mesh.get_group(REPLICA),
            STAGE: mesh.get_group(STAGE),
            "fsdp": mesh[REPLICA].get_group(),  # what topology.shard_mesh() hands shard_model
        }
        meshes[stages] = {
            name: [dist.get_process_group_ranks(group), seconds(group)]
            for name, group in groups.items()
        } | {"coordinates": [mesh.get_local_rank(REPLICA), mesh.get_local_rank(STAGE)]}
    pairs = [list(range(first, min(first + 2, world))) for first in range(0, world, 2)]
    pair, _ = dist.new_subgroups_by_enumeration(pairs, timeout=distributed.group_timeout())
    print(
        MARK
        + json.dumps(
            {
                "rank": accelerator.process_index,
                "world": distributed.world_timeout().total_seconds(),
                "side": seconds(side),
                "pair": seconds(pair),
                "result": result,
                "meshes": meshes,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    distributed.exit_ranks()


if __name__ == "__main__":
    main()
