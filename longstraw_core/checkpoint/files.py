"""A checkpoint's files: their names, the strict-JSON ``trainer_state.json``, the sha256
``manifest.json`` that makes a checkpoint complete, and the fsynced, atomic writes that put
them on disk before anything vouches for them."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from longstraw_core.checkpoint.errors import CheckpointError, format_error

FORMAT_VERSION = 2  # another (format 1: no manifest) is refused: errors.FormatError
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
INCOMPLETE = "incomplete"  # where incomplete checkpoints are set aside
STEP_PREFIX = "step-"
STEP_DIR = re.compile(rf"{STEP_PREFIX}(\d+)")
_HASH_BLOCK = 4 << 20  # bytes read at a time when hashing: big files never sit in memory whole


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def trainer_state_json(step: int, data_position: int, extra: dict[str, Any]) -> str:
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


def write_manifest(directory: Path, step: int) -> None:
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
        fsync_dir(folder)
    body = {"format_version": FORMAT_VERSION, "step": step, "files": entries}
    write_text(directory / MANIFEST, json.dumps(body, indent=2, allow_nan=False))


def read_manifest(directory: Path) -> list[dict[str, Any]]:
    """The manifest's file entries. ``FormatError`` for a checkpoint of another format (format
    1 had no manifest: its ``trainer_state.json`` says which it is)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        version = _trainer_state_version(directory)
        if version is not None and version != FORMAT_VERSION:
            raise format_error(directory, version, FORMAT_VERSION)
        raise CheckpointError(
            f"{directory}: no {MANIFEST}: the save did not finish (stopped mid-save?) or the "
            "directory was copied in part"
        )
    try:
        body = json.loads(manifest.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest}: unreadable ({error})") from None
    version = body.get("format_version") if isinstance(body, dict) else None
    if version is None:
        raise CheckpointError(f"{manifest}: malformed (no format_version)")
    if version != FORMAT_VERSION:
        raise format_error(directory, version, FORMAT_VERSION)
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


def _trainer_state_version(directory: Path) -> Any:
    """The ``format_version`` of ``directory``'s ``trainer_state.json``; None when unreadable."""
    try:
        state = json.loads((directory / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state.get("format_version") if isinstance(state, dict) else None


def check_sizes(directory: Path, entries: list[dict[str, Any]]) -> None:
    for entry in entries:
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


def verify_checksums(directory: Path, entries: list[dict[str, Any]]) -> None:
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


def read_trainer_state(directory: Path) -> dict[str, Any]:
    path = directory / TRAINER_STATE
    try:
        # Not strict: format 1 may hold a bare NaN, and must be named as format 1, not unreadable.
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    version = state.get("format_version") if isinstance(state, dict) else None
    if version != FORMAT_VERSION:
        raise format_error(directory, version, FORMAT_VERSION)
    return state


def write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write_text(tmp, text)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
