"""Checkpoints that a stopped run resumes from exactly: weights, optimizer, RNG, data position.

Layout under the run's output directory::

    <output_dir>/step-000010/model/          save_pretrained: full weights, or only the PEFT
                                             adapters of a LoRA model
    <output_dir>/step-000010/optimizer.pt    optimizer.state_dict() (whole tensors)
    <output_dir>/step-000010/scheduler.pt    lr_scheduler.state_dict() (when there is one)
    <output_dir>/step-000010/rng.pt          python, numpy, torch CPU and CUDA generator states
                                             (of rank 0 in a distributed run)
    <output_dir>/step-000010/rng-rank1.pt    ... of rank 1, and so on (distributed runs only)
    <output_dir>/step-000010/trainer_state.json  step, data position, ``extra`` (metrics history)
    <output_dir>/latest                      the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed to ``step-NNNNNN`` only
when every file is on disk (``os.replace`` of a directory is atomic on POSIX), then ``latest``
is replaced the same way. A crash mid-save therefore leaves the previous ``latest`` valid and
no partial ``step-*`` directory; a stale ``.tmp-*`` directory is ignored and cleaned up by the
next save of that step. An existing ``step-*`` directory is never overwritten.

Distributed runs (``torch.distributed`` initialised): every rank calls ``save_checkpoint`` and
``load_checkpoint``, with the same arguments. A model sharded by FSDP2 (``DTensor``
parameters) is gathered whole onto rank 0's CPU with ``torch.distributed.checkpoint``'s
``get_model_state_dict`` / ``get_optimizer_state_dict`` (``full_state_dict``,
``cpu_offload``; a LoRA model gathers only its trainable adapters), and every rank's RNG
states are collected; rank 0 alone writes, in the layout above, so a checkpoint of a sharded
run is the same files as one of a single process and either resumes the other (the optimizer
state is stored by parameter index, as ``optimizer.state_dict()`` does). Loading, rank 0 reads
the weights and the optimizer state and ``set_model_state_dict`` /
``set_optimizer_state_dict`` broadcast them (``broadcast_from_rank0``: one whole copy in host
memory, on rank 0); each rank reads its own RNG file, so ``output_dir`` must be on a
filesystem every rank sees. A failure on rank 0 (a checkpoint that already exists, a full
disk, weights that do not match) is raised on every rank rather than leaving the others
waiting in a collective. Gathering the whole model on one host is simple but bounded by its
memory; very large full fine-tunes would want ``torch.distributed.checkpoint``'s sharded
format instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

FORMAT_VERSION = 1
LATEST = "latest"


@dataclass
class ResumeInfo:
    """What ``load_checkpoint`` restored besides the objects it was given."""

    path: Path
    step: int
    data_position: int
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    data_position: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and point ``latest`` at it.

    ``data_position`` is the index of the next sample to draw (``make_task_stream(start=...)``).
    ``extra`` must be JSON-serialisable (metrics history, W&B run id, ...). Returns the
    checkpoint directory. Raises ``FileExistsError`` if that step was already saved.
    Distributed: every rank calls it (a sharded model is gathered; module docstring) and
    rank 0 writes; an error on rank 0 is raised on every rank.
    """
    root = Path(output_dir)
    final = root / checkpoint_name(step)
    rank = _rank()
    clash = FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
    _agree(clash if rank == 0 and final.exists() else None)
    # Serialised first: an ``extra`` that is not JSON fails before gigabytes are written.
    trainer_state = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "step": step,
            "data_position": data_position,
            "extra": extra or {},
        },
        indent=2,
    )
    model_state, optimizer_state = _gather_state(model, optimizer)
    rng_states = _gather(_rng_state())
    error = None
    if rank == 0:
        try:
            _write_checkpoint(
                root, final, model, model_state, optimizer_state, scheduler, rng_states,
                trainer_state,
            )  # fmt: skip
        except BaseException as caught:  # re-raised by _agree, on every rank
            error = caught
    _agree(error)
    return final


def _write_checkpoint(
    root: Path,
    final: Path,
    model: PreTrainedModel | PeftModel,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    rng_states: list[dict[str, Any]],
    trainer_state: str,
) -> None:
    """Rank 0's part: every file into a temporary directory, renamed into place when done."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    try:
        tmp.mkdir()
        _save_state(tmp, model, model_state, optimizer_state, scheduler)
        for rank, state in enumerate(rng_states):
            torch.save(state, tmp / _rng_file(rank))
        _write_text(tmp / "trainer_state.json", trainer_state)
        _fsync_dir(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)


def resolve_checkpoint(
    path_or_latest: str | os.PathLike, output_dir: str | os.PathLike | None = None
) -> Path | None:
    """The checkpoint directory meant by ``train.resume_from``.

    ``"latest"``: the one ``<output_dir>/latest`` names, or None when nothing was saved yet
    (so the same command starts a run and resumes it after a preemption). Otherwise an
    output directory holding a ``latest`` pointer, or a checkpoint directory itself.
    """
    if str(path_or_latest) == LATEST:
        if output_dir is None:
            raise ValueError("resume_from='latest' needs the run's output_dir")
        pointer = Path(output_dir) / LATEST
        return Path(output_dir) / pointer.read_text().strip() if pointer.is_file() else None
    path = Path(path_or_latest)
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"{path} is neither a checkpoint (no trainer_state.json) nor an output directory "
            "with a 'latest' file"
        )
    return path


def load_checkpoint(
    path: str | os.PathLike,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    restore_rng: bool = True,
) -> ResumeInfo:
    """Restore a checkpoint into existing objects (built as for a fresh run) and the RNGs.

    ``path`` is ``"latest"`` (with ``output_dir``), an output directory with a ``latest``
    pointer, or a checkpoint directory. Model weights must match exactly: a missing or
    unexpected key is an error, not a silent partial load. Everything is read with
    ``weights_only=True``: a checkpoint from elsewhere cannot run code. Distributed: every
    rank calls it; a sharded model's weights and optimizer state are read by rank 0 and
    broadcast (module docstring), and each rank restores its own RNG states.
    """
    resolved = resolve_checkpoint(path, output_dir)
    if resolved is None:
        raise FileNotFoundError(f"no checkpoint in {output_dir} (no '{LATEST}' file)")
    state = json.loads((resolved / "trainer_state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{resolved}: checkpoint format {state.get('format_version')} is not {FORMAT_VERSION}"
        )
    _load_state(resolved, model, optimizer, scheduler)
    if restore_rng:
        _set_rng_state(torch.load(_own_rng_file(resolved), weights_only=True))
    return ResumeInfo(resolved, state["step"], state["data_position"], state["extra"])


# --------------------------------------------------------------------------- model + optimizer


def _save_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    # A PeftModel's save_pretrained writes only the adapters (and their config), which is
    # all a LoRA run changes; the base model is reloaded from its own checkpoint. With
    # ``model_state`` (gathered from a sharded model) it writes those tensors instead of
    # reading the model's own, which are shards.
    if model_state is None:
        model.save_pretrained(directory / "model")
    else:
        model.save_pretrained(directory / "model", state_dict=model_state)
    torch.save(optimizer_state, directory / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")


def _load_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    if _is_sharded(model):
        _load_sharded(directory, model, optimizer)
    else:
        if isinstance(model, PeftModel):
            _load_adapters(directory / "model", model)
        else:
            _load_weights(directory / "model", model)
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        if not (directory / "scheduler.pt").is_file():
            raise FileNotFoundError(f"{directory} holds no scheduler state but one was passed")
        scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))


def _load_adapters(directory: Path, model: PeftModel) -> None:
    result = set_peft_model_state_dict(model, load_peft_weights(str(directory), device="cpu"))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"{directory}: adapters do not match the model (missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]})"
        )


def _load_weights(directory: Path, model: PreTrainedModel) -> None:
    """Load ``save_pretrained`` safetensors (one file or an index of shards) in place."""
    weights = _read_weights(directory)
    result = model.load_state_dict(weights, strict=False)
    # save_pretrained drops tied copies (lm_head tied to the embeddings): missing is fine for
    # a parameter that shares storage with a loaded one, an error for anything else.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in weights if k in params}
    untied = [
        k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded
    ]
    if untied or result.unexpected_keys:
        raise ValueError(
            f"{directory}: weights do not match the model (missing {untied[:5]}, "
            f"unexpected {result.unexpected_keys[:5]})"
        )


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``save_pretrained`` safetensors: one file or an index of shards."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights |= load_file(directory / name)
    return weights


# --------------------------------------------------------------------------- sharded models


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 sharded ``model``: its parameters are ``DTensor`` s."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _gather_state(
    model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """The model's tensors and the optimizer state to write, on rank 0.

    Unsharded: ``None`` (``save_pretrained`` reads the model itself) and
    ``optimizer.state_dict()``. Sharded: whole tensors gathered onto rank 0's CPU (a LoRA
    model's trainable adapters only), the optimizer state keyed by parameter index as in
    ``optimizer.state_dict()``; other ranks get empty dicts. Collective when sharded.
    """
    if not _is_sharded(model):
        return None, optimizer.state_dict()
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=isinstance(model, PeftModel)
    )
    model_state = get_model_state_dict(model, options=options)
    if not optimizer.state:  # before the first step: nothing to gather (and DCP would
        return model_state, optimizer.state_dict()  # initialise the state by a step)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if _rank() != 0:
        return model_state, {}
    index = {name: i for i, name in enumerate(_optimizer_names(model, optimizer))}
    return model_state, {
        "state": {index[name]: value for name, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }


def _load_sharded(
    directory: Path, model: PreTrainedModel | PeftModel, optimizer: torch.optim.Optimizer | None
) -> None:
    """Rank 0 reads and checks the files; DCP broadcasts them into every rank's shards."""
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, Any] = {}
    error = None
    if _rank() == 0:
        try:
            if isinstance(model, PeftModel):
                weights = _adapter_weights(directory / "model", model)
            else:
                weights = _full_weights(directory / "model", model)
            if optimizer is not None:
                optimizer_state = _optimizer_state_by_name(
                    torch.load(directory / "optimizer.pt", weights_only=True), model, optimizer
                )
        except Exception as caught:  # re-raised by _agree, on every rank
            error = caught
    _agree(error)
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
    saved = load_peft_weights(str(directory), device="cpu")
    adapter = f".{model.active_adapter}"
    names = [name for name, _ in model.named_parameters() if "lora_" in name]
    missing = [name for name in names if name.replace(adapter, "") not in saved]
    unexpected = sorted(set(saved) - {name.replace(adapter, "") for name in names})
    if missing or unexpected:
        raise ValueError(
            f"{directory}: adapters do not match the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    return {name: saved[name.replace(adapter, "")] for name in names}


def _full_weights(directory: Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The saved weights, checked against the model's keys (a tied copy may be missing)."""
    weights = _read_weights(directory)
    expected = set(model.state_dict())
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in weights if k in params}
    untied = sorted(
        k for k in expected - set(weights) if k not in params or id(params[k]) not in loaded
    )
    unexpected = sorted(set(weights) - expected)
    if untied or unexpected:
        raise ValueError(
            f"{directory}: weights do not match the model (missing {untied[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    return weights


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in ``optimizer.state_dict()`` order."""
    names = {param: name for name, param in model.named_parameters()}
    return [names[param] for group in optimizer.param_groups for param in group["params"]]


def _optimizer_state_by_name(
    state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as DCP keys it: by parameter name instead of index."""
    names = _optimizer_names(model, optimizer)
    count = sum(len(group["params"]) for group in state["param_groups"])
    if count != len(names) or len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer state has {count} parameters in "
            f"{len(state['param_groups'])} groups; this optimizer has {len(names)} in "
            f"{len(optimizer.param_groups)}"
        )
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


# --------------------------------------------------------------------------- ranks


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _agree(error: BaseException | None) -> None:
    """Raise rank 0's ``error`` on every rank (a collective when distributed).

    Rank 0 raises it as it is; the other ranks raise a ``RuntimeError`` that quotes it, so
    that no rank goes on to a collective that rank 0 will never join.
    """
    if not _distributed():
        if error is not None:
            raise error
        return
    message = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RuntimeError(f"checkpoint failed on rank 0: {message[0]}")


# --------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional; nothing to restore without it
        return state
    # As plain numbers and a tensor, so the file loads with weights_only=True.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    return state


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def _own_rng_file(directory: Path) -> Path:
    """This rank's RNG file; rank 0's for a rank the saving run did not have (with a
    warning: its random streams then repeat rank 0's)."""
    path = directory / _rng_file(_rank())
    if path.is_file():
        return path
    warnings.warn(
        f"{directory} holds no RNG states for rank {_rank()} (saved by fewer ranks); "
        "restoring rank 0's",
        stacklevel=3,
    )
    return directory / _rng_file(0)


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------- files


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    _write_text(tmp, text)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
