"""The last finished step's checkpoint, kept in rank 0's host memory for a stop signal.

``torchrun`` and ``accelerate launch`` pass a SIGTERM on to the ranks and SIGKILL them a
while later (torchrun: ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s;
accelerate's single-process launch: 5 s; a cluster scheduler: its own grace), and a step of a
long-prompt run takes far longer. So at the end of each rollout's steps every rank gathers
what a checkpoint holds (``collect``: a collective, as a save's) into copies in rank 0's host
memory that later training does not touch; a stop signal has rank 0 write them at once
(``StepCheckpoints.write_kept``, any thread, no collective) while the step under way goes on.
The files are the ones ``save_checkpoint`` writes for that step, so the run resumes from them
exactly.

The price: one gather of the trainable state per rollout, and host memory for one copy of it
and of its optimizer state (a LoRA run's adapters: small; a full fine-tune: the model and
AdamW's two moments, 12 bytes a parameter in float32). ``train.save_on_signal=false`` turns
it off: a signal then waits for the step to end, as only a long enough grace period allows.
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from longstraw_core.checkpoint.files import checkpoint_name, trainer_state_json
from longstraw_core.checkpoint.ranks import gather, on_rank0, this_rank
from longstraw_core.checkpoint.resolution import refuse_existing
from longstraw_core.checkpoint.rng import rng_state
from longstraw_core.checkpoint.saving import _write_checkpoint, save_checkpoint
from longstraw_core.checkpoint.sharded import gather_state
from longstraw_core.checkpoint.staged import gather_staged_state, is_staged
from longstraw_core.distributed import any_rank
from longstraw_core.process.guard import TrainingDiverged, first_non_finite, optimizer_tensors
from longstraw_core.tensors.peft_types import is_peft_model

if TYPE_CHECKING:
    from peft import PeftModel

    from longstraw_core.config import TrainSection


@dataclass
class Collected:
    """A checkpoint gathered into rank 0's host memory, not written yet (other ranks hold
    empty states). Its tensors share nothing with the live model or optimizer."""

    step: int
    model: PreTrainedModel | PeftModel  # for save_pretrained's config files
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any] | None
    rng_states: list[dict[str, Any]]
    trainer_state: str  # trainer_state.json's text


def collect(
    step: int,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    data_position: int = 0,
    extra: dict[str, Any] | None = None,
) -> Collected:
    """What ``save_checkpoint(..., step, ...)`` would write, as host copies on rank 0. Every
    rank calls it (a collective when distributed)."""
    trainer_state = trainer_state_json(step, data_position, extra or {})
    gather_whole = gather_staged_state if is_staged(model) else gather_state
    model_state, optimizer_state = gather_whole(model, optimizer)
    if model_state is None:  # one process: save_pretrained would read the model itself
        model_state = _model_tensors(model)
    live = _live_storages(model, optimizer)
    return Collected(
        step=step,
        model=model,
        model_state=_host_copies(model_state, live, {}),
        optimizer_state=_host_copies(optimizer_state, live, {}),
        scheduler_state=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        rng_states=gather(rng_state()),
        trainer_state=trainer_state,
    )


def write(
    output_dir: str | os.PathLike, collected: Collected, *, keep_last: int | None = None
) -> Path:
    """Rank 0 alone, no collective: write ``collected`` as ``save_checkpoint`` writes a
    checkpoint (``FileExistsError`` for a step saved already, or an earlier one)."""
    root = Path(output_dir)
    refuse_existing(root, collected.step)
    final = root / checkpoint_name(collected.step)
    _write_checkpoint(
        root, final, collected.step, collected.model, collected.model_state,
        collected.optimizer_state, collected.scheduler_state, collected.rng_states,
        collected.trainer_state, keep_last,
    )  # fmt: skip
    return final


class StepCheckpoints:
    """A run's checkpoints: written when due, and (``on_signal``) the last finished step's
    kept in host memory for ``write_kept``, which a stop signal calls from another thread.
    One lock orders the writes of both."""

    def __init__(
        self, output_dir: str | os.PathLike, *, keep_last: int | None, on_signal: bool
    ) -> None:
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.on_signal = on_signal
        self._kept: Collected | None = None
        self._written: dict[int, Path] = {}
        self._signalled = False  # write_kept was called: each step kept from now on is written
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, train: TrainSection) -> StepCheckpoints:
        """``train.output_dir``, ``train.keep_last`` and ``train.save_on_signal``."""
        return cls(train.output_dir, keep_last=train.keep_last, on_signal=train.save_on_signal)

    def step_done(
        self,
        step: int,
        model: PreTrainedModel | PeftModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        *,
        data_position: int,
        extra: dict[str, Any],
        write: bool,
    ) -> Path | None:
        """Every rank, after a rollout's last optimizer step. ``write``: save this step (its
        path returned on every rank); with ``on_signal`` it is collected (a collective) and
        kept either way, and written at once (on rank 0) when a stop signal came while it
        was collected. Nothing written: None. A model or optimizer state holding inf/NaN is
        never saved (``TrainingDiverged``) nor kept (the last finite step stays kept)."""
        if not (write or self.on_signal):
            return None
        bad = first_non_finite([*model.named_parameters(), *optimizer_tensors(optimizer)])
        if any_rank(bad is not None):
            if not write:
                return None
            raise TrainingDiverged(
                f"not saving step {step}: {bad or 'a tensor on another rank'} holds inf/NaN; "
                "resume from the last checkpoint with a lower optim.lr"
            )
        if not self.on_signal:
            return save_checkpoint(
                self.output_dir, step, model, optimizer, scheduler,
                data_position=data_position, extra=extra, keep_last=self.keep_last,
            )  # fmt: skip
        collected = collect(step, model, optimizer, scheduler, data_position, extra)
        with self._lock:
            self._kept = collected if this_rank() == 0 else None
            signalled = self._signalled
        if not write:  # a signal that found an older step kept: this one is the last now
            return self._write(collected) if signalled and self._kept is not None else None
        return on_rank0(lambda: self._write(collected))

    def write_kept(self) -> Path | None:
        """Write the last finished step's checkpoint now, unless it is written already (rank
        0; other ranks, or nothing kept yet: None). Safe from any thread: no collective."""
        with self._lock:
            self._signalled = True
            collected = self._kept
        return self._write(collected) if collected is not None else None

    def _write(self, collected: Collected) -> Path:
        with self._lock:
            if collected.step not in self._written:
                self._written[collected.step] = write(
                    self.output_dir, collected, keep_last=self.keep_last
                )
            return self._written[collected.step]


def _model_tensors(model: PreTrainedModel | PeftModel) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` reads of a model in one process: its state dict (a LoRA
    model: the trainable adapters only, as a sharded model's gather takes them)."""
    state = model.state_dict()
    if not is_peft_model(model):
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def _live_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages training writes into: parameters, buffers, optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return {t.untyped_storage().data_ptr() for t in local if isinstance(t, torch.Tensor)}


def _host_copies(value: Any, live: set[int], made: dict[tuple, torch.Tensor]) -> Any:
    """``value`` with every tensor on the GPU or sharing a live storage copied to the host;
    tensors that shared storage share their copy (tied weights stay tied for
    ``save_pretrained``). Gathered tensors (new host tensors) are kept as they are."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.untyped_storage().data_ptr() not in live:
            return value
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape,
               value.stride(), value.dtype, value.device)  # fmt: skip
        if key not in made:
            made[key] = value.detach().to("cpu", copy=True)
        return made[key]
    if isinstance(value, dict):
        return {k: _host_copies(v, live, made) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copies(v, live, made) for v in value)
    return copy.deepcopy(value)
