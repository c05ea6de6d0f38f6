"""Which checkpoints an output directory holds: the newest complete one (what ``"latest"``
means), incomplete ones set aside, later ones superseded by a resumed run, old ones pruned by
``keep_last``; all from what is on disk, never from the ``latest`` file alone."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from longstraw_core.checkpoint.errors import CheckpointError, FormatError, listed
from longstraw_core.checkpoint.files import (
    INCOMPLETE,
    LATEST,
    MANIFEST,
    STEP_DIR,
    STEP_PREFIX,
    TRAINER_STATE,
    check_sizes,
    checkpoint_name,
    fsync_dir,
    read_manifest,
    read_trainer_state,
    write_atomic,
)
from longstraw_core.checkpoint.ranks import on_rank0, warn


def prepare_resume(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> list[Path]:
    """Set aside ``output_dir``'s complete checkpoints later than ``checkpoint``, so that a
    run resumed from it can save those steps again (and ``latest`` means it until then).

    They move, never deleted, into ``<output_dir>/superseded-<unix time>/``; returns where
    each one now is, for the caller to print. ``checkpoint`` is what ``resolve_checkpoint``
    takes. Call it once ``load_checkpoint`` succeeded, so that a checkpoint that does not load
    sets nothing aside. Distributed: every rank calls it; rank 0 moves, the others wait and get
    the same list.
    """
    return on_rank0(lambda: _supersede_later(Path(output_dir), checkpoint))


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete ``step-*`` checkpoints directly in ``output_dir``, oldest first (sizes
    checked against each manifest, not checksums). ``FormatError`` if one has another format."""
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


def refuse_existing(root: Path, step: int) -> None:
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
        f"{root} holds checkpoints later than step {step} ({listed([p.name for p in later])}): "
        f"a run resumed from an earlier checkpoint sets them aside first: {resume}"
    )


def prune(root: Path, keep_last: int, written: Path) -> None:
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
        warn(f"keep_last={keep_last}: could not delete an old checkpoint in {root}: {error}")


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step-NNNNNN`` entries directly in ``root``, by step: directories, and anything
    else with such a name (a symlink loop, a file), which ``_problem`` finds incomplete and
    the next save sets aside rather than failing on the name."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def step_entries(root: Path) -> list[Path]:
    """What earlier saves left in ``root``: every ``step-*`` entry, complete or not, and any
    ``.tmp-step-*`` one (a save that never finished)."""
    entries = [path for _, path in _step_dirs(root)]
    return entries + (sorted(root.glob(f".tmp-{STEP_PREFIX}*")) if root.is_dir() else [])


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
        warn(
            f"skipping incomplete checkpoints in {root} (the next save sets them aside in "
            f"{INCOMPLETE}/): {'; '.join(skipped)}"
        )
    return complete[-1] if complete else None


def _problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint (the cheap check: sizes), or None.
    A checkpoint of another format raises ``FormatError``: not incomplete, never set aside."""
    if not directory.is_dir():
        if directory.is_symlink():
            return f"{directory}: a symlink that leads to no directory (a loop, or a lost target)"
        return f"{directory}: not a directory"
    try:
        check_sizes(directory, read_manifest(directory))
    except FormatError:
        raise
    except CheckpointError as error:
        return str(error)
    except OSError as error:  # moved or unreadable while we looked
        return f"{directory}: {error}"
    return None


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file()


def set_aside_incomplete(root: Path) -> None:
    """Move incomplete ``step-*`` directories and stale ``.tmp-*`` ones into ``incomplete/``."""
    for _, path in _step_dirs(root):
        problem = _problem(path)
        if problem is not None:
            warn(f"set aside {_set_aside(path, root / INCOMPLETE)}: {problem}")
    for path in sorted(root.glob(".tmp-*")):
        # A save's own name taken by anything (a symlink loop included) would stop the save.
        if path.is_dir() or path.name.startswith(f".tmp-{STEP_PREFIX}"):
            where = _set_aside(path, root / INCOMPLETE)
            warn(f"set aside {where}: a save that did not finish left it behind")


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
    step = read_trainer_state(resolved)["step"]
    later = [path for saved, path in _complete(root) if saved > step and not _same(path, resolved)]
    if not later:
        return []
    folder = _unused(root / f"superseded-{int(time.time())}")
    folder.mkdir()
    moved = []
    for path in reversed(later):  # newest first: what remains is always a consistent past
        os.replace(path, folder / path.name)
        moved.append(folder / path.name)
    fsync_dir(folder)
    fsync_dir(root)
    _point_latest(root)
    return moved[::-1]


def _point_latest(root: Path) -> None:
    """Rewrite ``latest`` to name the newest complete checkpoint (remove it when none is)."""
    complete = _complete(root)
    if complete:
        write_atomic(root / LATEST, complete[-1][1].name)
    else:
        (root / LATEST).unlink(missing_ok=True)


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def warn_of_later(resolved: Path, step: int) -> None:
    """A resumed run cannot save into a directory holding later checkpoints: say so early."""
    later = [p.name for s, p in _complete(resolved.parent) if s > step and not _same(p, resolved)]
    if later:
        warn(
            f"{resolved.parent} holds checkpoints later than the resumed step {step} "
            f"({listed(later)}); prepare_resume(output_dir, '{resolved}') sets them aside "
            "so that this run can save those steps again"
        )


def earlier_hint(directory: Path) -> str:
    """Where to resume from instead of a damaged ``directory``."""
    match = STEP_DIR.fullmatch(directory.name)
    earlier = [
        path
        for step, path in _complete(directory.parent)
        if not _same(path, directory) and (match is None or step < int(match.group(1)))
    ]
    if earlier:
        return f"resume from an earlier checkpoint: train.resume_from={earlier[-1]}"
    return f"{directory.parent} holds no earlier complete checkpoint to resume from"
