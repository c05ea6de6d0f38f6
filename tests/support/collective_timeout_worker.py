"""One rank of ``test_a_collective_timeout_is_named``: rank 1 never joins an all-reduce
(stuck), so rank 0's times out after the group's 3 s; rank 0 prints what ``failure_causes``
makes of gloo's own error."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from longstraw_core.process.failure_causes import cause_of

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
if dist.get_rank() == 1:
    time.sleep(8)  # stuck past rank 0's timeout
    os._exit(0)
try:
    dist.all_reduce(torch.ones(1))
    print("no timeout", flush=True)
except Exception as error:  # gloo's error, whatever its type in this torch
    print(f"cause: {cause_of(error, rank=0, config_file='run.yaml')}", flush=True)
os._exit(0)
