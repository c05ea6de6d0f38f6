"""Reading a checkpoint's tensors safely: ``weights_only`` loads, safetensors headers read
without their data, and every unreadable file turned into a ``CheckpointError``; also the
name and storage rules (PEFT's saved adapter names, tied weights) both checks and loads use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from longstraw_core.checkpoint.errors import CheckpointError, unreadable
from longstraw_core.checkpoint.resolution import earlier_hint

if TYPE_CHECKING:
    from peft import PeftModel


def weight_files(directory: Path) -> list[str]:
    """The safetensors files of ``save_pretrained`` full weights in ``directory`` (or [])."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: unreadable ({error})") from None
    return ["model.safetensors"] if (directory / "model.safetensors").is_file() else []


def untied_missing(model: torch.nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """``missing`` less the tied copies save_pretrained drops (lm_head tied to the embeddings):
    a parameter sharing storage with a loaded one."""
    params = dict(model.named_parameters(remove_duplicate=False))
    storage = {_storage(params[k]) for k in loaded if k in params}
    return [k for k in missing if k not in params or _storage(params[k]) not in storage]


def _storage(param: torch.Tensor) -> int:
    return id(param) if isinstance(param, DTensor) else param.data_ptr()


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors header (no tensor data is read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as error:  # SafetensorError, OSError
        raise unreadable(path, error) from error


def torch_load(path: Path, directory: Path) -> Any:
    """``torch.load(weights_only=True)``; a file it cannot read is a ``CheckpointError``."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # OSError (truncated zip), RuntimeError, UnpicklingError
        raise CheckpointError(f"{unreadable(path, error)}; {earlier_hint(directory)}") from error


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``save_pretrained`` safetensors: one file or an index of shards."""
    weights: dict[str, torch.Tensor] = {}
    for name in weight_files(directory):
        try:
            weights |= load_file(directory / name)
        except Exception as error:  # SafetensorError, OSError
            raise unreadable(directory / name, error) from error
    return weights


def read_adapters(directory: Path) -> dict[str, torch.Tensor]:
    """The saved adapters, as PEFT stores them (without the adapter's name)."""
    from peft.utils import load_peft_weights

    try:
        return load_peft_weights(str(directory), device="cpu")
    except Exception as error:  # SafetensorError, OSError, a hub lookup of a local path
        raise unreadable(directory, error) from error


def saved_adapter_name(name: str, model: PeftModel) -> str:
    """The key PEFT stores parameter ``name`` under: without the adapter's name."""
    return name.replace(f".{model.active_adapter}", "")
