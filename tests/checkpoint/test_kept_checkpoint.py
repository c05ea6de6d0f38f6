"""The last finished step kept in host memory (``checkpoint.kept``): what a stop signal writes
while the next step runs must be the checkpoint ``save_checkpoint`` would have written at that
step, untouched by the training since."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from test_checkpoint_faults import LORA
from tiny_training import optimizer_and_schedule, seed_all, tiny_policy, train_step

from longstraw_core.checkpoint import MANIFEST, StepCheckpoints, load_checkpoint, save_checkpoint
from longstraw_core.process.guard import TrainingDiverged

EXTRA = {"config": {"optim": {"lr": 1e-3}}, "data": {"bytes": 12, "sha256": "ab"}}


def _trained(lora: bool):
    seed_all(0)
    model = tiny_policy()
    if lora:
        model = get_peft_model(model, LORA)
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _hashes(step_dir: Path) -> dict[str, str]:
    """Every file of a checkpoint by its sha256, as its manifest lists them."""
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    return {entry["path"]: entry["sha256"] for entry in files}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_kept_step_written_later_is_the_checkpoint_saved_then(tmp_path, lora):
    model, optimizer, scheduler = _trained(lora)
    saved = save_checkpoint(tmp_path / "saved", 1, model, optimizer, scheduler,
                            data_position=1, extra=EXTRA)  # fmt: skip
    kept = StepCheckpoints(tmp_path / "kept", keep_last=None, on_signal=True)
    state = (1, model, optimizer, scheduler)
    assert kept.step_done(*state, data_position=1, extra=EXTRA, write=False) is None
    assert not (tmp_path / "kept").exists()  # kept, not written
    for _ in range(2):  # the next steps change every weight and moment in place
        train_step(model, optimizer, scheduler)
    written = kept.write_kept()  # as a stop signal does, from any thread
    assert written == tmp_path / "kept" / "step-000001"
    assert _hashes(written) == _hashes(saved)  # byte for byte the files saved at step 1
    # The step's own save, when it comes (a stop after that step), finds it written.
    assert kept.step_done(*state, data_position=1, extra=EXTRA, write=True) == written
    assert kept.write_kept() == written
    seed_all(1)
    again = tiny_policy()
    if lora:
        again = get_peft_model(again, LORA)
    opt, sched = optimizer_and_schedule(again)
    info = load_checkpoint(written, again, opt, sched)
    assert info.step == 1 and info.data_position == 1 and info.extra == EXTRA


def test_without_on_signal_nothing_is_kept_or_gathered(tmp_path):
    model, optimizer, scheduler = _trained(lora=False)
    plain = StepCheckpoints(tmp_path, keep_last=None, on_signal=False)
    state = (1, model, optimizer, scheduler)
    assert plain.step_done(*state, data_position=1, extra={}, write=False) is None
    assert plain.write_kept() is None and not tmp_path.joinpath("step-000001").exists()
    assert plain.step_done(*state, data_position=1, extra={}, write=True).is_dir()


def test_a_non_finite_state_is_never_kept_nor_saved(tmp_path):
    model, optimizer, scheduler = _trained(lora=False)
    kept = StepCheckpoints(tmp_path, keep_last=None, on_signal=True)
    kept.step_done(1, model, optimizer, scheduler, data_position=1, extra={}, write=False)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    state = (2, model, optimizer, scheduler)
    assert kept.step_done(*state, data_position=2, extra={}, write=False) is None
    assert kept.write_kept() == tmp_path / "step-000001"  # the last finite step
    with pytest.raises(TrainingDiverged, match=r"not saving step 2: .* holds inf/NaN"):
        kept.step_done(*state, data_position=2, extra={}, write=True)


def test_a_signal_before_any_step_is_kept_has_the_next_kept_step_written_at_once(tmp_path):
    """The signal lands between a step's end and its collection: that step, once collected,
    is the last finished one, and is written at once rather than after the next step."""
    model, optimizer, scheduler = _trained(lora=False)
    kept = StepCheckpoints(tmp_path, keep_last=None, on_signal=True)
    assert kept.write_kept() is None  # nothing kept yet
    written = kept.step_done(1, model, optimizer, scheduler, data_position=1, extra={},
                             write=False)  # fmt: skip
    assert written == tmp_path / "step-000001" and written.is_dir()
