"""Fault injection on the real recipe processes: kills, signals, NaNs, changed settings.

Each fault is what a long run on preemptible machines meets: SIGKILL at every stage of a
checkpoint save (through ``longstraw_core.process.failpoints``), SIGTERM mid-step, a NaN gradient,
a learning rate that diverges, a resume with other optimizer settings. After each, the run
either continues to the result an uninterrupted run reaches (``torch.equal`` on weights and
optimizer state) or stops with a one-line message and a non-zero status.
"""

from __future__ import annotations

import json
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
from fault_runs import (
    CONFIG,
    RECIPE,
    ROOT,
    SMALL,
    all_finite,
    assert_same_state,
    optimizer_state,
    run_env,
    weights,
)
from wandb_records import wandb_config, wandb_records

from longstraw_core import checkpoint
from longstraw_core.config import load_config
from longstraw_core.process.failpoints import ENV as FAILPOINTS
from longstraw_core.training.trainer import load_recipe

pytestmark = pytest.mark.multiprocess

STEPS = 3
SAVE_STAGES = [
    "checkpoint.start",
    "checkpoint.model_written",
    "checkpoint.files_written",
    "checkpoint.manifest_written",
    "checkpoint.renamed",
    "checkpoint.latest_written",
]


def _command(output_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, str(RECIPE), "--config", str(CONFIG), *SMALL,
        f"train.steps={STEPS}", f"train.output_dir={output_dir}", *overrides,
    ]  # fmt: skip


def _run(output_dir: Path, *overrides: str, env: dict[str, str] | None = None):
    return subprocess.run(
        _command(output_dir, *overrides), capture_output=True, text=True, cwd=ROOT,
        env=env or run_env(), timeout=600,
    )  # fmt: skip


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An uninterrupted run: every fault below must end where it ends."""
    out = tmp_path_factory.mktemp("straight")
    _ok(_run(out, "train.save_every=1"))
    return out


@pytest.mark.parametrize("stage", SAVE_STAGES)
def test_kill_at_any_stage_of_a_save_then_resume_equals_uninterrupted(straight, tmp_path, stage):
    out = tmp_path / "run"
    killed = _run(out, "train.save_every=1", env=run_env(**{FAILPOINTS: f"{stage}@2"}))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _ok(_run(out, "train.save_every=1", "train.resume_from=latest"))
    assert f"step {STEPS}/{STEPS}" in resumed.stdout + resumed.stderr
    assert_same_state(straight / f"step-{STEPS:06d}", out / f"step-{STEPS:06d}")
    # Every checkpoint the directory offers is complete and loadable.
    assert checkpoint.resolve_checkpoint("latest", out) == out / f"step-{STEPS:06d}"


# SIGHUP: a closed terminal or a dropped ssh session, whose default action ends the process
# at once with nothing written.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_stop_signal_mid_step_saves_exits_and_resumes_equal(straight, tmp_path, sig):
    out = tmp_path / "run"
    process = subprocess.Popen(
        _command(out, "train.save_every=0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=ROOT, env=run_env(),
    )  # fmt: skip
    lines = []
    for line in process.stdout:  # the first step's line: the second step is under way
        lines.append(line)
        if line.startswith("step 1/"):
            process.send_signal(sig)
            break
    lines += process.stdout.readlines()
    assert process.wait(timeout=600) == 128 + sig, "".join(lines)[-3000:]
    text = "".join(lines)
    assert f"{sig.name}: finishing this step" in text and "Traceback" not in text
    # Step 2 as a rule; step 1 if the signal came before the first step's stop check.
    (step,) = map(int, re.findall(rf"stopped by {sig.name} after step (\d)/3", text))
    assert "train.resume_from=latest" in text
    assert "Run summary" in text  # the logger (and W&B, when on) was finished
    # Although train.save_every=0: the last finished step's at the signal, then this step's.
    saved = sorted(p.name for p in out.glob("step-*"))
    assert saved == [f"step-{s:06d}" for s in range(1, step + 1)], text
    _ok(_run(out, "train.save_every=1", "train.resume_from=latest"))
    assert_same_state(straight / f"step-{STEPS:06d}", out / f"step-{STEPS:06d}")


# Within the reward's timeout (600 s): the signal comes in its first minute.
SLOW_STEP_2 = "rewards=[{name: 'varied_reward:sleeps'}]"


def slow_step_env(**extra: str) -> dict[str, str]:
    """Step 2's reward sleeps an hour (``varied_reward.sleeps``): far past any grace period."""
    return run_env(LONGSTRAW_TEST_SLEEP="3600", LONGSTRAW_TEST_SLEEP_AFTER="1", **extra)


def test_sigterm_to_accelerate_launch_during_a_long_step_leaves_the_last_finished_step(
    straight, tmp_path
):
    """accelerate's single-process launch SIGKILLs its child 5 s after passing a SIGTERM on;
    the step under way sleeps an hour, so only the step-1 checkpoint written at the signal
    (from host memory) can survive. The resume then ends where an uninterrupted run does."""
    out = tmp_path / "run"
    settings = tmp_path / "accelerate.yaml"
    settings.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n"
        "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n"
    )
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(settings),
        *launch.under_nccl_rules(RECIPE), *_command(out, "train.save_every=0", SLOW_STEP_2)[2:],
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=slow_step_env(OMP_NUM_THREADS="1"), start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("reward sleeps"):  # step 2 is under way, for an hour
                process.send_signal(signal.SIGTERM)  # to accelerate, not to the recipe
                break
        lines += process.stdout.readlines()
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    log = "".join(lines)
    assert process.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert f"SIGTERM: saved {out / 'step-000001'} (the last finished step)" in log, log[-3000:]
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000001"]
    _ok(_run(out, "train.save_every=1", "train.resume_from=latest"))
    assert_same_state(straight / f"step-{STEPS:06d}", out / f"step-{STEPS:06d}")


def test_second_sigterm_exits_at_once(tmp_path):
    process = subprocess.Popen(
        _command(tmp_path / "run", "train.save_every=1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=run_env(),
    )  # fmt: skip
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("step 1/"):
            process.send_signal(signal.SIGTERM)
        if line.startswith("SIGTERM: finishing this step"):  # the first one was taken
            process.send_signal(signal.SIGTERM)
            break
    lines += process.stdout.readlines()
    assert process.wait(timeout=600) == 128 + signal.SIGTERM
    assert "second SIGTERM: exiting" in "".join(lines)
    assert not (tmp_path / "run" / "step-000002").exists()


def test_lr_that_diverges_stops_with_the_guard_and_saves_nothing_non_finite(tmp_path):
    out = tmp_path / "run"
    result = _run(out, "optim.lr=1e3", "train.max_skipped_steps=1", "train.steps=8",
                  "train.save_every=1")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "training stopped: 2 steps in a row skipped" in result.stderr
    assert "Traceback" not in result.stderr
    saved = sorted(out.glob("step-*"))
    assert saved and all(all_finite(step_dir) for step_dir in saved)


def test_nan_gradient_skips_the_step_and_the_run_continues(tmp_path, capsys):
    """One NaN entry in one gradient at step 2 (a real hook on the real recipe): no update,
    no scheduler step, no non-finite checkpoint, and step 3 trains on."""
    recipe_module = load_recipe(RECIPE)
    out = tmp_path / "run"
    cfg = load_config(CONFIG, [*SMALL, f"train.steps={STEPS}", "train.save_every=1",
                               f"train.output_dir={out}"])  # fmt: skip
    recipe = recipe_module.Recipe(cfg)
    recipe.setup()
    param = next(p for p in recipe.model.parameters() if p.requires_grad)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if recipe.step + 1 != 2:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    param.register_hook(poison)
    try:
        assert recipe.train() is None
    finally:
        recipe.cleanup()
    printed = capsys.readouterr()
    assert "step 2 skipped: gradient norm is nan" in printed.out + printed.err
    assert recipe.guard.skipped == 1 and recipe.guard.in_a_row == 0
    steps = [out / f"step-{s:06d}" for s in (1, 2, 3)]
    assert all(all_finite(step_dir) for step_dir in steps)
    one, two, three = (weights(step_dir) for step_dir in steps)
    assert all(torch.equal(one[k], two[k]) for k in one), "a skipped step changed weights"
    assert any(not torch.equal(two[k], three[k]) for k in two), "step 3 did not train"
    state = json.loads((steps[1] / "trainer_state.json").read_text())
    assert state["extra"]["guard"] == {"skipped": 1, "in_a_row": 1}
    assert (
        optimizer_state(steps[0])["state"][0]["step"]
        == optimizer_state(steps[1])["state"][0]["step"]
    )


def test_a_step_whose_rewards_all_failed_is_not_trained_on(tmp_path, capsys, caplog):
    """Every reward fails in step 2 (between two steps that train): one line per function
    for the step (its count, its one sample id), the step skipped as the rewards', no
    update (step 2's weights and optimizer state are step 1's), and step 3 trains on."""
    recipe_module = load_recipe(RECIPE)
    out = tmp_path / "run"
    cfg = load_config(CONFIG, [*SMALL, f"train.steps={STEPS}", "train.save_every=1",
                               "rewards=[{name: 'varied_reward:fails_in_step_two'}]",
                               f"train.output_dir={out}"])  # fmt: skip
    recipe = recipe_module.Recipe(cfg)
    recipe.setup()
    try:
        assert recipe.train() is None
    finally:
        recipe.cleanup()
    printed = capsys.readouterr()
    log = printed.out + printed.err + caplog.text
    (line,) = [ln for ln in log.splitlines() if "'fails_in_step_two' failed" in ln]
    assert re.search(r"step 2: reward function 'fails_in_step_two' failed on 4 of 4 "
                     r"completions \(sample '[^',]+'\): ConnectionError\(", line), line  # fmt: skip
    assert "step 2 skipped: every reward function failed on every completion; no update" in log
    assert recipe.guard.skipped == 1 and recipe.updates == 2
    one, two, three = (weights(out / f"step-{s:06d}") for s in (1, 2, 3))
    assert all(torch.equal(one[k], two[k]) for k in one), "the failed step changed weights"
    assert any(not torch.equal(two[k], three[k]) for k in two), "step 3 did not train"
    steps = [optimizer_state(out / f"step-{s:06d}")["state"][0]["step"] for s in (1, 2, 3)]
    assert steps[0] == steps[1] < steps[2]


def test_resume_applies_changed_optimizer_settings_and_wandb_records_them(tmp_path):
    out = tmp_path / "run"
    wandb_on = ["tracking.wandb=true", "tracking.mode=offline"]
    _ok(_run(out, "train.steps=1", "train.save_every=1", *wandb_on))
    changed = ["optim.lr=5e-3", "optim.weight_decay=0.5", "optim.betas=[0.5,0.6]"]
    result = _ok(_run(out, "train.steps=2", "train.save_every=1", "train.resume_from=latest",
                      *wandb_on, *changed))  # fmt: skip
    assert "optim.lr: 0.001 -> 0.005" in result.stderr
    group = optimizer_state(out / "step-000002")["param_groups"][0]
    assert group["lr"] == 5e-3 and group["weight_decay"] == 0.5
    assert tuple(group["betas"]) == (0.5, 0.6)
    run_file = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))[-1]  # the resumed run's
    recorded = wandb_config(wandb_records(run_file))
    assert recorded["optim"]["lr"] == 5e-3 and recorded["optim"]["betas"] == [0.5, 0.6]
    assert recorded["optim"]["weight_decay"] == 0.5
    assert recorded["resume"]["changed"]["optim.lr"] == {"checkpoint": 1e-3, "now": 5e-3}


def test_resume_refuses_changed_model_settings_before_loading(tmp_path):
    out = tmp_path / "run"
    _ok(_run(out, "train.steps=1", "train.save_every=1"))
    result = _run(out, "train.steps=2", "train.resume_from=latest", "lora.enabled=true")
    assert result.returncode == 1
    assert "config error: lora.enabled" in result.stderr and "Traceback" not in result.stderr
    assert "start a new run in another train.output_dir" in result.stderr


def test_output_dir_that_is_a_file_is_refused_up_front(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("mine")
    result = _run(target)
    assert result.returncode == 1 and "config error: train.output_dir" in result.stderr
    assert target.read_text() == "mine"


def test_reward_failing_on_every_call_stops_the_run_non_zero(tmp_path):
    """Rewards that fail every step: each step skipped, the run stopped with one line naming
    the rewards, and no checkpoint of its untrained weights (save_every=1); a run too short
    to reach the limit fails too, rather than finishing."""
    failing = "rewards=[{name: 'varied_reward:always_fails'}]"
    out = tmp_path / "run"
    result = _run(out, failing, "train.max_skipped_steps=1", "train.save_every=1")
    assert result.returncode == 1, result.stderr[-3000:]
    log = result.stderr + result.stdout
    assert "every reward function failed on every completion" in log
    failures = [ln for ln in log.splitlines() if "'always_fails' failed on 4 of 4" in ln]
    assert [ln.split(":")[0] for ln in failures] == ["step 1", "step 2"], failures
    (stopped,) = [ln for ln in result.stderr.splitlines() if ln.startswith("training stopped")]
    assert stopped.startswith("training stopped: 2 steps in a row skipped"), stopped
    assert "the reward functions failed every step" in stopped and "Traceback" not in log
    assert not list(out.glob("step-*"))
    short = _run(tmp_path / "short", failing, "train.steps=1", "train.save_every=1")
    assert short.returncode == 1, short.stderr[-3000:]
    assert "training stopped: every step of this run was skipped (1; " in short.stderr
    assert not list((tmp_path / "short").glob("step-*"))
    raised = _run(tmp_path / "raise", failing, "train.raise_reward_errors=true")
    assert raised.returncode == 1 and "Traceback" not in raised.stderr
    assert "training stopped: reward function 'always_fails' failed" in raised.stderr
    assert "the reward server is down" in raised.stderr


def test_a_reward_past_its_timeout_fails_those_calls_and_the_run_goes_on(tmp_path):
    rewards = (
        "rewards=[{name: 'varied_reward:even_characters'}, "
        "{name: 'varied_reward:sleeps', timeout_seconds: 1}]"
    )
    started = time.monotonic()
    result = _run(
        tmp_path / "run", rewards, "train.save_every=1", env=run_env(LONGSTRAW_TEST_SLEEP="3600")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 500  # never the hour the reward sleeps
    log = result.stdout + result.stderr
    assert "reward function 'sleeps' failed" in log
    assert "took longer than its timeout of 1 s" in log  # the first call
    assert "still running" in log  # later calls, while the first one sleeps on
    assert (tmp_path / "run" / f"step-{STEPS:06d}").is_dir()


def test_a_reward_raising_system_exit_fails_like_a_tool_not_the_run(tmp_path):
    """``sys.exit()`` in a reward is that function's failure (the tools' rule): the steps are
    skipped as for any failing reward, and the run stops by the skip rule, with one line."""
    result = _run(
        tmp_path / "run", "rewards=[{name: 'varied_reward:exits_the_run'}]",
        "train.max_skipped_steps=1",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    log = result.stderr + result.stdout
    assert "Traceback" not in log
    failures = [ln for ln in log.splitlines() if "'exits_the_run' failed on 4 of 4" in ln]
    assert len(failures) == 2 and all("SystemExit" in ln for ln in failures), failures
    (stopped,) = [ln for ln in result.stderr.splitlines() if ln.startswith("training stopped")]
    assert "the reward functions failed every step" in stopped, stopped


def test_corrupt_checkpoint_is_named_on_resume(tmp_path):
    out = tmp_path / "run"
    _ok(_run(out, "train.steps=1", "train.save_every=1"))
    (weights,) = (out / "step-000001" / "model").glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside the tensors: same size, other content
    weights.write_bytes(bytes(data))
    result = _run(out, "train.steps=2", "train.resume_from=latest")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"checkpoint error: {weights}: sha256 differs from the manifest" in result.stderr


def test_bad_data_file_fails_before_the_model_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "2+2?", "answer": "4"}\n{"prompt": "broken\n')
    out = tmp_path / "run"
    result = _run(out, "data.task=null", f"data.path={path}", "data.prompt_tokens=64")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"data error: {path}:2: invalid JSON" in result.stderr
    assert not out.exists()  # nothing was built or written


def test_a_data_file_replaced_between_a_run_and_its_resume_is_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    data = ["data.task=null", f"data.path={path}", "data.prompt_tokens=64", "eval.every=0"]
    _ok(_run(out, *data, "train.steps=1", "train.save_every=1"))
    original = path.read_bytes()
    path.write_text("".join(json.dumps(row) + "\n" for row in reversed(rows)))  # same size
    result = _run(out, *data, "train.steps=2", "train.resume_from=latest")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"data error: {path} is not the data {out / 'step-000001'} was trained on" in (
        result.stderr
    )
    assert f"{len(original)} bytes" in result.stderr and "Restore that file" in result.stderr
    assert not (out / "step-000002").exists()
    path.write_bytes(original)  # the same bytes again (a new file, a new time): it resumes
    _ok(_run(out, *data, "train.steps=2", "train.save_every=1", "train.resume_from=latest"))
    assert (out / "step-000002").is_dir()


def test_resume_from_an_older_checkpoint_moves_later_ones_aside(straight, tmp_path):
    out = tmp_path / "run"
    _ok(_run(out, "train.save_every=1"))
    older = out / "step-000001"
    result = _ok(_run(out, "train.save_every=1", f"train.resume_from={older}"))
    assert "moved later checkpoints aside" in result.stderr
    (aside,) = out.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-000002", "step-000003"]
    assert_same_state(straight / f"step-{STEPS:06d}", out / f"step-{STEPS:06d}")


def test_a_config_with_its_data_beside_it_runs_from_any_working_directory(tmp_path):
    """One rule for relative paths: a config file's are beside it (data, like its reward
    modules), the command line's and the outputs are the working directory's."""
    exp, elsewhere = tmp_path / "exp", tmp_path / "elsewhere"
    exp.mkdir()
    elsewhere.mkdir()
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    (exp / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (exp / "beside.py").write_text("def length(completions, **kwargs):\n"
                                   "    return [float(len(c)) for c in completions]\n")  # fmt: skip
    (exp / "run.yaml").write_text(
        f"defaults: {CONFIG}\ndata:\n  task: null\n  path: prompts.jsonl\n  prompt_tokens: 64\n"
        "eval:\n  every: 0\nrewards:\n  - {name: 'beside:length'}\n"
    )
    command = [
        sys.executable, str(RECIPE), "--config", str(exp / "run.yaml"),
        *[o for o in SMALL if not o.startswith(("rewards=", "data."))],
        "train.steps=1", "train.save_every=1", "train.output_dir=out",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=elsewhere, env=run_env(), timeout=600
    )
    _ok(result)
    assert (elsewhere / "out" / "step-000001").is_dir()  # the outputs: where it was started


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("step.start@2:oom", "training stopped: out of memory on rank 0 ("),
        ("checkpoint.model_written@2:eacces", "training stopped: cannot write failpoint"),
    ],
    ids=["out-of-memory", "write-permission-lost"],
)
def test_a_machine_failure_mid_run_is_one_line_naming_it(tmp_path, fault, says):
    """Out of memory (torch's allocator's own error) and a directory no longer writable, met
    at step 2: one line saying what happened and what to do, no traceback, step 1 kept."""
    out = tmp_path / "run"
    result = _run(out, "train.steps=2", "train.save_every=1", env=run_env(**{FAILPOINTS: fault}))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("training stopped")]
    assert line.startswith(says), line
    fix = "train.chunk_size" if "oom" in fault else "train.resume_from=latest"
    assert fix in line
    assert (out / "step-000001").is_dir() and not (out / "step-000002").exists()
