"""``distributed.timeout_minutes`` reaches the process group the recipes start (through
accelerate) and the gloo group the ranks wait in while rank 0 writes a checkpoint."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from launch import SUPPORT, torchrun_ok

from longstraw_core import config, distributed
from longstraw_core.checkpoint import ranks
from longstraw_core.config import ConfigError, validation

WORKER = SUPPORT / "timeout_worker.py"


def test_the_config_key_defaults_to_an_hour_and_must_be_positive():
    assert config.RunConfig().distributed.timeout_minutes == 60.0
    for bad in (0, -1.0, float("inf"), True):
        run = config.RunConfig()
        run.distributed.timeout_minutes = bad
        with pytest.raises(ConfigError, match=r"distributed\.timeout_minutes"):
            validation._check_distributed(run)


def test_the_timeout_reaches_a_gloo_world_and_the_side_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    kwargs = distributed.process_group_kwargs(42).to_kwargs()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, **kwargs)
    try:
        assert distributed.world_timeout() == timedelta(minutes=42)
        assert ranks.coordination_group() is None  # the world is gloo already
        side = ranks._gloo_group(dist.distributed_c10d._get_default_group(), timedelta(minutes=42))
        assert side._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=42)
        assert ranks.on_rank0(lambda: "written") == "written"
    finally:
        dist.destroy_process_group()
    assert distributed.world_timeout() is None


@pytest.mark.multiprocess
def test_accelerate_starts_the_group_with_the_configured_timeout():
    """Two CPU ranks started as the recipes start them: both see the configured timeout on
    the world and on the side group, and rank 1 waits out rank 0's (slow) write."""
    log = torchrun_ok(WORKER, "7.5")
    # The ranks print one JSON object each; their lines may run together in the shared log.
    rows = sorted(
        (json.loads(match) for match in re.findall(r'\{"rank"[^{}]*\}', log)),
        key=lambda row: row["rank"],
    )
    assert [row["rank"] for row in rows] == [0, 1], log[-3000:]
    for row in rows:
        assert row["world"] == row["side"] == 450.0
        assert row["result"] == "written"
