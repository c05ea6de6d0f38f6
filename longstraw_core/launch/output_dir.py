"""Claiming a run's ``train.output_dir`` before the model loads: writable, not in use by a
live run, and not holding another run's checkpoints.

A run finds out at its first save that it cannot write there, or that the directory belongs
to someone else: after hours of steps. ``claim`` settles all of it up front, on rank 0 (the
others wait and get the same answer), as a one-line ``ConfigError`` naming the fix:

- the directory is created and a file is created in it and removed: a path under a regular
  file, a read-only filesystem or a directory the user may not write is refused now, not at
  the save (what the save would do, so the check cannot disagree with it);
- a lock: ``fcntl.flock`` on ``<output_dir>/.longstraw.lock``, held until the process ends.
  The kernel releases it when the process dies, SIGKILL included, so a crashed run never
  leaves it stuck; a second live run into the directory is refused, naming the holder. The
  file stays (removing a lock file races with the next run taking it). The lock is on the
  file, not the path: a directory deleted and made again under the run is noticed before
  each save (``checkpoint.ownership``), which then stops the run instead of writing there;
- a new run (``train.resume_from`` unset) into a directory holding ``step-*`` checkpoints
  is refused: its saves would mix with the earlier run's, and ``train.keep_last`` would
  delete them. The fixes: ``train.resume_from=latest`` continues that run; another
  directory starts a new one. A run resuming a checkpoint of another directory may not
  write into one that holds checkpoints either;
- it says what a resume will do: start from step 0 when ``train.resume_from=latest`` finds
  no checkpoint yet, the step it continues from, and that nothing is left to train.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from longstraw_core.checkpoint import ownership
from longstraw_core.checkpoint.errors import listed
from longstraw_core.checkpoint.ranks import on_rank0, this_rank
from longstraw_core.checkpoint.resolution import resolve_checkpoint, step_entries
from longstraw_core.config import ConfigError, TrainSection
from longstraw_core.launch.resume import saved_step

LOCK_FILE = ownership.LOCK_FILE
KEY = "train.output_dir"

Problem = tuple[str, str]  # (config key, message)


def claim(train: TrainSection) -> None:
    """Make ``train.output_dir`` this run's, or raise ``ConfigError`` on every rank.

    Distributed: every rank calls it (before loading the model); rank 0 checks and holds the
    lock, and prints what the run will resume from.
    """
    problem, notes = on_rank0(lambda: _claim(train))
    if problem is not None:
        raise ConfigError(*problem)
    if this_rank() == 0:
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)


def _claim(train: TrainSection) -> tuple[Problem | None, list[str]]:
    root = Path(train.output_dir).expanduser()
    problem = _writable(root) or _lock(root)
    if problem is not None:
        return problem, []
    return _resume_plan(root, train)


def _writable(root: Path) -> Problem | None:
    """Create ``root`` and a file in it, as the first save will."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # something that is not a directory has the name
        return KEY, f"{str(root)!r} exists and is not a directory ({_what(root)})"
    except OSError as error:
        return KEY, f"cannot create {str(root)!r}: {_reason(error)}; name a writable directory"
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".write-test-", dir=root)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        return KEY, (
            f"cannot write in {str(root)!r}: {_reason(error)}; name a writable directory "
            "(checkpoints and W&B files go there)"
        )
    return None


def _what(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a symlink that leads nowhere: a loop or a missing target"
    return "a file"


def _reason(error: OSError) -> str:
    if error.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a directory"
    if error.errno == errno.ELOOP:
        return "the path holds a symlink loop"
    return error.strerror or str(error)


def _lock(root: Path) -> Problem | None:
    """Hold ``root``'s lock for the rest of this process, or name the run holding it."""
    if ownership.held(root) is not None:  # an earlier run in this process: reused
        if ownership.replaced(root) is None:
            return None
        release(root)  # that directory is gone: lock the one there now
    path = root / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        return KEY, f"cannot create the run lock {path}: {_reason(error)}"
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return KEY, f"cannot lock {path}: {_reason(error)}"
        return KEY, (
            f"{str(root)!r} is in use by another run ({_holder(path)}): wait for it to end "
            "or stop it, or give this run another train.output_dir"
        )
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(holder).encode(), 0)
    ownership.hold(root, descriptor)  # saves check that the directory is still this one
    return None


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {holder['pid']} on {holder['host']}, since {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock {path} is held"


def release(output_dir: str | os.PathLike) -> None:
    """Give up this process's lock on ``output_dir`` (a run ending inside a longer process)."""
    descriptor = ownership.release(output_dir)
    if descriptor is not None:
        os.close(descriptor)


def _resume_plan(root: Path, train: TrainSection) -> tuple[Problem | None, list[str]]:
    """Refuse a new run into a directory with checkpoints; say what a resume continues."""
    found = [path.name for path in step_entries(root)]
    resume = train.resume_from
    if resume is None:
        if found:
            return (KEY, (
                f"{str(root)!r} holds checkpoints of an earlier run ({listed(found)}): "
                "continue that run with train.resume_from=latest, or start this one in "
                "another train.output_dir"
            )), []  # fmt: skip
        return None, []
    try:
        checkpoint = resolve_checkpoint(resume, root)
    except FileNotFoundError:
        return ("train.resume_from", (
            f"{resume!r} is neither a checkpoint (a step-NNNNNN directory) nor an output "
            "directory holding a complete one; name one of those, or train.resume_from=latest"
        )), []  # fmt: skip
    if checkpoint is None:
        return None, [f"train.resume_from=latest: no checkpoint in {root} yet; starting at step 0"]
    if found and checkpoint.parent.resolve() != root.resolve():
        return (KEY, (
            f"{str(root)!r} holds checkpoints of another run ({listed(found)}), and this run "
            f"resumes {checkpoint}: write it into another (empty) train.output_dir"
        )), []  # fmt: skip
    return None, [_resuming(checkpoint, train.steps)]


def _resuming(checkpoint: Path, steps: int) -> str:
    step = saved_step(checkpoint)
    line = f"resuming {checkpoint} (step {step} of train.steps={steps})"
    if step is not None and step >= steps:
        line += "; nothing left to train: raise train.steps to train further"
    return line
