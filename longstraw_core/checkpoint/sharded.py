"""The state of an FSDP2-sharded model: gathered whole onto rank 0's CPU to save (the same
files as an unsharded model's, the optimizer state by parameter index) and broadcast from
rank 0 into every rank's shards to load (``torch.distributed.checkpoint.state_dict``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from longstraw_core.checkpoint.checks import check_optimizer_state
from longstraw_core.checkpoint.errors import CheckpointError, listed
from longstraw_core.checkpoint.ranks import agree, this_rank
from longstraw_core.checkpoint.reading import (
    read_adapters,
    read_weights,
    saved_adapter_name,
    torch_load,
    untied_missing,
)
from longstraw_core.tensors.peft_types import is_peft_model

if TYPE_CHECKING:
    from peft import PeftModel


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 sharded ``model``: its parameters are ``DTensor`` s."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def gather_state(
    model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """The model's tensors and the optimizer state to write, on rank 0.

    Unsharded: ``None`` (``save_pretrained`` reads the model itself) and
    ``optimizer.state_dict()``. Sharded: whole tensors gathered onto rank 0's CPU (a LoRA
    model's trainable adapters only), the optimizer state keyed by parameter index as in
    ``optimizer.state_dict()``; other ranks get empty dicts. Collective when sharded.
    """
    if not is_sharded(model):
        return None, optimizer.state_dict()
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft_model(model)
    )
    model_state = get_model_state_dict(model, options=options)
    if not optimizer.state:  # before the first step: nothing to gather (and DCP would
        return model_state, optimizer.state_dict()  # initialise the state by a step)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if this_rank() != 0:
        return model_state, {}
    index = {name: i for i, name in enumerate(optimizer_names(model, optimizer))}
    return model_state, {
        "state": {index[name]: value for name, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }


def load_sharded(
    directory: Path, model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer | None
) -> None:
    """Rank 0 reads and checks the files; DCP broadcasts them into every rank's shards."""
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, Any] = {}
    error = None
    if this_rank() == 0:
        try:
            if is_peft_model(model):
                weights = _adapter_weights(directory / "model", model)
            else:
                weights = _full_weights(directory / "model", model)
            if optimizer is not None:
                path = directory / "optimizer.pt"
                saved = torch_load(path, directory)
                check_optimizer_state(path, saved, optimizer)
                optimizer_state = _optimizer_state_by_name(saved, model, optimizer)
        except Exception as caught:  # re-raised by agree, on every rank
            error = caught
    agree(error)
    # strict=False: a LoRA checkpoint holds only the adapters (the frozen base stays as
    # built); completeness was checked above.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    if optimizer is not None:
        built = [{key: type(value) for key, value in g.items()} for g in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
        # DCP's flattening turns tuples (AdamW's betas) into lists: keep the types as built.
        for group, types in zip(optimizer.param_groups, built, strict=True):
            for key, value in group.items():
                if types.get(key) is tuple and isinstance(value, list):
                    group[key] = tuple(value)


def _adapter_weights(directory: Path, model: PeftModel) -> dict[str, torch.Tensor]:
    """The saved adapters under the model's own parameter names (PEFT drops the adapter's
    name when saving: ``...lora_A.default.weight`` is stored as ``...lora_A.weight``)."""
    saved = read_adapters(directory)
    names = [name for name, _ in model.named_parameters() if "lora_" in name]
    stored = {name: saved_adapter_name(name, model) for name in names}
    missing = [name for name in names if stored[name] not in saved]
    unexpected = sorted(set(saved) - set(stored.values()))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: the adapters do not match the model (missing {listed(missing)}; "
            f"unexpected {listed(unexpected)})"
        )
    return {name: saved[stored[name]] for name in names}


def _full_weights(directory: Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The saved weights, checked against the model's keys (a tied copy may be missing)."""
    weights = read_weights(directory)
    expected = set(model.state_dict())
    untied = untied_missing(model, sorted(expected - set(weights)), set(weights))
    unexpected = sorted(set(weights) - expected)
    if untied or unexpected:
        raise CheckpointError(
            f"{directory}: the weights do not match the model (missing {listed(untied)}; "
            f"unexpected {listed(unexpected)})"
        )
    return weights


def optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in ``optimizer.state_dict()`` order."""
    names = {param: name for name, param in model.named_parameters()}
    return [names[param] for group in optimizer.param_groups for param in group["params"]]


def _optimizer_state_by_name(
    state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as DCP keys it: by parameter name instead of index."""
    names = optimizer_names(model, optimizer)  # counts checked by check_optimizer_state
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
