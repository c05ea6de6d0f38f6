"""Faults on a sharded run (two CPU ranks, torchrun, gloo): a kill during a save, a SIGTERM
that reaches one rank only, a SIGTERM to torchrun during a step longer than its grace period,
a rank stuck in a collective, a launcher killed outright, ranks with different settings.
Both ranks must stop after the same step (or at once, with the last finished step saved), and
the resumed run must end where an uninterrupted 2-rank run ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import launch
import pytest
from fault_runs import CONFIG, RECIPE, ROOT, SMALL, assert_same_state, run_env
from test_faults import SLOW_STEP_2, slow_step_env

from longstraw_core.process.failpoints import ENV as FAILPOINTS

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


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip


def _kill_all(process: subprocess.Popen) -> None:
    """torchrun and its ranks (each in a session of its own, out of torchrun's group)."""
    ranks = _children(process.pid)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _read_until(process: subprocess.Popen, marker: str, lines: list[str]) -> None:
    for line in process.stdout:
        lines.append(line)
        if line.startswith(marker):
            return
    raise AssertionError(f"no line {marker!r}:\n{''.join(lines)[-4000:]}")


def _gone(pids: list[int], seconds: float) -> bool:
    """Whether every process in ``pids`` has ended (or is a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_stop_signal_to_torchrun_during_a_long_step_leaves_the_last_finished_step(
    straight, tmp_path, sig
):
    """torchrun SIGKILLs the ranks its grace period (here 5 s) after passing the signal on
    (SIGHUP too: a closed terminal); step 2 sleeps an hour. Rank 0 writes step 1 from host
    memory at the signal; the sharded resume ends where an uninterrupted run ends."""
    out = tmp_path / "run"
    env = slow_step_env(OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    command = launch.torchrun_command(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=0", SLOW_STEP_2, env=env
    )
    process, lines = _start(command, env), []
    try:
        _read_until(process, "reward sleeps on rank 0", lines)  # step 2, for an hour
        process.send_signal(sig)  # to torchrun
        lines += process.stdout.readlines()
        process.wait(timeout=120)
    finally:
        _kill_all(process)
    log = launch.with_report_last("".join(lines))
    assert process.returncode != 0
    assert f"{sig.name}: saved {out / 'step-000001'} (the last finished step)" in log, log[-4000:]
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000001"], log[-4000:]
    launch.torchrun_ok(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1", "train.resume_from=latest",
        env=run_env(),
    )  # fmt: skip
    assert_same_state(straight / "step-000003", out / "step-000003")


def _stuck(tmp_path: Path) -> tuple[subprocess.Popen, list[int], list[str]]:
    """A 2-rank run whose rank 1 sleeps an hour in step 2's reward, so that rank 0 waits in a
    collective (inside gloo, where no Python signal handler runs): its process, its ranks
    (rank 0 first) and its log so far."""
    env = slow_step_env(OMP_NUM_THREADS="1", LONGSTRAW_TEST_SLEEP_RANKS="1")
    command = launch.torchrun_command(
        RECIPE, *ARGS, f"train.output_dir={tmp_path / 'run'}", SLOW_STEP_2, env=env
    )
    process, lines = _start(command, env), []
    try:
        _read_until(process, "reward sleeps on rank 1", lines)
        time.sleep(3)  # rank 0 scores its group, enters the collective that waits for rank 1
        ranks = sorted(_children(process.pid))  # started in rank order
        assert len(ranks) == 2, ranks
    except BaseException:
        _kill_all(process)
        raise
    return process, ranks, lines


def test_a_rank_stuck_in_a_collective_ends_at_a_second_sigterm(tmp_path):
    process, (rank0, _), lines = _stuck(tmp_path)
    try:
        os.kill(rank0, signal.SIGTERM)
        time.sleep(1)
        os.kill(rank0, signal.SIGTERM)
        assert _gone([rank0], 30), "rank 0 ignored two SIGTERMs while waiting in a collective"
    finally:
        _kill_all(process)
        lines += process.stdout.readlines()
    log = "".join(lines)
    assert f"SIGTERM: saved {tmp_path / 'run' / 'step-000001'} (the last finished step)" in log
    assert "second SIGTERM: exiting" in log


def test_ranks_do_not_outlive_a_launcher_killed_outright(tmp_path):
    """SIGKILL to torchrun (a scheduler killing the job's head process, an OOM kill): no
    launcher is left to stop the ranks; they stop themselves, rank 0 saving step 1."""
    process, ranks, lines = _stuck(tmp_path)
    try:
        process.kill()  # torchrun alone, not its process group
        assert _gone(ranks, 30), "the ranks outlived their launcher"
    finally:
        _kill_all(process)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lines += process.stdout.readlines()
    assert (tmp_path / "run" / "step-000001").is_dir(), "".join(lines)[-4000:]


def test_a_reward_error_on_a_pipelines_scoring_stage_stops_every_stage(tmp_path):
    """Two stages: the last scores for both (``prompt_group.score_once``); its reward error
    (``train.raise_reward_errors``) reaches stage 0 through the same broadcast, so both stop
    with the error's line (stage 0's naming the rank that scored), neither waits for the
    other, and no checkpoint is written."""
    out = tmp_path / "run"
    code, log = launch.torchrun(
        RECIPE, "--config", str(CONFIG), *SMALL, "distributed.pipeline_stages=2",
        "train.steps=2", "train.save_every=1", "train.raise_reward_errors=true",
        "rewards=[{name: 'varied_reward:always_fails'}]", f"train.output_dir={out}",
        timeout=180, env=run_env(),
    )  # fmt: skip
    assert code != 0, log[-3000:]
    stopped = [ln for ln in log.splitlines() if "training stopped: reward function" in ln]
    assert any("'always_fails' failed" in ln and "the reward server is down" in ln
               for ln in stopped), log[-3000:]  # fmt: skip
    assert any("(on rank 1, which scores for this pipeline)" in ln for ln in stopped), log[-3000:]
    assert not list(out.glob("step-*"))


def test_rewards_failing_on_rank_1_only_skip_the_step_on_both_naming_rank_1(tmp_path):
    """Every reward fails on rank 1 alone: both ranks skip the step (one reduction), the
    skip names rank 1 of 2, rank 1's failure line says its rank, and with
    train.max_skipped_steps=0 both stop with one line and no checkpoint."""
    out = tmp_path / "run"
    code, log = launch.torchrun(
        RECIPE, *ARGS, f"train.output_dir={out}", "train.save_every=1",
        "train.max_skipped_steps=0", "rewards=[{name: 'varied_reward:fails_on_some_ranks'}]",
        env=run_env(LONGSTRAW_TEST_FAIL_RANKS="1"),
    )  # fmt: skip
    assert code != 0, log[-3000:]
    assert "step 1 skipped: every reward function failed on every completion on rank 1 of 2" in log
    failures = [ln for ln in log.splitlines() if "'fails_on_some_ranks' failed" in ln]
    assert failures and all("step 1, rank 1 of 2: reward function" in ln for ln in failures)
    assert "training stopped: 1 steps in a row skipped" in log  # torchrun adds its summary
    assert not list(out.glob("step-*"))
