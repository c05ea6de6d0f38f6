"""The state of a model on pipeline stages: written as one whole model's, read by each stage.

A stage holds its own layers under the whole model's names (``longstraw_core.pipeline``), so
the stages of replica 0 send their tensors and optimizer state to rank 0, which writes the
same files a single process writes: the optimizer state indexed in the whole model's
parameter order. Loading, rank 0 checks the files against the whole model's names and
shapes (``StagedModel``), then every stage reads only the tensors it owns and the optimizer
entries of its own parameters. A checkpoint therefore moves between any numbers of stages,
and to or from a single process. With FSDP2 across the replicas each stage's tensors are
``DTensor`` shards: every replica gathers them whole (a collective of the stage's replicas)
before replica 0 sends them, and loading shards what a stage reads (``distribute_tensor``
from the copy every rank read, no communication).

NOTE: rank 0 gathers every stage's tensors in host memory to write them: fine for LoRA
adapters, a whole model's worth for full fine-tuning (each stage writing its own shard is
the way past that).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from longstraw_core.checkpoint.checks import check_optimizer_count
from longstraw_core.checkpoint.errors import CheckpointError, listed, unreadable
from longstraw_core.checkpoint.reading import (
    read_adapters,
    saved_adapter_name,
    torch_load,
    weight_files,
)
from longstraw_core.checkpoint.sharded import optimizer_names
from longstraw_core.pipeline.stage import StagedModel, staged_model
from longstraw_core.tensors.peft_types import is_peft_model

if TYPE_CHECKING:
    from peft import PeftModel


def is_staged(model: torch.nn.Module) -> bool:
    return staged_model(model) is not None


# --------------------------------------------------------------------------- saving


def gather_staged_state(
    model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model's tensors (a LoRA model's trainable adapters) and optimizer state, on
    rank 0, from the stages of replica 0; other ranks get empty dicts. Collective over the
    stages of replica 0 (the other replicas hold the same values and send nothing)."""
    record = staged_model(model)
    link = record.stage.link
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            "a staged checkpoint stores one optimizer parameter group (models.build_optimizer "
            f"builds one); this optimizer has {len(optimizer.param_groups)}"
        )
    lora = is_peft_model(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    tensors = {
        name: _whole(value)
        for name, value in model.state_dict().items()
        if not lora or name in trainable
    }
    names = optimizer_names(model, optimizer)
    local = optimizer.state_dict()
    mine = {
        "tensors": tensors,
        "state": {
            names[index]: {key: _whole(item) for key, item in value.items()}
            for index, value in local["state"].items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in local["param_groups"]],
    }
    if 0 not in link.ranks:
        return {}, {}
    parts: list[dict | None] | None = [None] * link.stages if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=link.group)
    if dist.get_rank() != 0:
        return {}, {}
    return _merge_tensors(parts), _merge_optimizer(parts, record)


def _whole(value: Any) -> Any:
    """A tensor of the state on the CPU, whole (an FSDP shard is gathered: a collective of
    the stage's replicas, which every one of them makes in the same order)."""
    if not torch.is_tensor(value):
        return value
    value = value.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).cpu()


def save_staged_adapters(
    directory: Path, model: PeftModel, tensors: dict[str, torch.Tensor]
) -> None:
    """Rank 0 writes every stage's adapters as ``PeftModel.save_pretrained`` does (its config,
    inference mode on; the tensors without the adapter's name). Written here because peft
    selects the tensors to save by the modules of the model at hand, which on rank 0 are
    its own stage's only."""
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    config.inference_mode = True
    config.save_pretrained(str(directory))
    adapters = {saved_adapter_name(k, model): v.contiguous() for k, v in tensors.items()}
    save_file(adapters, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def _merge_tensors(parts: list[dict]) -> dict[str, torch.Tensor]:
    return {name: value for part in parts for name, value in part["tensors"].items()}


def _merge_optimizer(parts: list[dict], record: StagedModel) -> dict[str, Any]:
    """One ``optimizer.state_dict()`` of the whole model: indices in its parameter order."""
    index = {name: i for i, name in enumerate(record.trainable)}
    state = {index[name]: value for part in parts for name, value in part["state"].items()}
    group = parts[0]["groups"][0] if parts[0]["groups"] else {}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(index)))}]}


# --------------------------------------------------------------------------- loading


def load_staged(
    directory: Path, model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer | None
) -> None:
    """This stage's tensors and optimizer entries from a checkpoint rank 0 checked; every
    rank reads its own share (all files were read and checked before any object changes)."""
    record = staged_model(model)
    if is_peft_model(model):
        saved = read_adapters(directory / "model")
        own = {saved_adapter_name(n, model) for n, _ in model.named_parameters() if "lora_" in n}
        weights = {name: value for name, value in saved.items() if name in own}
        missing = sorted(own - set(weights))
    else:
        own = set(model.state_dict())
        weights = _read_tensors(directory / "model", own)
        missing = sorted(own - set(weights))
    if missing:
        raise CheckpointError(
            f"{directory}: the checkpoint lacks this stage's tensors ({listed(missing)})"
        )
    optimizer_state = None
    if optimizer is not None:
        path = directory / "optimizer.pt"
        optimizer_state = _own_optimizer_state(path, torch_load(path, directory), model,
                                               optimizer, record)  # fmt: skip
    weights = _sharded_like(weights, _model_tensors(model))
    if is_peft_model(model):
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise CheckpointError(
                f"{directory}: unexpected adapters {listed(result.unexpected_keys)}"
            )
    else:
        model.load_state_dict(weights, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors under the names a checkpoint stores (a LoRA model's
    adapters without the adapter's name)."""
    tensors = model.state_dict()
    if not is_peft_model(model):
        return tensors
    return {saved_adapter_name(name, model): value for name, value in tensors.items()}


def _sharded_like(
    tensors: dict[str, torch.Tensor], model_tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` as the model holds them: sharded where it holds an FSDP ``DTensor`` (every
    replica read the same whole tensor, so each keeps its shard without communication)."""
    return {name: _shard_like(value, model_tensors.get(name)) for name, value in tensors.items()}


def _shard_like(value: Any, like: Any) -> Any:
    if not isinstance(like, DTensor) or not torch.is_tensor(value):
        return value
    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def _read_tensors(directory: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of ``save_pretrained`` safetensors, and no others."""
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(directory / file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if key in names:
                        weights[key] = f.get_tensor(key)
        except Exception as error:  # SafetensorError, OSError
            raise unreadable(directory / file, error) from error
    return weights


def _own_optimizer_state(
    path: Path,
    saved: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    record: StagedModel,
) -> dict[str, Any]:
    """The saved whole-model optimizer state, cut to this stage's parameters (by name)."""
    check_optimizer_count(path, saved, [len(record.trainable)])
    by_name = {record.trainable[index]: value for index, value in saved["state"].items()}
    names = optimizer_names(model, optimizer)
    group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    parameters = dict(model.named_parameters())
    return {
        "state": {
            i: {  # an FSDP shard's moments sharded as the parameter is
                key: _shard_like(item, parameters[name]) if key != "step" else item
                for key, item in by_name[name].items()
            }
            for i, name in enumerate(names)
            if name in by_name
        },
        "param_groups": [{**group, "params": list(range(len(names)))}],
    }
