"""Checkpoints: a stopped and resumed run equals an uninterrupted one; saves are atomic;
an FSDP2-sharded model saves the same files and resumes sharded or not."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_training import (
    assert_same_params,
    optimizer_and_schedule,
    seed_all,
    tiny_policy,
    train_step,
)
from torch.distributed.tensor import DTensor

import longstraw_core as ls
from longstraw_core.checkpoint import (
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model


def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    seed_all(0)
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    losses = [train_step(model, optimizer, scheduler) for _ in range(3)]

    seed_all(0)
    first = tiny_policy()
    opt1, sched1 = optimizer_and_schedule(first)
    history = [train_step(first, opt1, sched1)]
    path = save_checkpoint(
        tmp_path, 1, first, opt1, sched1, data_position=7, extra={"losses": history}
    )
    train_step(first, opt1, sched1)  # the "stopped" run goes on and must not leak into the resume

    resumed = tiny_policy(seed=123)  # built as a fresh run would be, with other weights
    opt2, sched2 = optimizer_and_schedule(resumed)
    info = load_checkpoint(tmp_path, resumed, opt2, sched2)
    assert info.path == path and info.step == 1 and info.data_position == 7
    history = info.extra["losses"]
    history += [train_step(resumed, opt2, sched2) for _ in range(2)]

    assert history == losses
    assert_same_params(model, resumed)
    assert sched2.state_dict() == scheduler.state_dict()
    for group, ref in zip(
        opt2.state_dict()["state"].values(), optimizer.state_dict()["state"].values(), strict=True
    ):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(group[key], ref[key])


def test_rng_states_and_data_position_round_trip(tmp_path: Path) -> None:
    seed_all(5)
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, data_position=42, extra={"x": [1.5]})
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    seed_all(99)
    info = load_checkpoint("latest", tiny_policy(), output_dir=tmp_path)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert (info.step, info.data_position, info.extra) == (3, 42, {"x": [1.5]})
    state = json.loads((info.path / "trainer_state.json").read_text())
    assert state["step"] == 3 and info.path.name == "step-000003"


class _DiskFullScheduler(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose state cannot be written: the save fails after the weights and the
    optimizer state are already on disk."""

    def state_dict(self) -> dict:
        raise OSError("No space left on device")


def test_crash_mid_save_leaves_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    good = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, data_position=1)
    train_step(model, optimizer, scheduler)
    failing = _DiskFullScheduler(optimizer, lambda s: 1.0)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, 2, model, optimizer, failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    assert resolve_checkpoint("latest", tmp_path) == good
    assert load_checkpoint(tmp_path, tiny_policy(seed=1)).step == 1
    # ...and the same step can be saved once the problem is fixed.
    assert save_checkpoint(tmp_path, 2, model, optimizer, scheduler).name == "step-000002"
    assert (tmp_path / "latest").read_text() == "step-000002"


def test_extra_that_is_not_json_fails_before_writing_anything(tmp_path: Path) -> None:
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "run", 1, model, optimizer, scheduler, extra={"x": object()})
    assert not (tmp_path / "run").exists()


def test_existing_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    save_checkpoint(tmp_path, 4, model, optimizer, scheduler)
    with pytest.raises(FileExistsError, match="step-000004"):
        save_checkpoint(tmp_path, 4, model, optimizer, scheduler)


def test_nothing_to_resume_and_mismatched_models(tmp_path: Path) -> None:
    assert resolve_checkpoint("latest", tmp_path / "fresh") is None
    with pytest.raises(FileNotFoundError):
        load_checkpoint("latest", tiny_policy(), output_dir=tmp_path / "fresh")
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    other = tiny_model("qwen3", num_hidden_layers=3)
    with pytest.raises(ValueError, match="do not match"):
        load_checkpoint(tmp_path, other)


def test_lora_checkpoint_holds_only_adapters_loadable_by_peft(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_policy(), lora)
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)  # lora_B moves off zero
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, data_position=2)
    files = {p.name for p in (path / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files

    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    loaded = PeftModel.from_pretrained(tiny_policy(), path / "model")
    for key, value in loaded.state_dict().items():
        if "lora_" in key:
            assert torch.equal(value, trained[key]), key

    fresh = get_peft_model(tiny_policy(), lora)
    fresh_opt, fresh_sched = optimizer_and_schedule(fresh)
    assert load_checkpoint(path, fresh, fresh_opt, fresh_sched).data_position == 2
    assert_same_params(model, fresh)
    assert fresh_opt.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


# --------------------------------------------------------------------------- sharded (FSDP2)


def _built(lora: bool, sharded: bool, seed: int = 0):
    """A tiny model (LoRA or not), sharded by FSDP2 or not, with its optimizer and schedule."""
    model = tiny_policy(seed)
    if lora:
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    if sharded:
        shard_model(ls.adapt(model))
    return model, *optimizer_and_schedule(model)


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter as a whole tensor (gathered when sharded); a LoRA
    checkpoint holds only the adapters, the base model comes from its own checkpoint."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return {
        index: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        for index, state in optimizer.state_dict()["state"].items()
    }


@pytest.mark.parametrize("lora", [False, True])
def test_sharded_checkpoint_resumes_sharded_and_unsharded_runs(tmp_path, world_of_one, lora):
    seed_all(0)
    model, optimizer, scheduler = _built(lora, sharded=True)
    train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path / "sharded", 1, model, optimizer, scheduler, data_position=3)
    files = {p.name for p in (path / "model").iterdir()}
    assert ("adapter_model.safetensors" in files) == lora and ("model.safetensors" in files) != lora
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    expected = _whole_optimizer_state(optimizer)
    assert saved["state"].keys() == expected.keys()  # keyed by index, whole tensors
    for index, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][index][key], state[key]), (index, key)

    # Into a fresh sharded run and a fresh single-process run (other initial weights).
    for sharded in (True, False):
        other, other_opt, other_sched = _built(lora, sharded=sharded, seed=7)
        info = load_checkpoint(path, other, other_opt, other_sched)
        assert (info.step, info.data_position) == (1, 3)
        for name, value in _whole(model).items():
            assert torch.equal(_whole(other)[name], value), name
        resumed = _whole_optimizer_state(other_opt)
        for index, state in expected.items():
            assert torch.equal(resumed[index]["exp_avg_sq"], state["exp_avg_sq"]), index
        assert other_opt.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
        assert other_sched.state_dict() == scheduler.state_dict()
    # ... and a single process's checkpoint into a sharded run.
    plain, plain_opt, plain_sched = _built(lora, sharded=False)
    train_step(plain, plain_opt, plain_sched)
    save_checkpoint(tmp_path / "plain", 1, plain, plain_opt, plain_sched)
    other, other_opt, other_sched = _built(lora, sharded=True, seed=7)
    load_checkpoint(tmp_path / "plain", other, other_opt, other_sched)
    for name, value in _whole(plain).items():
        assert torch.equal(_whole(other)[name], value), name


def test_sharded_load_refuses_a_checkpoint_of_another_model(tmp_path, world_of_one):
    model, optimizer, scheduler = _built(lora=False, sharded=True)
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    with pytest.raises(FileExistsError, match="step-000001"):
        save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    other = tiny_model("qwen3", num_hidden_layers=3)
    shard_model(ls.adapt(other))
    with pytest.raises(ValueError, match="do not match"):
        load_checkpoint(tmp_path, other)
