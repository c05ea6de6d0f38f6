"""Faults on a sharded run (two CPU ranks, torchrun, gloo): a kill during a save, and a
SIGTERM that reaches one rank only. Both ranks must stop after the same step, and the
resumed run must end where an uninterrupted 2-rank run ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
import torch
from safetensors.torch import load_file

from longstraw_core.failpoints import ENV as FAILPOINTS

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo_qwen36.py"
SMALL = [
    "--config", str(ROOT / "configs" / "qwen36" / "tiny_learn_cpu.yaml"),
    "data.prompt_tokens=400",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=4",
    "train.chunk_size=128",
    "grpo.gradient=detached",
    "tracking.wandb=false",
    "train.completions_every=0",
    "optim.scheduler=constant",
    "optim.lr=1e-3",
    "optim.weight_decay=0.01",  # every update moves every weight
    "rewards=[{name: 'varied_reward:even_characters'}]",
    "distributed.fsdp=true",
    "train.steps=3",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _reward_module_on_path(monkeypatch):
    """The ranks import the test reward by its module name."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))  # fmt: skip
    monkeypatch.delenv(FAILPOINTS, raising=False)


def _state(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    weights = {
        k: v for f in sorted(step_dir.rglob("*.safetensors")) for k, v in load_file(f).items()
    }
    return weights, torch.load(step_dir / "optimizer.pt", weights_only=True)


def _assert_same(a: Path, b: Path) -> None:
    (wa, oa), (wb, ob) = _state(a), _state(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["param_groups"] == ob["param_groups"]
    for index, state in oa["state"].items():
        assert all(torch.equal(v, ob["state"][index][k]) for k, v in state.items()), index


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight2")
    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env]))
    try:
        launch.torchrun_ok(RECIPE, *SMALL, f"train.output_dir={out}", "train.save_every=1")
    finally:
        os.environ.pop("PYTHONPATH") if env is None else os.environ.update(PYTHONPATH=env)
    return out


def test_kill_after_the_rename_then_sharded_resume_equals_uninterrupted(
    straight, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setenv(FAILPOINTS, "checkpoint.renamed@2")  # rank 0 dies; torchrun ends rank 1
    code, log = launch.torchrun(RECIPE, *SMALL, f"train.output_dir={out}", "train.save_every=1")
    assert code != 0 and (out / "step-000002").is_dir(), log[-3000:]
    monkeypatch.delenv(FAILPOINTS)
    launch.torchrun_ok(
        RECIPE, *SMALL, f"train.output_dir={out}", "train.save_every=1", "train.resume_from=latest"
    )
    _assert_same(straight / "step-000003", out / "step-000003")


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def test_sigterm_on_one_rank_stops_both_after_the_same_step(straight, tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(RECIPE), *SMALL, f"train.output_dir={out}", "train.save_every=0",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
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
        RECIPE, *SMALL, f"train.output_dir={out}", "train.save_every=1", "train.resume_from=latest"
    )
    _assert_same(straight / "step-000003", out / "step-000003")
