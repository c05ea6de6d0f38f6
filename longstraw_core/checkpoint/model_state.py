"""Model, optimizer and scheduler state of a model in one process: written with
``save_pretrained`` and ``torch.save``, read back only once every file is read and checked.
A sharded model's state goes through ``sharded`` instead, a staged one's through ``staged``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from longstraw_core.checkpoint.checks import check_optimizer_state
from longstraw_core.checkpoint.errors import CheckpointError, listed
from longstraw_core.checkpoint.reading import (
    read_adapters,
    read_weights,
    torch_load,
    untied_missing,
)
from longstraw_core.checkpoint.sharded import is_sharded, load_sharded
from longstraw_core.checkpoint.staged import is_staged, load_staged, save_staged_adapters
from longstraw_core.tensors.peft_types import is_peft_model

if TYPE_CHECKING:
    from peft import PeftModel


def save_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any] | None,
) -> None:
    # A PeftModel's save_pretrained writes only the adapters (and their config), which is
    # all a LoRA run changes; the base model is reloaded from its own checkpoint. With
    # ``model_state`` (gathered from a sharded model) it writes those tensors instead of
    # reading the model's own, which are shards.
    with _no_progress_bars():
        if model_state is None:
            model.save_pretrained(directory / "model")
        elif is_peft_model(model) and is_staged(model):  # gathered from the stages
            save_staged_adapters(directory / "model", model, model_state)
        else:
            model.save_pretrained(directory / "model", state_dict=model_state)
    torch.save(optimizer_state, directory / "optimizer.pt")
    if scheduler_state is not None:
        torch.save(scheduler_state, directory / "scheduler.pt")


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without transformers' "Writing model shards" bar: a save's own line says it is done,
    and a bar per checkpoint, between the step lines, is noise."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    """Every file is read (and checked) before the first object changes."""
    scheduler_state = None
    if scheduler is not None:
        scheduler_state = torch_load(directory / "scheduler.pt", directory)
    if is_staged(model):  # each stage reads its own (and shards it over its replicas)
        load_staged(directory, model, optimizer)
    elif is_sharded(model):
        load_sharded(directory, model, optimizer)
    else:
        lora = is_peft_model(model)
        weights = (read_adapters if lora else read_weights)(directory / "model")
        optimizer_state = None
        if optimizer is not None:
            optimizer_state = torch_load(directory / "optimizer.pt", directory)
            check_optimizer_state(directory / "optimizer.pt", optimizer_state, optimizer)
        if lora:
            _load_adapters(directory / "model", model, weights)
        else:
            _load_weights(directory / "model", model, weights)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)


def _load_adapters(directory: Path, model: PeftModel, saved: dict[str, torch.Tensor]) -> None:
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, saved)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{directory}: the adapters do not match the model (missing {listed(missing)}; "
            f"unexpected {listed(result.unexpected_keys)})"
        )


def _load_weights(
    directory: Path, model: PreTrainedModel, weights: dict[str, torch.Tensor]
) -> None:
    """Load ``save_pretrained`` tensors in place (names and shapes were checked before)."""
    result = model.load_state_dict(weights, strict=False)
    # save_pretrained drops tied copies (lm_head tied to the embeddings): missing is fine for
    # a parameter that shares storage with a loaded one, an error for anything else.
    untied = untied_missing(model, list(result.missing_keys), set(weights))
    if untied or result.unexpected_keys:
        raise CheckpointError(
            f"{directory}: the weights do not match the model (missing {listed(untied)}; "
            f"unexpected {listed(result.unexpected_keys)})"
        )
