"""Faults on a sharded run (two CPU ranks, torchrun, gloo): a kill during a save, and a
SIGTERM that reaches one rank only. Both ranks must stop after the same step, and the
resumed run must end where an uninterrupted 2-rank run ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import launch
import pytest
from fault_runs import CONFIG, RECIPE, ROOT, SMALL, assert_same_state, run_env

from longstraw_core.failpoints import ENV as FAILPOINTS

pytestmark = pytest.mark.multiprocess

ARGS = ["--config", str(CONFIG), *SMALL, "distributed.fsdp=true", "train.steps=3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight2")
    launch.torchrun_ok(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1", env=run_env()
    )
    return out


def test_kill_after_the_rename_then_sharded_resume_equals_uninterrupted(straight, tmp_path):
    out = tmp_path / "run"
    dies = run_env(**{FAILPOINTS: "checkpoint.renamed@2"})  # rank 0 dies; torchrun ends rank 1
    code, log = launch.torchrun(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1", env=dies
    )
    assert code != 0 and (out / "step-000002").is_dir(), log[-3000:]
    launch.torchrun_ok(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1", "train.resume_from=latest",
        env=run_env(),
    )  # fmt: skip
    assert_same_state(straight / "step-000003", out / "step-000003")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``): torchrun's ranks."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue  # not a process, or one that just ended
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
            children.append(int(entry.name))
    return children


def test_sigterm_on_one_rank_stops_both_after_the_same_step(straight, tmp_path):
    out = tmp_path / "run"
    env = run_env(OMP_NUM_THREADS="1")
    command = launch.torchrun_command(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=0", ranks=2, env=env
    )
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step 1/"):  # rank 0 prints; step 2 is under way on both
                ranks = _children(process.pid)
                assert len(ranks) == 2, ranks
                os.kill(max(ranks), signal.SIGTERM)  # one rank only (the later-started one)
                break
        lines += process.stdout.readlines()
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            time.sleep(1)
    log = "".join(lines)
    # Step 2 as a rule; step 1 when the signal beat rank 1 to the end of its first step.
    stopped = re.findall(r"stopped by SIGTERM after step (\d)/3", log)
    # Every rank that printed before torchrun ended the rest names the same step.
    assert stopped and len(set(stopped)) == 1, log[-4000:]
    step = int(stopped[0])
    assert step in (1, 2) and process.returncode != 0
    assert sorted(p.name for p in out.glob("step-*")) == [f"step-{step:06d}"], log[-4000:]
    launch.torchrun_ok(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1", "train.resume_from=latest",
        env=run_env(),
    )  # fmt: skip
    assert_same_state(straight / "step-000003", out / "step-000003")
