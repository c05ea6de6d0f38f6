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
    <output_dir>/step-000010/manifest.json   written last: every other file of the checkpoint
                                             (recursively) with its size in bytes and sha256
    <output_dir>/latest                      the name of the newest complete checkpoint, for
                                             people and tools; never trusted on its own
    <output_dir>/.tmp-step-000012/           a save in progress
    <output_dir>/incomplete/step-000012-<unix time>/      set aside: a ``step-*`` directory
    <output_dir>/incomplete/tmp-step-000012-<unix time>/  or a ``.tmp-*`` one that a stopped
                                             save left behind
    <output_dir>/superseded-<unix time>/step-000014/      set aside by ``prepare_resume``: a
                                             checkpoint later than the one a run resumed from

Every JSON file is strict JSON (no ``NaN`` or ``Infinity``). ``manifest.json`` is
``{"format_version": 2, "step": N, "files": [{"path", "size", "sha256"}, ...]}``, paths
relative to the checkpoint and ``/``-separated.

A checkpoint is written into ``.tmp-step-NNNNNN``, ``manifest.json`` last (after every file is
hashed and fsynced), and renamed to ``step-NNNNNN`` (``os.replace`` of a directory is atomic
on POSIX); then ``latest`` is replaced the same way. A checkpoint is *complete* when its
manifest parses and every file it lists exists with the listed size (a cheap check, made when
scanning); ``load_checkpoint`` also compares every file's sha256 (``verify=True``). Resuming
from ``"latest"`` or from an output directory means the complete checkpoint with the highest
step there, whatever the ``latest`` file says, so a run stopped at any instant resumes from the
last checkpoint it finished. Incomplete ``step-*`` directories and stale ``.tmp-*`` ones are
skipped when resolving and moved into ``incomplete/`` by the next save (with a warning); nothing
found on disk is deleted except by ``keep_last``, which removes complete checkpoints beyond the
newest K (renamed to ``.deleting-step-*`` first, so a stop mid-way leaves no half checkpoint).
A complete ``step-*`` directory is never overwritten, and a step is not saved while the
directory holds a later complete one (the ``latest`` it would resolve to would be the later
one): a run resumed from an earlier checkpoint first calls ``prepare_resume``, which moves the
later ones into ``superseded-<unix time>/``. Format-1 checkpoints (no manifest) still load,
with a warning that they cannot be verified; they count as complete.

Distributed runs (``torch.distributed`` initialised): every rank calls ``save_checkpoint``,
``load_checkpoint`` and ``prepare_resume``, with the same arguments. A model sharded by FSDP2
(``DTensor`` parameters) is gathered whole onto rank 0's CPU with
``torch.distributed.checkpoint``'s ``get_model_state_dict`` / ``get_optimizer_state_dict``
(``full_state_dict``, ``cpu_offload``; a LoRA model gathers only its trainable adapters), and
every rank's RNG states are collected; rank 0 alone writes, in the layout above, so a checkpoint
of a sharded run is the same files as one of a single process and either resumes the other (the
optimizer state is stored by parameter index, as ``optimizer.state_dict()`` does). Loading, rank
0 checks the files (manifest, sizes, checksums, LoRA or full weights, key names and shapes) while
the others wait, then reads the weights and the optimizer state and ``set_model_state_dict`` /
``set_optimizer_state_dict`` broadcast them (``broadcast_from_rank0``: one whole copy in host
memory, on rank 0); each rank reads its own RNG file, so ``output_dir`` must be on a filesystem
every rank sees. Rank 0 alone moves directories. A failure on rank 0 (a checkpoint that already
exists, a full disk, a corrupt file, weights that do not match) is raised on every rank rather
than leaving the others waiting in a collective. Gathering the whole model on one host is simple
but bounded by its memory; very large full fine-tunes would want ``torch.distributed.checkpoint``'s
sharded format instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from peft import PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict
from safetensors import safe_open
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

from longstraw_core.failpoints import failpoint

FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1  # no manifest: loads, unverified
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
INCOMPLETE = "incomplete"  # where incomplete checkpoints are set aside
_STEP_DIR = re.compile(r"step-(\d+)")
_HASH_BLOCK = 4 << 20  # bytes read at a time when hashing: big files never sit in memory whole
_SHOWN = 5  # keys or files named in an error message

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, what is wrong and,
    where there is one, the fix."""


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
    *,
    keep_last: int | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and point ``latest`` at it.

    ``data_position`` is the index of the next sample to draw (``make_task_stream(start=...)``).
    ``extra`` must be JSON-serialisable with finite floats (metrics history, W&B run id, ...).
    ``keep_last``: afterwards delete the complete checkpoints beyond the newest K (None or 0:
    keep all). Returns the checkpoint directory. Raises ``FileExistsError`` if that step or a
    later one is a complete checkpoint already (see ``prepare_resume``); an incomplete one is
    set aside. Distributed: every rank calls it (a sharded model is gathered; module
    docstring) and rank 0 writes; an error on rank 0 is raised on every rank.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be None or >= 0, not {keep_last}")
    root = Path(output_dir)
    final = root / checkpoint_name(step)
    # Serialised first: an ``extra`` that is not strict JSON fails before gigabytes are written.
    trainer_state = _trainer_state_json(step, data_position, extra or {})
    _on_rank0(lambda: _refuse_existing(root, step))
    model_state, optimizer_state = _gather_state(model, optimizer)
    rng_states = _gather(_rng_state())
    _on_rank0(
        lambda: _write_checkpoint(
            root, final, step, model, model_state, optimizer_state, scheduler, rng_states,
            trainer_state, keep_last,
        )
    )  # fmt: skip
    return final


def prepare_resume(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> list[Path]:
    """Set aside ``output_dir``'s complete checkpoints later than ``checkpoint``, so that a
    run resumed from it can save those steps again (and ``latest`` means it until then).

    They move, never deleted, into ``<output_dir>/superseded-<unix time>/``; returns where
    each one now is, for the caller to print. ``checkpoint`` is what ``resolve_checkpoint``
    takes. Call it once ``load_checkpoint`` succeeded, so that a checkpoint that does not load
    sets nothing aside. Distributed: every rank calls it; rank 0 moves, the others wait and get
    the same list.
    """
    return _on_rank0(lambda: _supersede_later(Path(output_dir), checkpoint))


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete ``step-*`` checkpoints directly in ``output_dir``, oldest first (sizes
    checked against each manifest, not checksums; format-1 checkpoints count)."""
    return [path for _, path in _complete(Path(output_dir))]


def resolve_checkpoint(
    path_or_latest: str | os.PathLike, output_dir: str | os.PathLike | None = None
) -> Path | None:
    """The checkpoint directory meant by ``train.resume_from``.

    ``"latest"``: the complete checkpoint with the highest step in ``output_dir``, or None when
    there is none yet (so the same command starts a run and resumes it after a preemption).
    Otherwise a checkpoint directory itself (returned as it is: ``load_checkpoint`` checks it),
    or an output directory, meaning its newest complete checkpoint. The ``latest`` file is not
    read: a run stopped between a save and the update of that file left it behind.
    """
    if str(path_or_latest) == LATEST:
        if output_dir is None:
            raise ValueError("resume_from='latest' needs the run's output_dir")
        return _newest(Path(output_dir))
    path = Path(path_or_latest)
    if _looks_like_checkpoint(path):
        return path
    newest = _newest(path) if path.is_dir() else None
    if newest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint (no {TRAINER_STATE}) nor an output directory "
            "holding a complete checkpoint"
        )
    return newest


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
    and broadcast (module docstring), and each rank restores its own RNG states.
    """
    resolved = resolve_checkpoint(path, output_dir)
    if resolved is None:
        raise FileNotFoundError(f"no complete checkpoint in {output_dir}")
    _on_rank0(lambda: _check_before_loading(resolved, model, scheduler, verify))
    state = _read_trainer_state(resolved)
    rng = _torch_load(_own_rng_file(resolved), resolved) if restore_rng else None
    _load_state(resolved, model, optimizer, scheduler)
    if rng is not None:
        _set_rng_state(rng)
    if _rank() == 0:
        _warn_of_later(resolved, state["step"])
    return ResumeInfo(resolved, state["step"], state["data_position"], state["extra"])


# --------------------------------------------------------------------------- saving


def _trainer_state_json(step: int, data_position: int, extra: dict[str, Any]) -> str:
    _require_finite(extra, "extra")
    state = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "data_position": data_position,
        "extra": extra,
    }
    return json.dumps(state, indent=2, allow_nan=False)


def _require_finite(value: Any, where: str) -> None:
    """Refuse NaN and infinities anywhere in ``value``: strict JSON parsers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"{where} is {value}: checkpoint JSON is strict (no NaN or Infinity); "
            "store None or a finite number instead"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _require_finite(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _require_finite(item, f"{where}[{index}]")


def _refuse_existing(root: Path, step: int) -> None:
    """Raise when ``step`` or a later step is a complete checkpoint in ``root``: the first is
    never overwritten, the second would stay what ``latest`` resolves to."""
    later = [path for saved, path in _complete(root) if saved >= step]
    if not later:
        return
    resume = "prepare_resume(output_dir, resumed_checkpoint)"
    if later[0].name == checkpoint_name(step):
        raise FileExistsError(
            f"checkpoint {later[0]} already exists; refusing to overwrite it (a run resumed "
            f"from an earlier checkpoint sets the later ones aside first: {resume})"
        )
    raise FileExistsError(
        f"{root} holds checkpoints later than step {step} ({_listed([p.name for p in later])}): "
        f"a run resumed from an earlier checkpoint sets them aside first: {resume}"
    )


def _write_checkpoint(
    root: Path,
    final: Path,
    step: int,
    model: PreTrainedModel | PeftModel,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    rng_states: list[dict[str, Any]],
    trainer_state: str,
    keep_last: int | None,
) -> None:
    """Rank 0's part: every file into a temporary directory, the manifest last, renamed into
    place when done; then ``latest`` and the pruning."""
    # failpoint(...): where the fault-injection tests kill the process (a no-op otherwise).
    failpoint("checkpoint.start", step)
    root.mkdir(parents=True, exist_ok=True)
    _set_aside_incomplete(root)  # includes an incomplete ``final`` and a stale ``.tmp-*``
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    try:
        _save_state(tmp, model, model_state, optimizer_state, scheduler)
        failpoint("checkpoint.model_written", step)
        for rank, state in enumerate(rng_states):
            torch.save(state, tmp / _rng_file(rank))
        _write_text(tmp / TRAINER_STATE, trainer_state)
        failpoint("checkpoint.files_written", step)
        _write_manifest(tmp, step)
        failpoint("checkpoint.manifest_written", step)
        _fsync_dir(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this save's own files, never found ones
        raise
    failpoint("checkpoint.renamed", step)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)
    failpoint("checkpoint.latest_written", step)
    if keep_last:
        _prune(root, keep_last, final)


def _write_manifest(directory: Path, step: int) -> None:
    """List every file under ``directory`` with its size and sha256 (each fsynced on the way:
    the manifest must not reach the disk before the files it vouches for)."""
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    entries = [
        {
            "path": path.relative_to(directory).as_posix(),
            "size": path.stat().st_size,
            "sha256": _sha256(path, sync=True),
        }
        for path in files
    ]
    for folder in {path.parent for path in files} - {directory}:
        _fsync_dir(folder)
    body = {"format_version": FORMAT_VERSION, "step": step, "files": entries}
    _write_text(directory / MANIFEST, json.dumps(body, indent=2, allow_nan=False))


def _prune(root: Path, keep_last: int, written: Path) -> None:
    """Delete the complete checkpoints beyond the newest ``keep_last`` (never ``written``).

    Each is renamed to ``.deleting-*`` first so a stop mid-way leaves no half checkpoint; such
    leftovers of an earlier prune are removed first. A failure only warns: the new checkpoint
    is safe.
    """
    doomed = [path for _, path in _complete(root)[:-keep_last] if path.name != written.name]
    try:
        for leftover in sorted(root.glob(".deleting-*")):
            shutil.rmtree(leftover)
        for path in doomed:
            trash = root / f".deleting-{path.name}"
            os.replace(path, trash)
            shutil.rmtree(trash)
    except OSError as error:
        _warn(f"keep_last={keep_last}: could not delete an old checkpoint in {root}: {error}")


# --------------------------------------------------------------------------- scanning


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step-NNNNNN`` directories directly in ``root``, by step."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _complete(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in _step_dirs(root) if _problem(path) is None]


def _newest(root: Path) -> Path | None:
    """The complete checkpoint with the highest step in ``root``; skipped ones are warned of."""
    complete, skipped = [], []
    for _, path in _step_dirs(root):
        problem = _problem(path)
        if problem is None:
            complete.append(path)
        else:
            skipped.append(problem)
    if skipped:
        _warn(
            f"skipping incomplete checkpoints in {root} (the next save sets them aside in "
            f"{INCOMPLETE}/): {'; '.join(skipped)}"
        )
    return complete[-1] if complete else None


def _problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint (the cheap check: sizes), or None."""
    try:
        _check_sizes(directory, _read_manifest(directory))
    except CheckpointError as error:
        return str(error)
    except OSError as error:  # moved or unreadable while we looked
        return f"{directory}: {error}"
    return None


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file()


def _set_aside_incomplete(root: Path) -> None:
    """Move incomplete ``step-*`` directories and stale ``.tmp-*`` ones into ``incomplete/``."""
    for _, path in _step_dirs(root):
        problem = _problem(path)
        if problem is not None:
            _warn(f"set aside {_set_aside(path, root / INCOMPLETE)}: {problem}")
    for path in sorted(root.glob(".tmp-*")):
        if path.is_dir():
            where = _set_aside(path, root / INCOMPLETE)
            _warn(f"set aside {where}: a save that did not finish left it behind")


def _set_aside(path: Path, folder: Path) -> Path:
    """Move ``path`` into ``folder`` as ``<name>-<unix time>`` (no leading dot); its new path."""
    folder.mkdir(exist_ok=True)
    target = _unused(folder / f"{path.name.lstrip('.')}-{int(time.time())}")
    os.replace(path, target)
    return target


def _unused(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``, ... : the first that does not exist."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def _supersede_later(root: Path, checkpoint: str | os.PathLike) -> list[Path]:
    """Rank 0's part of ``prepare_resume``."""
    resolved = resolve_checkpoint(checkpoint, root)
    if resolved is None:
        return []
    problem = _problem(resolved)
    if problem is not None:
        raise CheckpointError(f"cannot resume from {resolved}: {problem}")
    step = _read_trainer_state(resolved)["step"]
    later = [path for saved, path in _complete(root) if saved > step and not _same(path, resolved)]
    if not later:
        return []
    folder = _unused(root / f"superseded-{int(time.time())}")
    folder.mkdir()
    moved = []
    for path in reversed(later):  # newest first: what remains is always a consistent past
        os.replace(path, folder / path.name)
        moved.append(folder / path.name)
    _fsync_dir(folder)
    _fsync_dir(root)
    _point_latest(root)
    return moved[::-1]


def _point_latest(root: Path) -> None:
    """Rewrite ``latest`` to name the newest complete checkpoint (remove it when none is)."""
    complete = _complete(root)
    if complete:
        _write_atomic(root / LATEST, complete[-1][1].name)
    else:
        (root / LATEST).unlink(missing_ok=True)


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _warn_of_later(resolved: Path, step: int) -> None:
    """A resumed run cannot save into a directory holding later checkpoints: say so early."""
    later = [p.name for s, p in _complete(resolved.parent) if s > step and not _same(p, resolved)]
    if later:
        _warn(
            f"{resolved.parent} holds checkpoints later than the resumed step {step} "
            f"({_listed(later)}); prepare_resume(output_dir, '{resolved}') sets them aside "
            "so that this run can save those steps again"
        )


def _earlier_hint(directory: Path) -> str:
    """Where to resume from instead of a damaged ``directory``."""
    match = _STEP_DIR.fullmatch(directory.name)
    earlier = [
        path
        for step, path in _complete(directory.parent)
        if not _same(path, directory) and (match is None or step < int(match.group(1)))
    ]
    if earlier:
        return f"resume from an earlier checkpoint: train.resume_from={earlier[-1]}"
    return f"{directory.parent} holds no earlier complete checkpoint to resume from"


# --------------------------------------------------------------------------- manifest


def _read_manifest(directory: Path) -> list[dict[str, Any]] | None:
    """The manifest's file entries; None for a format-1 checkpoint (it has none)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if _legacy(directory):
            return None
        raise CheckpointError(
            f"{directory}: no {MANIFEST}: the save did not finish (stopped mid-save?) or the "
            "directory was copied in part"
        )
    try:
        body = json.loads(manifest.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest}: unreadable ({error})") from None
    if not isinstance(body, dict) or body.get("format_version") != FORMAT_VERSION:
        version = body.get("format_version") if isinstance(body, dict) else None
        raise CheckpointError(f"{manifest}: format {version} is not {FORMAT_VERSION}")
    entries = body.get("files")
    if not isinstance(entries, list) or not all(_valid_entry(e) for e in entries):
        raise CheckpointError(f"{manifest}: malformed file list")
    return entries


def _valid_entry(entry: Any) -> bool:
    """A manifest entry this module could have written (and no path leaving the directory)."""
    if not isinstance(entry, dict):
        return False
    path, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
    return (
        isinstance(path, str)
        and not Path(path).is_absolute()
        and ".." not in Path(path).parts
        and isinstance(size, int)
        and isinstance(digest, str)
    )


def _legacy(directory: Path) -> bool:
    """Whether ``directory`` is a format-1 checkpoint: complete by construction, no manifest."""
    try:
        state = json.loads((directory / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("format_version") == LEGACY_FORMAT_VERSION


def _check_sizes(directory: Path, entries: list[dict[str, Any]] | None) -> None:
    for entry in entries or []:
        path = directory / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the manifest lists it)")
        size = path.stat().st_size
        if size < entry["size"]:
            raise CheckpointError(
                f"{path}: truncated: {size} bytes, the manifest says {entry['size']}"
            )
        if size != entry["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the manifest says {entry['size']}: changed after the save"
            )


def _verify_checksums(directory: Path, entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        path = directory / entry["path"]
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the manifest: the file is corrupt")


def _sha256(path: Path, sync: bool = False) -> str:
    """The file's sha256, read in blocks; ``sync``: also flush it to disk (fsync)."""
    digest = hashlib.sha256()
    block = bytearray(_HASH_BLOCK)
    view = memoryview(block)
    with open(path, "rb") as f:
        while count := f.readinto(block):
            digest.update(view[:count])
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


# --------------------------------------------------------------------------- checks before loading


def _check_before_loading(
    directory: Path,
    model: PreTrainedModel | PeftModel,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    verify: bool,
) -> None:
    """Rank 0's checks, cheapest first, all before a tensor is read into the model."""
    try:
        entries = _read_manifest(directory)
        _check_sizes(directory, entries)
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {_earlier_hint(directory)}") from None
    if entries is None:
        legacy = f"format-{LEGACY_FORMAT_VERSION} checkpoint (no {MANIFEST})"
        _warn(f"{directory} is a {legacy}: its files cannot be verified")
    _check_kind(directory, model)
    if scheduler is not None and not (directory / "scheduler.pt").is_file():
        raise CheckpointError(
            f"{directory} holds no scheduler state (scheduler.pt) but this run has a learning "
            "rate scheduler: resume with the scheduler settings of the run that saved it"
        )
    if verify and entries:
        try:
            _verify_checksums(directory, entries)
        except CheckpointError as error:
            raise CheckpointError(f"{error}; {_earlier_hint(directory)}") from None
    if isinstance(model, PeftModel):
        _check_adapter_shapes(directory, model)
    else:
        _check_weight_shapes(directory, model)


def _check_kind(directory: Path, model: PreTrainedModel | PeftModel) -> None:
    """LoRA adapters into a LoRA model, full weights into a full one."""
    saved = directory / "model"
    lora = (saved / "adapter_config.json").is_file()
    full = bool(_weight_files(saved))
    if isinstance(model, PeftModel) and not lora:
        if full:
            raise CheckpointError(
                f"{directory} holds full model weights (model/{_weight_files(saved)[0]}) but "
                "this run trains LoRA adapters: set lora.enabled=false with the same model, "
                "or resume from a LoRA checkpoint"
            )
        raise CheckpointError(f"{directory} holds no LoRA adapters (model/adapter_config.json)")
    if not isinstance(model, PeftModel) and not full:
        if lora:
            raise CheckpointError(
                f"{directory} holds LoRA adapters (adapter_config.json) but this run trains "
                "full weights: set lora.enabled=true with the same lora settings, or resume "
                "from a full-weights checkpoint"
            )
        raise CheckpointError(f"{directory} holds no model weights (model/model.safetensors)")


def _weight_files(directory: Path) -> list[str]:
    """The safetensors files of ``save_pretrained`` full weights in ``directory`` (or [])."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: unreadable ({error})") from None
    return ["model.safetensors"] if (directory / "model.safetensors").is_file() else []


def _check_weight_shapes(directory: Path, model: PreTrainedModel) -> None:
    """Key names and shapes from the safetensors headers, before any tensor is read."""
    saved_dir = directory / "model"
    files = _weight_files(saved_dir)
    saved: dict[str, tuple[int, ...]] = {}
    for name in files:
        saved |= _header_shapes(saved_dir / name)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    missing = _untied_missing(model, sorted(set(expected) - set(saved)), set(saved))
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
    saved = _header_shapes(file)
    expected = {
        _saved_adapter_name(name, model): tuple(param.shape)
        for name, param in model.named_parameters()
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
        parts.append(f"missing {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {_listed(unexpected)}")
    if shapes:
        parts.append(f"different shapes: {_listed(shapes)}")
    return "; ".join(parts)


def _untied_missing(model: torch.nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """``missing`` less the tied copies save_pretrained drops (lm_head tied to the embeddings):
    a parameter sharing storage with a loaded one."""
    params = dict(model.named_parameters(remove_duplicate=False))
    storage = {_storage(params[k]) for k in loaded if k in params}
    return [k for k in missing if k not in params or _storage(params[k]) not in storage]


def _storage(param: torch.Tensor) -> int:
    return id(param) if isinstance(param, DTensor) else param.data_ptr()


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors header (no tensor data is read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as error:  # SafetensorError, OSError
        raise _unreadable(path, error) from error


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown}, ... ({len(items)} in all)"


# --------------------------------------------------------------------------- reading files


def _read_trainer_state(directory: Path) -> dict[str, Any]:
    path = directory / TRAINER_STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))  # format 1 may hold bare NaN
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    version = state.get("format_version") if isinstance(state, dict) else None
    if version not in (LEGACY_FORMAT_VERSION, FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: checkpoint format {version} is not {FORMAT_VERSION} "
            f"(nor {LEGACY_FORMAT_VERSION}, which still loads)"
        )
    return state


def _torch_load(path: Path, directory: Path) -> Any:
    """``torch.load(weights_only=True)``; a file it cannot read is a ``CheckpointError``."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # OSError (truncated zip), RuntimeError, UnpicklingError
        raise CheckpointError(f"{_unreadable(path, error)}; {_earlier_hint(directory)}") from error


def _unreadable(path: Path, error: BaseException) -> CheckpointError:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return CheckpointError(
        f"{path}: cannot be read ({type(error).__name__}: {first_line}): the file is damaged"
    )


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``save_pretrained`` safetensors: one file or an index of shards."""
    weights: dict[str, torch.Tensor] = {}
    for name in _weight_files(directory):
        try:
            weights |= load_file(directory / name)
        except Exception as error:  # SafetensorError, OSError
            raise _unreadable(directory / name, error) from error
    return weights


def _read_adapters(directory: Path) -> dict[str, torch.Tensor]:
    """The saved adapters, as PEFT stores them (without the adapter's name)."""
    try:
        return load_peft_weights(str(directory), device="cpu")
    except Exception as error:  # SafetensorError, OSError, a hub lookup of a local path
        raise _unreadable(directory, error) from error


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
    """Every file is read (and checked) before the first object changes."""
    scheduler_state = None
    if scheduler is not None:
        scheduler_state = _torch_load(directory / "scheduler.pt", directory)
    if _is_sharded(model):
        _load_sharded(directory, model, optimizer)
    else:
        lora = isinstance(model, PeftModel)
        weights = (_read_adapters if lora else _read_weights)(directory / "model")
        optimizer_state = None
        if optimizer is not None:
            optimizer_state = _torch_load(directory / "optimizer.pt", directory)
            _check_optimizer_state(directory / "optimizer.pt", optimizer_state, optimizer)
        if lora:
            _load_adapters(directory / "model", model, weights)
        else:
            _load_weights(directory / "model", model, weights)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)


def _check_optimizer_state(path: Path, state: Any, optimizer: torch.optim.Optimizer) -> None:
    """The saved state has this optimizer's groups and parameter counts."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{path}: not an optimizer state_dict")
    saved = [len(group["params"]) for group in groups]
    built = [len(group["params"]) for group in optimizer.param_groups]
    if saved != built:
        raise CheckpointError(
            f"{path}: the optimizer state has parameter groups of {saved} parameters; this "
            f"optimizer has {built}: resume with the trainable parameters and optimizer "
            "settings of the run that saved it"
        )


def _load_adapters(directory: Path, model: PeftModel, saved: dict[str, torch.Tensor]) -> None:
    result = set_peft_model_state_dict(model, saved)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{directory}: the adapters do not match the model (missing {_listed(missing)}; "
            f"unexpected {_listed(result.unexpected_keys)})"
        )


def _load_weights(
    directory: Path, model: PreTrainedModel, weights: dict[str, torch.Tensor]
) -> None:
    """Load ``save_pretrained`` tensors in place (names and shapes were checked before)."""
    result = model.load_state_dict(weights, strict=False)
    # save_pretrained drops tied copies (lm_head tied to the embeddings): missing is fine for
    # a parameter that shares storage with a loaded one, an error for anything else.
    untied = _untied_missing(model, list(result.missing_keys), set(weights))
    if untied or result.unexpected_keys:
        raise CheckpointError(
            f"{directory}: the weights do not match the model (missing {_listed(untied)}; "
            f"unexpected {_listed(result.unexpected_keys)})"
        )


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
                path = directory / "optimizer.pt"
                saved = _torch_load(path, directory)
                _check_optimizer_state(path, saved, optimizer)
                optimizer_state = _optimizer_state_by_name(saved, model, optimizer)
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
    saved = _read_adapters(directory)
    names = [name for name, _ in model.named_parameters() if "lora_" in name]
    stored = {name: _saved_adapter_name(name, model) for name in names}
    missing = [name for name in names if stored[name] not in saved]
    unexpected = sorted(set(saved) - set(stored.values()))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: the adapters do not match the model (missing {_listed(missing)}; "
            f"unexpected {_listed(unexpected)})"
        )
    return {name: saved[stored[name]] for name in names}


def _saved_adapter_name(name: str, model: PeftModel) -> str:
    """The key PEFT stores parameter ``name`` under: without the adapter's name."""
    return name.replace(f".{model.active_adapter}", "")


def _full_weights(directory: Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The saved weights, checked against the model's keys (a tied copy may be missing)."""
    weights = _read_weights(directory)
    expected = set(model.state_dict())
    untied = _untied_missing(model, sorted(expected - set(weights)), set(weights))
    unexpected = sorted(set(weights) - expected)
    if untied or unexpected:
        raise CheckpointError(
            f"{directory}: the weights do not match the model (missing {_listed(untied)}; "
            f"unexpected {_listed(unexpected)})"
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
    names = _optimizer_names(model, optimizer)  # counts checked by _check_optimizer_state
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


def _on_rank0(action: Callable[[], T]) -> T:
    """``action()`` on rank 0 alone while the others wait; its error is raised on every
    rank and its (picklable) result returned on every rank."""
    result, error = None, None
    if _rank() == 0:
        try:
            result = action()
        except BaseException as caught:  # re-raised by _agree, on every rank
            error = caught
    _agree(error)
    if _distributed():
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result  # type: ignore[return-value]


def _warn(message: str) -> None:
    """A warning from rank 0 only: the ranks see the same files."""
    if _rank() == 0:
        warnings.warn(message, stacklevel=3)


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
