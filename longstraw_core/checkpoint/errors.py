"""``CheckpointError`` and the wording of its messages: every problem a checkpoint can have
is one error type that names the file, what is wrong and, where there is one, the fix."""

from __future__ import annotations

from pathlib import Path

_SHOWN = 5  # keys or files named in an error message


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, what is wrong and,
    where there is one, the fix."""


class FormatError(CheckpointError):
    """A checkpoint of another format than this LongStraw writes: refused wherever it is met
    (loading, resolving ``latest``, saving beside it), never taken for an incomplete one and
    set aside."""


def format_error(path: Path, found: object, expected: int) -> FormatError:
    """The one line a checkpoint of another format gets: the format found, the one expected,
    and what to do."""
    older = isinstance(found, int) and found < expected
    which = "the older LongStraw version" if older else "the LongStraw version"
    return FormatError(
        f"{path}: checkpoint format {found}, but this LongStraw reads format {expected} only: "
        f"start a new output_dir, or resume with {which} that wrote it"
    )


def listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown}, ... ({len(items)} in all)"


def unreadable(path: Path, error: BaseException) -> CheckpointError:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return CheckpointError(
        f"{path}: cannot be read ({type(error).__name__}: {first_line}): the file is damaged"
    )
