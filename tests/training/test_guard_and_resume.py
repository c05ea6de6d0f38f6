"""The pieces the recipes' fault handling is made of, each on its own (fast, one process):
the non-finite guard, the graceful stop, resume's settings, and the input checks."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

import longstraw_core as ls
from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.tasks import Sample
from longstraw_core.launch import resume
from longstraw_core.launch.preemption import GracefulStop
from longstraw_core.models.build import build_optimizer, build_scheduler
from longstraw_core.models.tiny import tiny_model
from longstraw_core.process.guard import (
    NonFiniteError,
    NonFiniteGuard,
    TrainingDiverged,
    first_non_finite,
    non_finite_reason,
    optimizer_tensors,
)
from longstraw_core.rewards import MAX_ABS_REWARD, RewardError, RewardSet
from longstraw_core.training.tracking import RunLogger

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"


# --------------------------------------------------------------------------- the guard


def test_non_finite_reason_names_what_is_not_finite():
    assert non_finite_reason(0.5, 2.0) is None
    assert non_finite_reason(math.nan, 2.0) == "loss is nan"
    assert non_finite_reason(0.5, math.inf) == "gradient norm is inf"


def test_guard_counts_and_stops_after_max_skipped_in_a_row():
    lines: list[str] = []
    guard = NonFiniteGuard(max_skipped_steps=2)
    guard.skip(3, "loss is nan", write=lines.append)
    guard.passed()  # a good step ends the streak, not the count
    guard.skip(5, "loss is nan", write=lines.append)
    guard.skip(6, "gradient norm is inf", write=lines.append)
    assert (guard.skipped, guard.in_a_row) == (3, 2)
    assert lines[0].startswith("step 3 skipped: loss is nan; no update (skipped 1 in a row")
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row skipped .*optim\.lr"):
        guard.skip(7, "loss is nan", write=lines.append)
    restored = NonFiniteGuard(max_skipped_steps=2)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored == guard


def test_first_non_finite_finds_parameters_and_optimizer_state():
    model = tiny_model("qwen3", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    assert first_non_finite([*model.named_parameters(), *optimizer_tensors(optimizer)]) is None
    next(iter(optimizer.state.values()))["exp_avg"].view(-1)[3] = math.inf
    found = first_non_finite([*model.named_parameters(), *optimizer_tensors(optimizer)])
    assert found is not None and found.startswith("optimizer state exp_avg of parameter 0")


def test_rollout_refuses_non_finite_logits():
    model = tiny_model("qwen3", seed=0)
    adapter = ls.adapt(model)
    state = adapter.prefill(torch.tensor([1, 2, 3, 4]))
    with torch.no_grad():
        model.lm_head.weight.view(-1)[0] = math.nan
    with pytest.raises(NonFiniteError, match="non-finite logits at decode step 0"):
        ls.rollout(adapter, state, 2, 3, seed=0)


# --------------------------------------------------------------------------- the stop


def test_first_signal_is_recorded_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: the run goes on
        assert stop.requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert GracefulStop.exit_code(signal.SIGTERM) == 143


def test_the_first_signal_has_on_signal_write_from_the_watcher_thread(capfd):
    """The watcher acts whatever the main thread does (in a run: maybe waiting in a
    collective, where no Python handler runs)."""
    threads: list[str] = []
    done = threading.Event()

    def on_signal() -> Path:
        threads.append(threading.current_thread().name)
        done.set()
        return Path("out/step-000001")

    with GracefulStop(on_signal=on_signal) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10) and stop.requested() == signal.SIGTERM
    assert threads == ["LongStraw-SignalSave"]  # not the main thread
    err = capfd.readouterr().err
    assert "SIGTERM: finishing this step" in err
    assert "SIGTERM: saved out/step-000001 (the last finished step)" in err


# --------------------------------------------------------------------------- resume


def test_apply_optimizer_settings_keeps_the_schedule_factor():
    cfg = load_config(TINY, ["optim.scheduler=cosine", "optim.warmup_steps=2", "train.steps=10"])
    model = tiny_model("qwen3", seed=0)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    factor = optimizer.param_groups[0]["lr"] / cfg.optim.lr
    changed = load_config(
        TINY, ["optim.scheduler=cosine", "optim.warmup_steps=2", "train.steps=10",
               "optim.lr=5e-3", "optim.betas=[0.5,0.6]", "optim.weight_decay=0.5"],
    )  # fmt: skip
    changes = resume.apply_optimizer_settings(optimizer, scheduler, changed.optim)
    assert [c.key for c in changes] == ["optim.lr", "optim.betas", "optim.weight_decay"]
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-3 * factor) and scheduler.base_lrs == [5e-3]
    assert group["betas"] == (0.5, 0.6) and group["weight_decay"] == 0.5
    scheduler.step()  # the schedule goes on from the new base rate
    assert group["lr"] == pytest.approx(5e-3 * scheduler.lr_lambdas[0](5))
    assert resume.apply_optimizer_settings(optimizer, scheduler, changed.optim) == []


def test_config_changes_are_listed_and_model_changes_refused():
    saved = {"model": {"tiny": "qwen3", "path": None}, "optim": {"lr": 1e-3}, "train": {}}
    now = {"model": {"tiny": "qwen3", "path": "/moved"}, "optim": {"lr": 5e-3}, "train": {}}
    changes = resume.config_changes(saved, now)
    assert [str(c) for c in changes] == ["model.path: None -> '/moved'", "optim.lr: 0.001 -> 0.005"]
    resume.check_resumable(changes, "ckpt")  # a moved path and a new lr: fine
    lora = resume.config_changes({"lora": {"r": 8}}, {"lora": {"r": 16}})
    with pytest.raises(ConfigError, match=r"lora\.r: differs from the run that wrote ckpt"):
        resume.check_resumable(lora, "ckpt")


# --------------------------------------------------------------------------- input checks


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, True])
def test_grpo_step_refuses_a_bad_loss_scale(scale):
    adapter = ls.adapt(tiny_model("qwen3", seed=0))
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= 0"):
        ls.grpo_step(adapter, [1, 2, 3], [[4, 5], [6]], [0.0, 1.0], loss_scale=scale)


def test_huge_rewards_count_as_a_failing_function():
    sample = Sample(id="s", prompt="p", answer="a")

    def huge(completions, **kwargs):
        return [1e300, -1e300]

    def fine(completions, **kwargs):
        return [0.0, 1.0]

    batch = (["x", "y"], [sample] * 2)
    ids = [[1], [2]]
    result = RewardSet([huge, fine])(*batch, completion_ids=ids)
    assert result.failed == {"huge": ["s", "s"]} and not result.all_failed
    assert result.rewards == [0.0, 1.0]
    assert RewardSet([huge])(*batch, completion_ids=ids).all_failed
    with pytest.raises(RewardError, match=re.escape(f"beyond |reward| <= {MAX_ABS_REWARD:g}")):
        RewardSet([huge], raise_errors=True)(*batch, completion_ids=ids)


def test_new_train_keys_are_validated(tmp_path):
    cfg = load_config(TINY, ["train.keep_last=2", "train.max_skipped_steps=0"])
    assert (cfg.train.keep_last, cfg.train.max_skipped_steps) == (2, 0)
    for override in ("train.keep_last=-1", "train.max_skipped_steps=-2"):
        with pytest.raises(ConfigError) as error:
            load_config(TINY, [override])
        assert error.value.key == override.split("=")[0]
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        load_config(TINY, [f"train.output_dir={a_file}"])


def test_logger_state_is_strict_json(tmp_path):
    from accelerate import Accelerator

    logger = RunLogger(Accelerator(cpu=True), output_dir=tmp_path, wandb=False, write=print)
    logger.log(1, {"entropy": math.nan, "loss": 0.5})
    text = json.dumps(logger.state_dict(), allow_nan=False)  # raises on a bare NaN
    restored = RunLogger(Accelerator(cpu=True), output_dir=tmp_path, wandb=False, write=print)
    restored.load_state_dict(json.loads(text))
    assert math.isnan(restored.history[0][1]["entropy"]) and restored.history[0][1]["loss"] == 0.5
