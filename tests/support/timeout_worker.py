"""One rank of ``test_timeouts``: accelerate starts the process group as the recipes do,
then rank 0 "writes a checkpoint" (sleeps) inside ``on_rank0`` while the others wait.
Prints the group timeouts it sees as JSON."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

from longstraw_core import distributed
from longstraw_core.checkpoint import ranks


def main() -> None:
    minutes = float(sys.argv[1])
    accelerator = Accelerator(cpu=True, kwargs_handlers=[distributed.process_group_kwargs(minutes)])
    result = ranks.on_rank0(lambda: time.sleep(1.0) or "written")
    side = ranks._gloo_group(
        dist.distributed_c10d._get_default_group(), distributed.world_timeout()
    )
    side_timeout = side._get_backend(torch.device("cpu")).options._timeout
    print(
        json.dumps(
            {
                "rank": accelerator.process_index,
                "world": distributed.world_timeout().total_seconds(),
                "side": side_timeout.total_seconds(),
                "result": result,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    distributed.exit_ranks()


if __name__ == "__main__":
    main()
