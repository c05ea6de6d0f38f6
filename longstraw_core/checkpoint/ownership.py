"""Whether ``train.output_dir`` is still the directory this run claimed.

The run lock (``output_dir.claim``) is an ``fcntl.flock`` on ``<output_dir>/.longstraw.lock``:
it locks that file, not the path. A directory deleted (or moved) and made again under a live
run holds a new lock file, so a second run takes it and starts in it; the first run's next
save would then recreate or fill that directory (a checkpoint of another run, a
``FileExistsError`` on the step the other saved). So the claim keeps its lock file open here,
and every save (the step's, a stop signal's), and the run's last files, first ask
``require_ours``: the file at ``<output_dir>/.longstraw.lock`` must be the very file this
process holds open. An open file's inode cannot be reused, so this holds even where the
filesystem hands the new directory the old one's inode number.
"""

from __future__ import annotations

import os
from pathlib import Path

from longstraw_core.checkpoint.errors import CheckpointError

LOCK_FILE = ".longstraw.lock"
# Output directories this process holds the lock of (by absolute path, as the run names it):
# the open file keeps the lock, so it stays open until the process ends or ``release``.
_HELD: dict[str, int] = {}


def _path_key(root: str | os.PathLike) -> str:
    return os.path.abspath(os.path.expanduser(root))


def hold(root: str | os.PathLike, descriptor: int) -> None:
    """Remember ``descriptor`` (the locked ``.longstraw.lock``) as ``root``'s claim."""
    _HELD[_path_key(root)] = descriptor


def held(root: str | os.PathLike) -> int | None:
    return _HELD.get(_path_key(root))


def release(root: str | os.PathLike) -> int | None:
    """Forget ``root``'s claim; its descriptor (the caller closes it), or None."""
    return _HELD.pop(_path_key(root), None)


def replaced(root: str | os.PathLike) -> str | None:
    """Why ``root`` is no longer the directory this process claimed, or None (it is, or this
    process never claimed it: a bare ``save_checkpoint``)."""
    descriptor = held(root)
    if descriptor is None:
        return None
    mine = os.fstat(descriptor)
    try:
        there = os.stat(Path(root).expanduser() / LOCK_FILE)
    except FileNotFoundError:
        gone = mine.st_nlink == 0 or not Path(root).expanduser().is_dir()
        return "it was deleted or moved" if gone else "its lock file was removed"
    except OSError as error:
        return f"its lock file cannot be read ({error.strerror or error})"
    if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
        return "it was deleted or moved and made again (another run may be using it)"
    return None


def require_ours(root: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` (one line) when ``root`` was replaced under this run."""
    why = replaced(root)
    if why is not None:
        raise CheckpointError(
            f"train.output_dir {_path_key(root)} is not the directory this run started in: "
            f"{why}; this run writes nothing more there, so as not to mix with another run's "
            "files; resume from its checkpoints where they went, or start it again in a "
            "train.output_dir no other run uses"
        )
