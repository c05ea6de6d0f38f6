"""The checks made before a tensor is read into the model (rank 0's part of
``load_checkpoint``): manifest and sizes, checksums, LoRA or full weights, key names and
shapes, the optimizer's parameter groups. Each failure is a ``CheckpointError`` with the fix,
and leaves the model untouched."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from longstraw_core.checkpoint.errors import CheckpointError, FormatError, listed
from longstraw_core.checkpoint.files import (
    check_sizes,
    read_manifest,
    verify_checksums,
)
from longstraw_core.checkpoint.reading import (
    header_shapes,
    saved_adapter_name,
    untied_missing,
    weight_files,
)
from longstraw_core.checkpoint.resolution import earlier_hint
from longstraw_core.pipeline.stage import staged_model
from longstraw_core.tensors.peft_types import is_peft_model

if TYPE_CHECKING:
    from peft import PeftModel


def check_before_loading(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    verify: bool,
) -> None:
    """Rank 0's checks, cheapest first, all before a tensor is read into the model."""
    try:
        entries = read_manifest(directory)
        check_sizes(directory, entries)
    except FormatError:
        raise  # one line: an earlier checkpoint there has the same format
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {earlier_hint(directory)}") from None
    _check_kind(directory, model)
    if scheduler is not None and not (directory / "scheduler.pt").is_file():
        raise CheckpointError(
            f"{directory} holds no scheduler state (scheduler.pt) but this run has a learning "
            "rate scheduler: resume with the scheduler settings of the run that saved it"
        )
    if verify:
        try:
            verify_checksums(directory, entries)
        except CheckpointError as error:
            raise CheckpointError(f"{error}; {earlier_hint(directory)}") from None
    if is_peft_model(model):
        _check_adapter_shapes(directory, model)
    else:
        _check_weight_shapes(directory, model)


def _check_kind(directory: Path, model: PreTrainedModel | PeftModel) -> None:
    """LoRA adapters into a LoRA model, full weights into a full one."""
    saved = directory / "model"
    lora = (saved / "adapter_config.json").is_file()
    full = bool(weight_files(saved))
    if is_peft_model(model) and not lora:
        if full:
            raise CheckpointError(
                f"{directory} holds full model weights (model/{weight_files(saved)[0]}) but "
                "this run trains LoRA adapters: set lora.enabled=false with the same model, "
                "or resume from a LoRA checkpoint"
            )
        raise CheckpointError(f"{directory} holds no LoRA adapters (model/adapter_config.json)")
    if not is_peft_model(model) and not full:
        if lora:
            raise CheckpointError(
                f"{directory} holds LoRA adapters (adapter_config.json) but this run trains "
                "full weights: set lora.enabled=true with the same lora settings, or resume "
                "from a full-weights checkpoint"
            )
        raise CheckpointError(f"{directory} holds no model weights (model/model.safetensors)")


def _check_weight_shapes(directory: Path, model: PreTrainedModel) -> None:
    """Key names and shapes from the safetensors headers, before any tensor is read."""
    saved_dir = directory / "model"
    files = weight_files(saved_dir)
    saved: dict[str, tuple[int, ...]] = {}
    for name in files:
        saved |= header_shapes(saved_dir / name)
    expected = _whole_shapes(model)
    missing = untied_missing(model, sorted(set(expected) - set(saved)), set(saved))
    unexpected = sorted(set(saved) - set(expected))
    problem = _mismatch(missing, unexpected, saved, expected)
    if problem:
        where = saved_dir / files[0] if len(files) == 1 else saved_dir
        raise CheckpointError(
            f"{where}: the weights do not match the model, they look like another model's "
            f"({problem}): resume with the model settings of the run that saved them"
        )


def _check_adapter_shapes(directory: Path, model: PeftModel) -> None:
    """The adapters' key names and shapes against the model's (other lora settings?)."""
    file = directory / "model" / "adapter_model.safetensors"
    if not file.is_file():  # adapter_model.bin: checked when read
        return
    saved = header_shapes(file)
    expected = {
        saved_adapter_name(name, model): shape
        for name, shape in _whole_shapes(model).items()
        if "lora_" in name
    }
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(name for name in set(saved) - set(expected) if "lora_" in name)
    problem = _mismatch(missing, unexpected, saved, expected)
    if problem:
        raise CheckpointError(
            f"{file}: the adapters do not match the model ({problem}): resume with the lora "
            "settings (r, target_modules) and the model of the run that saved them"
        )


def _whole_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry's shape, of the whole model even on a pipeline stage (which
    holds only its layers; ``StagedModel.shapes``)."""
    record = staged_model(model)
    if record is not None:
        return dict(record.shapes)
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def _mismatch(
    missing: list[str],
    unexpected: list[str],
    saved: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
) -> str:
    """A short description of what differs, or '' when nothing does."""
    shapes = [
        f"{name} is {list(saved[name])} in the checkpoint, {list(expected[name])} in the model"
        for name in sorted(set(saved) & set(expected))
        if saved[name] != expected[name]
    ]
    parts = []
    if missing:
        parts.append(f"missing {listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {listed(unexpected)}")
    if shapes:
        parts.append(f"different shapes: {listed(shapes)}")
    return "; ".join(parts)


def check_optimizer_state(path: Path, state: Any, optimizer: torch.optim.Optimizer) -> None:
    """The saved state has this optimizer's groups and parameter counts."""
    check_optimizer_count(path, state, [len(group["params"]) for group in optimizer.param_groups])


def check_optimizer_count(path: Path, state: Any, built: list[int]) -> None:
    """The saved state has parameter groups of ``built`` parameters (a staged model counts
    the whole model's, ``StagedModel.trainable``)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{path}: not an optimizer state_dict")
    saved = [len(group["params"]) for group in groups]
    if saved != built:
        raise CheckpointError(
            f"{path}: the optimizer state has parameter groups of {saved} parameters; this "
            f"optimizer has {built}: resume with the trainable parameters and optimizer "
            "settings of the run that saved it"
        )
