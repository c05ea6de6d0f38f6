"""``save_checkpoint``: every rank gathers, rank 0 checks the disk has room and writes into
``.tmp-step-N``, the manifest last, renames the directory into place, then updates ``latest``
and prunes. A full disk is a one-line ``CheckpointError`` (``space``). The failpoints mark
each stage for the fault-injection tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from longstraw_core.checkpoint.files import (
    LATEST,
    TRAINER_STATE,
    checkpoint_name,
    fsync_dir,
    trainer_state_json,
    write_atomic,
    write_manifest,
    write_text,
)
from longstraw_core.checkpoint.model_state import save_state
from longstraw_core.checkpoint.ownership import require_ours
from longstraw_core.checkpoint.ranks import gather, on_rank0
from longstraw_core.checkpoint.resolution import (
    complete_checkpoints,
    prune,
    refuse_existing,
    set_aside_incomplete,
)
from longstraw_core.checkpoint.rng import rng_file, rng_state
from longstraw_core.checkpoint.sharded import gather_state
from longstraw_core.checkpoint.space import (
    bytes_needed,
    check_room,
    disk_full,
    free_bytes,
    no_space,
)
from longstraw_core.checkpoint.staged import gather_staged_state, is_staged
from longstraw_core.process.failpoints import failpoint

if TYPE_CHECKING:
    from peft import PeftModel


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    data_position: int = 0,
    extra: dict[str, Any] | None = None,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and point ``latest`` at it.

    ``data_position`` is the index of the next sample to draw (``make_task_stream(start=...)``).
    ``extra`` must be JSON-serialisable with finite floats (metrics history, W&B run id, ...).
    ``keep_last``: afterwards delete the complete checkpoints beyond the newest K (None or 0:
    keep all). Returns the checkpoint directory. Raises ``FileExistsError`` if that step or a
    later one is a complete checkpoint already (see ``prepare_resume``); an incomplete one is
    set aside. Raises ``CheckpointError`` when the disk has no room for it (checked before
    writing; a disk that fills during the write too), the previous checkpoint intact. Distributed: every rank calls it (a sharded model is gathered; package
    docstring) and rank 0 writes; an error on rank 0 is raised on every rank.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be None or >= 0, not {keep_last}")
    root = Path(output_dir)
    final = root / checkpoint_name(step)
    # Serialised first: an ``extra`` that is not strict JSON fails before gigabytes are written.
    trainer_state = trainer_state_json(step, data_position, extra or {})
    on_rank0(lambda: refuse_existing(root, step))
    gather_whole = gather_staged_state if is_staged(model) else gather_state
    model_state, optimizer_state = gather_whole(model, optimizer)
    rng_states = gather(rng_state())
    on_rank0(
        lambda: _write_checkpoint(
            root, final, step, model, model_state, optimizer_state,
            scheduler.state_dict() if scheduler is not None else None, rng_states,
            trainer_state, keep_last,
        )
    )  # fmt: skip
    return final


def _write_checkpoint(
    root: Path,
    final: Path,
    step: int,
    model: PreTrainedModel | PeftModel,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any] | None,
    rng_states: list[dict[str, Any]],
    trainer_state: str,
    keep_last: int | None,
) -> None:
    """Rank 0's part: every file into a temporary directory, the manifest last, renamed into
    place when done; then ``latest`` and the pruning. Also writes what ``kept`` collected
    earlier (no collective here)."""
    # failpoint(...): where the fault-injection tests kill the process (a no-op otherwise).
    failpoint("checkpoint.start", step)
    require_ours(root)  # not a directory made again under the run (another run's, maybe)
    root.mkdir(parents=True, exist_ok=True)
    set_aside_incomplete(root)  # includes an incomplete ``final`` and a stale ``.tmp-*``
    earlier = complete_checkpoints(root)
    previous = f"{earlier[-1].name} is intact" if earlier else "no earlier checkpoint here"
    needed = bytes_needed(model, model_state, optimizer_state)
    check_room(root, final.name, needed, previous)  # before the first byte is written
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    try:
        save_state(tmp, model, model_state, optimizer_state, scheduler_state)
        failpoint("checkpoint.model_written", step)
        for rank, state in enumerate(rng_states):
            torch.save(state, tmp / rng_file(rank))
        write_text(tmp / TRAINER_STATE, trainer_state)
        failpoint("checkpoint.files_written", step)
        write_manifest(tmp, step)
        failpoint("checkpoint.manifest_written", step)
        fsync_dir(tmp)
        os.replace(tmp, final)
    except BaseException as error:
        full = isinstance(error, Exception) and disk_full(error, root)  # before freeing tmp
        shutil.rmtree(tmp, ignore_errors=True)  # this save's own files, never found ones
        if full:
            raise no_space(root, final.name, needed, free_bytes(root), previous) from error
        raise
    failpoint("checkpoint.renamed", step)
    fsync_dir(root)
    write_atomic(root / LATEST, final.name)
    failpoint("checkpoint.latest_written", step)
    if keep_last:
        prune(root, keep_last, final)
