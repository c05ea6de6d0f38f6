"""Disk space for a save: the bytes a checkpoint needs, checked before the first byte is
written, and a full disk during the write reported as what it is.

Without this a full disk surfaces as whatever the writer says: torch's zip writer reports a
short write as ``unexpected pos 13056 vs 12948``, with no word of space. The previous
checkpoint is safe either way (a save writes into ``.tmp-step-N`` and renames it last); what
the user needs is the path and how many bytes to free.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from longstraw_core.checkpoint.errors import CheckpointError
from longstraw_core.state.prefix import format_bytes
from longstraw_core.tensors.peft_types import is_peft_model

# Files besides the tensors (RNG states, JSON, the manifest, safetensors headers).
_SMALL_FILES = 1 << 20
# After a write failed without an errno (torch's writer), less than this left means the disk
# filled up.
_FULL = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def bytes_needed(
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any],
) -> int:
    """About the bytes the checkpoint will take: the tensors it writes, plus small files."""
    if model_state is None:
        if is_peft_model(model):  # save_pretrained writes the adapters alone
            from peft.utils import get_peft_model_state_dict

            model_state = get_peft_model_state_dict(model)
        else:
            model_state = model.state_dict()
    return _tensor_bytes(model_state.values()) + _tensor_bytes([optimizer_state]) + _SMALL_FILES


def _tensor_bytes(values: Iterable[Any]) -> int:
    """The bytes of every tensor in ``values`` (nested dicts and lists), shared ones once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            if key not in seen:  # tied weights share one storage and are written once
                seen.add(key)
                total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def free_bytes(root: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``root``'s filesystem (None: unknown)."""
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


def check_room(root: Path, name: str, needed: int, previous: str) -> None:
    """Refuse a save that cannot fit before anything is written."""
    free = free_bytes(root)
    if free is not None and free < needed:
        raise no_space(root, name, needed, free, previous)


def disk_full(error: BaseException, root: Path) -> bool:
    """Whether a failed write failed because the disk (or the user's quota) is full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(root)
    return free is not None and free < _FULL


def no_space(
    root: Path, name: str, needed: int, free: int | None, previous: str
) -> CheckpointError:
    """The one line a full disk gets: where, how many bytes, and what is safe."""
    room = "" if free is None else f", {format_bytes(free)} free"
    return CheckpointError(
        f"no space left in {root} for {name}: it needs about {needed:,} bytes "
        f"({format_bytes(needed)}){room}; free space there (or point train.output_dir "
        f"elsewhere), then resume with train.resume_from=latest: {previous}"
    )
