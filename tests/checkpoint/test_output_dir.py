"""A run's output directory: claimed before the model loads (writable, locked against a
second live run, never another run's checkpoints), reruns that lose nothing, and saves that
meet a full disk or a symlink loop without losing a checkpoint or a step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_runs import CONFIG, RECIPE, ROOT, SMALL, run_env
from recipe_runs import run_recipe
from tiny_training import optimizer_and_schedule, tiny_policy, train_step

from longstraw_core.checkpoint import (
    INCOMPLETE,
    CheckpointError,
    complete_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from longstraw_core.config import ConfigError, TrainSection, load_config
from longstraw_core.launch import output_dir, resume
from longstraw_core.process.failpoints import ENV as FAILPOINTS

DEMO = "configs/qwen36/tiny_grpo_cpu.yaml"  # `make demo`'s config


def _trained():
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _save(root: Path, *steps: int, state=None) -> None:
    state = state or _trained()
    for step in steps:
        save_checkpoint(root, step, *state, data_position=step)


def _claim(root: Path, resume_from: str | None = None, steps: int = 4) -> None:
    """``output_dir.claim`` as a run starting now would call it; the lock released after,
    as the run's process ending would."""
    try:
        output_dir.claim(TrainSection(output_dir=str(root), resume_from=resume_from, steps=steps))
    finally:
        output_dir.release(root)


def _snapshot(root: Path) -> dict[str, str]:
    """Every checkpoint's manifest (its files' sizes and sha256): what must not change."""
    return {p.name: (p / "manifest.json").read_text() for p in complete_checkpoints(root)}


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert lines and "Traceback" not in text, text[-3000:]
    return lines[-1]


# --------------------------------------------------------------------------- claiming


def test_a_new_run_into_a_directory_with_checkpoints_is_refused_naming_both_fixes(tmp_path):
    out, other = tmp_path / "run", tmp_path / "other"
    state = _trained()
    _save(out, 1, 2, state=state)
    _save(other, 1, state=state)
    with pytest.raises(ConfigError) as caught:
        _claim(out)
    message = str(caught.value)
    assert caught.value.key == "train.output_dir" and "\n" not in message
    assert "step-000001, step-000002" in message
    assert "train.resume_from=latest" in message and "another train.output_dir" in message
    # Resuming another directory's checkpoint into this one would mix the two runs too.
    with pytest.raises(ConfigError, match=r"another \(empty\) train.output_dir"):
        _claim(out, str(other / "step-000001"))
    assert _snapshot(out).keys() == {"step-000001", "step-000002"}
    _claim(out, "latest")  # continuing this directory's run
    _claim(out, str(out / "step-000001"))  # or resuming one of its own checkpoints
    _claim(tmp_path / "fresh")  # a new run into a new directory


def test_resume_says_what_it_does_and_a_directory_that_is_no_checkpoint_is_one_line(
    tmp_path, capsys
):
    _claim(tmp_path / "new", "latest")
    assert capsys.readouterr().err == (
        f"note: train.resume_from=latest: no checkpoint in {tmp_path / 'new'} yet; "
        "starting at step 0\n"
    )
    out = tmp_path / "run"
    _save(out, 2)
    _claim(out, "latest", steps=2)
    err = capsys.readouterr().err
    assert f"note: resuming {out / 'step-000002'} (step 2 of train.steps=2)" in err
    assert "nothing left to train: raise train.steps" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as caught:
        _claim(tmp_path / "run2", str(empty))
    assert caught.value.key == "train.resume_from" and "\n" not in str(caught.value)
    assert "neither a checkpoint" in str(caught.value)
    cfg = load_config(ROOT / DEMO, [f"train.resume_from={empty}"])  # the resolution itself
    with pytest.raises(ConfigError, match=r"^train.resume_from: .*neither a checkpoint"):
        resume.checkpoint_to_resume(cfg)


def test_an_output_dir_that_cannot_hold_files_is_refused(tmp_path):
    """What the first save would meet, met now: a path through a regular file, a symlink
    loop, and a directory this user may not write in."""
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match="a part of the path is a file") as caught:
        _claim(a_file / "run")
    assert caught.value.key == "train.output_dir"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="a symlink that leads nowhere"):
        _claim(loop)
    assert a_file.read_text() == "mine" and loop.is_symlink()
    # Read-only: refused exactly when a file cannot be created there. Root writes through
    # the mode bits (and so would the save): there the claim must go through, elsewhere fail.
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        probe = read_only / "probe"
        try:
            probe.touch()
            probe.unlink()
            writable = True
        except PermissionError:
            writable = False
        if writable:
            _claim(read_only)
        else:
            with pytest.raises(ConfigError, match=r"cannot write in .*read_only"):
                _claim(read_only)
    finally:
        read_only.chmod(0o755)


# --------------------------------------------------------------------------- saves


def test_a_full_disk_at_a_save_is_one_line_with_the_bytes_and_the_last_checkpoint_intact(
    tmp_path, monkeypatch
):
    """The write of step 2 fails as a full disk fails it (ENOSPC, injected at the save's
    failpoint): one line naming the directory and the bytes, step 1 untouched and loadable,
    no partial files left."""
    out = tmp_path / "run"
    state = _trained()
    _save(out, 1, state=state)
    before = _snapshot(out)
    monkeypatch.setenv(FAILPOINTS, "checkpoint.model_written@2:enospc")
    with pytest.raises(CheckpointError) as caught:
        _save(out, 2, state=state)
    message = str(caught.value)
    assert message.startswith(f"no space left in {out} for step-000002: it needs about ")
    assert " bytes " in message and "step-000001 is intact" in message and "\n" not in message
    assert _snapshot(out) == before and not list(out.glob(".tmp-*"))
    assert resolve_checkpoint("latest", out) == out / "step-000001"
    monkeypatch.delenv(FAILPOINTS)
    assert (
        load_checkpoint(out, tiny_policy(seed=1), *optimizer_and_schedule(tiny_policy(seed=1))).step
        == 1
    )


@pytest.mark.parametrize("name", ["step-000002", ".tmp-step-000002"])
def test_a_symlink_loop_in_a_saves_place_is_set_aside_and_the_step_saved(tmp_path, name):
    out = tmp_path / "run"
    state = _trained()
    _save(out, 1, state=state)
    loop = out / name
    loop.symlink_to(loop)
    with pytest.warns(UserWarning, match="set aside"):
        _save(out, 2, state=state)
    assert [p.name for p in complete_checkpoints(out)] == ["step-000001", "step-000002"]
    (aside,) = (out / INCOMPLETE).iterdir()
    assert aside.is_symlink() and aside.name.startswith(name.lstrip("."))


@pytest.mark.parametrize("made_again", [True, False], ids=["made-again", "deleted"])
def test_a_directory_replaced_under_a_claim_stops_its_saves_in_one_line(tmp_path, made_again):
    """The lock is an flock on a file: a directory deleted and made again holds a new lock
    file that a second run takes. The first run's next save (a step's, or a stop signal's:
    both write through ``save_checkpoint``'s writer) must notice and write nothing there."""
    out = tmp_path / "run"
    state = _trained()
    output_dir.claim(TrainSection(output_dir=str(out), steps=4))
    try:
        _save(out, 1, state=state)
        os.rename(out, tmp_path / "moved")  # rm -rf and mkdir: the same to this run
        if made_again:
            out.mkdir()
            (out / output_dir.LOCK_FILE).write_text('{"pid": 1}')  # the second run's claim
        with pytest.raises(CheckpointError) as caught:
            _save(out, 2, state=state)
        line = str(caught.value)
        assert "\n" not in line
        assert line.startswith(f"train.output_dir {out} is not the directory this run started in")
        assert ("made again" in line) == made_again
        if made_again:  # nothing of the first run's in the second's directory
            assert [p.name for p in out.iterdir()] == [output_dir.LOCK_FILE]
        else:  # nor is the directory made again
            assert "deleted or moved" in line and not out.exists()
        assert (tmp_path / "moved" / "step-000001").is_dir()  # the first run's, where it went
    finally:
        output_dir.release(out)
    if made_again:  # a later run in this process claims the new directory as its own
        _claim(out)


# --------------------------------------------------------------------------- real runs


@pytest.mark.multiprocess
def test_the_demo_run_twice_resumes_and_a_new_run_into_its_directory_is_refused(tmp_path):
    """`make demo` twice: the second run continues the first (nothing left to train) and
    changes none of its checkpoints; a new run there, even with train.keep_last=1, is
    refused in one line before the model loads, and deletes nothing."""
    out = tmp_path / "demo"
    common = ["train.steps=2", "train.save_every=1", "tracking.wandb=false"]
    first = run_recipe("grpo_qwen36.py", DEMO, out, *common)
    assert "starting at step 0" in first.stderr
    saved = _snapshot(out)
    assert saved.keys() == {"step-000001", "step-000002"}
    second = run_recipe("grpo_qwen36.py", DEMO, out, *common)
    assert f"resuming {out / 'step-000002'}" in second.stderr
    assert "nothing left to train" in second.stderr
    assert _snapshot(out) == saved and (out / "latest").read_text() == "step-000002"
    third = run_recipe(
        "grpo_qwen36.py", DEMO, out, *common, "train.resume_from=null", "train.keep_last=1",
        check=False,
    )  # fmt: skip
    assert third.returncode == 1
    line = _one_line(third.stderr)
    assert line.startswith(f"config error: train.output_dir: '{out}' holds checkpoints")
    assert "train.resume_from=latest" in line and "another train.output_dir" in line
    assert "step 1/" not in third.stdout + third.stderr  # refused before training
    assert _snapshot(out) == saved


def _command(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(RECIPE), "--config", str(CONFIG), *SMALL,
            f"train.output_dir={out}", *overrides]  # fmt: skip


def _lock_holder(out: Path) -> int | None:
    try:
        return json.loads((out / output_dir.LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.multiprocess
def test_a_second_live_run_is_refused_and_a_killed_runs_lock_does_not_stick(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(
        _command(out, "train.steps=10000", "train.save_every=1"), cwd=ROOT, env=run_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while _lock_holder(out) != first.pid:  # claimed: data scanned, model not yet loaded
            assert first.poll() is None and time.monotonic() < deadline, "no claim"
            time.sleep(0.5)
        second = subprocess.run(
            _command(out, "train.steps=1"), cwd=ROOT, env=run_env(), capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 1
        line = _one_line(second.stderr)
        assert line.startswith(f"config error: train.output_dir: '{out}' is in use by another")
        assert f"(pid {first.pid} on " in line and first.poll() is None  # the first runs on
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as the OOM killer or a lost node would
        first.wait()
    _claim(out, "latest")  # the kernel dropped the dead run's lock: the next run starts


@pytest.mark.multiprocess
def test_an_unwritable_output_dir_is_refused_before_the_model_loads(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    result = subprocess.run(
        _command(a_file / "run", "train.steps=1", "train.save_every=1"), cwd=ROOT,
        env=run_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    line = _one_line(result.stderr)
    assert line.startswith(f"config error: train.output_dir: cannot create '{a_file / 'run'}'")
    assert "step 1/" not in result.stdout + result.stderr and a_file.read_text() == "mine"


@pytest.mark.multiprocess
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_its_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        _command(out, "train.steps=2", "train.save_every=1"), cwd=ROOT, capture_output=True,
        text=True, timeout=300,
        env=run_env(**{FAILPOINTS: "checkpoint.model_written@2:enospc"}),
    )  # fmt: skip
    assert result.returncode == 1
    line = _one_line(result.stderr)
    assert line.startswith(f"training stopped: no space left in {out} for step-000002")
    assert "bytes" in line and "step-000001 is intact" in line
    assert [p.name for p in complete_checkpoints(out)] == ["step-000001"]
    assert not list(out.glob(".tmp-*"))


@pytest.mark.multiprocess
def test_a_run_whose_directory_is_made_again_stops_at_its_next_save_in_one_line(tmp_path):
    """The issue's case: ``rm -rf`` and ``mkdir`` of a live run's directory, and a second
    run claiming it. The first stops before its next save, writing nothing into the second's
    directory (no checkpoint, no metrics.csv), with one line."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        _command(out, "train.steps=50", "train.save_every=1"), cwd=ROOT, env=run_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in first.stdout:
            if line.startswith("saved") and "step-000001" in line:
                break
        os.rename(out, tmp_path / "moved")
        out.mkdir()
        (out / output_dir.LOCK_FILE).write_text('{"pid": 1}')  # the second run's claim
        _, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 1, stderr[-3000:]
    assert _one_line(stderr).startswith(
        f"training stopped: train.output_dir {out} is not the directory this run started in: "
        "it was deleted or moved and made again"
    )
    assert [p.name for p in out.iterdir()] == [output_dir.LOCK_FILE]
    assert (tmp_path / "moved" / "step-000001").is_dir()
