"""``load_checkpoint``: resolve, let rank 0 check everything, then read the state into the
model, optimizer and scheduler and restore the RNGs; ``ResumeInfo`` is what it returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from longstraw_core.checkpoint.checks import check_before_loading
from longstraw_core.checkpoint.files import read_trainer_state
from longstraw_core.checkpoint.model_state import load_state
from longstraw_core.checkpoint.ranks import on_rank0, this_rank
from longstraw_core.checkpoint.reading import torch_load
from longstraw_core.checkpoint.resolution import resolve_checkpoint, warn_of_later
from longstraw_core.checkpoint.rng import own_rng_file, set_rng_state

if TYPE_CHECKING:
    from peft import PeftModel


@dataclass
class ResumeInfo:
    """What ``load_checkpoint`` restored besides the objects it was given."""

    path: Path
    step: int
    data_position: int
    extra: dict[str, Any] = field(default_factory=dict)


def load_checkpoint(
    path: str | os.PathLike,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> ResumeInfo:
    """Restore a checkpoint into existing objects (built as for a fresh run) and the RNGs.

    ``path`` is ``"latest"`` (with ``output_dir``), an output directory or a checkpoint
    directory (``resolve_checkpoint``). Before anything is read into the objects, the files
    are checked against the manifest (sizes; sha256 too with ``verify``), the checkpoint's
    kind (LoRA adapters or full weights) against the model's, and its key names and shapes
    against the model's: each problem is a ``CheckpointError`` naming the file and the fix, and
    leaves the objects untouched. Model weights must match exactly. Everything is read with
    ``weights_only=True``: a checkpoint from elsewhere cannot run code. Distributed: every rank
    calls it; rank 0 checks, a sharded model's weights and optimizer state are read by rank 0
    and broadcast (package docstring), and each rank restores its own RNG states.
    """
    resolved = resolve_checkpoint(path, output_dir)
    if resolved is None:
        raise FileNotFoundError(f"no complete checkpoint in {output_dir}")
    on_rank0(lambda: check_before_loading(resolved, model, scheduler, verify))
    state = read_trainer_state(resolved)
    rng = torch_load(own_rng_file(resolved), resolved) if restore_rng else None
    load_state(resolved, model, optimizer, scheduler)
    if rng is not None:
        set_rng_state(rng)
    if this_rank() == 0:
        warn_of_later(resolved, state["step"])
    return ResumeInfo(resolved, state["step"], state["data_position"], state["extra"])
