"""Checkpoints that a stopped run resumes from exactly: weights, optimizer, RNG, data position.

Layout under the run's output directory::

    <output_dir>/step-000010/model/          save_pretrained: full weights, or only the PEFT
                                             adapters of a LoRA model
    <output_dir>/step-000010/optimizer.pt    optimizer.state_dict()
    <output_dir>/step-000010/scheduler.pt    lr_scheduler.state_dict() (when there is one)
    <output_dir>/step-000010/rng.pt          python, numpy, torch CPU and CUDA generator states
    <output_dir>/step-000010/trainer_state.json  step, data position, ``extra`` (metrics history)
    <output_dir>/latest                      the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed to ``step-NNNNNN`` only
when every file is on disk (``os.replace`` of a directory is atomic on POSIX), then ``latest``
is replaced the same way. A crash mid-save therefore leaves the previous ``latest`` valid and
no partial ``step-*`` directory; a stale ``.tmp-*`` directory is ignored and cleaned up by the
next save of that step. An existing ``step-*`` directory is never overwritten.

Single process for now. For sharded (FSDP2) runs ``_save_state`` / ``_load_state`` are the
seam: they become ``torch.distributed.checkpoint`` calls on
``get_state_dict(model, optimizer)`` (every rank writes its shards into the same temporary
directory, RNG states go to one file per rank), and rank 0 does the rename and the ``latest``
pointer after a barrier. The layout and the atomicity rule stay as they are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file
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
    """
    root = Path(output_dir)
    final = root / checkpoint_name(step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
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
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    try:
        tmp.mkdir()
        _save_state(tmp, model, optimizer, scheduler)
        torch.save(_rng_state(), tmp / "rng.pt")
        _write_text(tmp / "trainer_state.json", trainer_state)
        _fsync_dir(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)
    return final


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
    ``weights_only=True``: a checkpoint from elsewhere cannot run code.
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
        _set_rng_state(torch.load(resolved / "rng.pt", weights_only=True))
    return ResumeInfo(resolved, state["step"], state["data_position"], state["extra"])


# --------------------------------------------------------------------------- model + optimizer


def _save_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    # A PeftModel's save_pretrained writes only the adapters (and their config), which is
    # all a LoRA run changes; the base model is reloaded from its own checkpoint.
    model.save_pretrained(directory / "model")
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")


def _load_state(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
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
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights |= load_file(directory / name)
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
