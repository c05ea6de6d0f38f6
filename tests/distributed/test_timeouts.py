"""``distributed.timeout_minutes`` reaches the process group the recipes start (through
accelerate), the gloo group the ranks wait in while rank 0 writes a checkpoint, and every
group the code makes (the pipeline mesh's, FSDP's over it, any made with
``group_timeout()``): ``new_group`` and ``init_device_mesh`` would give torch's default."""

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
from longstraw_core.distributed import processes

WORKER = SUPPORT / "timeout_worker.py"
MARK = "timeouts: "  # timeout_worker.MARK


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
        assert distributed.world_timeout() == distributed.group_timeout() == timedelta(minutes=42)
        assert ranks.coordination_group() is None  # the world is gloo already
        side = processes._gloo_group(
            dist.distributed_c10d._get_default_group(), distributed.group_timeout()
        )
        assert side._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=42)
        assert ranks.on_rank0(lambda: "written") == "written"
        assert ranks.gather("mine") == ["mine"]
    finally:
        dist.destroy_process_group()
    assert distributed.world_timeout() is None
    assert distributed.group_timeout() is None  # new_group then takes torch's default


@pytest.mark.multiprocess
def test_accelerate_starts_the_group_with_the_configured_timeout():
    """Four CPU ranks started as the recipes start them: every group the code makes carries
    the configured timeout (the world, the checkpoint's side group, a group made with
    ``group_timeout()``, and the pipeline mesh's replica, stage and FSDP groups at S=1, 2
    and 4), the mesh lays out rank ``d * S + s`` as stage ``s`` of replica ``d``, and rank 1
    waits out rank 0's (slow) write."""
    ranks_ = 4
    log = torchrun_ok(WORKER, "7.5", ranks=ranks_)
    decoder = json.JSONDecoder()
    rows = sorted(
        (decoder.raw_decode(log, match.end())[0] for match in re.finditer(MARK, log)),
        key=lambda row: row["rank"],
    )
    assert [row["rank"] for row in rows] == list(range(ranks_)), log[-3000:]
    for row in rows:
        assert row["world"] == row["side"] == row["pair"] == 450.0
        assert row["result"] == "written"
        assert sorted(int(stages) for stages in row["meshes"]) == [1, 2, 4]
        for stages, mesh in row["meshes"].items():
            stages = int(stages)
            replica, stage = divmod(row["rank"], stages)
            assert mesh["coordinates"] == [replica, stage]
            assert mesh["replica"] == mesh["fsdp"] == [list(range(stage, ranks_, stages)), 450.0]
            first = replica * stages
            assert mesh["stage"] == [list(range(first, first + stages)), 450.0]


@pytest.mark.multiprocess
def test_a_collective_timeout_is_named_in_one_line():
    """gloo's own timeout error (rank 1 stuck, rank 0 waiting past the group's 3 s) becomes the
    one line ``main`` prints: what timed out, where the cause is, which key raises the limit."""
    log = torchrun_ok(SUPPORT / "collective_timeout_worker.py")
    (line,) = [ln for ln in log.splitlines() if "cause: " in ln]
    assert "cause: a collective timed out on rank 0 (" in line
    assert "another rank stopped or is stuck" in line and "distributed.timeout_minutes" in line
