"""``data.path`` opened as a ``datasets.Dataset``, as a TRL script would load it, with its rows
named for errors.

- a file: ``load_dataset(<builder>, data_files=path, split=...)``, the builder from the
  extension (``FILE_BUILDERS``): JSON / JSON Lines, Parquet, CSV, Arrow;
- a directory written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` of splits):
  ``load_from_disk``;
- any other directory (a dataset repository on local disk, ``data/train-*.parquet``...):
  ``load_dataset(path, split=...)``.

Rows stay in ``datasets``' memory-mapped Arrow files, read one at a time, so a dataset much
larger than memory can be scanned and trained on. A row is named ``<file>:<line>`` in a JSON
Lines file and ``<path>:row <i>`` (``<path>[<split>]:row <i>`` with splits) otherwise. When
``datasets`` cannot read a JSON Lines file, the file is read line by line to name the first
bad line (not UTF-8, not JSON, not an object) instead of passing on pyarrow's message.
"""

from __future__ import annotations

import contextlib
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

# The file extensions data.path may have, and the ``datasets`` builder that reads each.
FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
DEFAULT_SPLIT = "train"  # what load_dataset names a data file's rows, and TRL scripts train on


class DataError(ValueError):
    """Data that cannot become samples; the message says where (file, line or row) and why."""


def path_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be ``data.path`` (None: it can), checked at config load."""
    p = Path(path).expanduser()
    if p.is_dir() or p.suffix.lower() in FILE_BUILDERS:
        return None
    return (
        f"{str(path)!r}: a data file must end in {', '.join(FILE_BUILDERS)} (the `datasets` "
        "builder is chosen by the extension), or be a directory (save_to_disk, or data files)"
    )


@dataclass
class OpenedData:
    """The rows of ``data.path`` and how to name each in a message."""

    rows: datasets.Dataset
    origin: str  # the path, with [split] for a dataset of several splits
    lines: array | None = None  # JSON Lines: the file line each row came from
    path: Path | None = None  # the data file, when there is one

    def where(self, row: int) -> str:
        if self.lines is not None:
            return f"{self.origin}:{self.lines[row]}"
        return f"{self.origin}:row {row}"

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, row)`` in order. A row that cannot be decoded (a string column holding
        bytes that are not UTF-8, which pyarrow stores without checking) raises ``DataError``
        naming it."""
        rows = iter(self.rows)
        for index in range(len(self.rows)):
            try:
                row = next(rows)
            except Exception as exc:  # decoded a batch at a time: find the row at fault
                raise self._undecodable(index, exc) from exc
            yield index, row

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self.rows[index]
        except Exception as exc:
            raise DataError(f"{self.where(index)}: cannot be read: {exc}") from exc

    def _undecodable(self, start: int, exc: Exception) -> DataError:
        if self.path is not None and self.lines is not None:
            _diagnose_json_lines(self.path)  # raises naming the line, if one is at fault
        for index in range(start, len(self.rows)):
            try:
                self.rows[index]
            except Exception as error:
                return DataError(f"{self.where(index)}: cannot be read: {error}")
        return DataError(f"{self.where(start)}: cannot be read: {exc}")


def open_data(
    path: str | Path, split: str = DEFAULT_SPLIT, *, progress: bool | None = None
) -> OpenedData:
    """The ``split`` of the dataset at ``path`` (a data file or a directory); ``DataError``
    naming the path, the line or the split when it cannot be read. ``progress``: ``datasets``'
    progress bars while it converts a file to Arrow (None: its default)."""
    import datasets  # imported when data is read: config validation does not need it

    p = Path(path).expanduser()
    with _progress_bars(progress):
        if p.is_dir():
            return _open_directory(p, split)
        if not p.is_file():
            raise FileNotFoundError(f"no data file or dataset directory at {str(p)!r}")
        builder = FILE_BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise DataError(path_problem(p) or f"{p}: unsupported file")
        if split != DEFAULT_SPLIT:  # load_dataset names a data file's rows "train"
            raise DataError(
                f"{p}: a data file is one split, {DEFAULT_SPLIT!r}; data.split={split!r} given "
                "(a dataset of several splits is a directory: save_to_disk, or data files)"
            )
        if p.stat().st_size == 0:
            raise DataError(f"{p}: no records (the file is empty or holds only blank lines)")
        json_lines = builder == "json" and not _starts_with(p, b"[")
        try:
            rows = datasets.load_dataset(builder, data_files=str(p), split=split)
        except Exception as exc:  # datasets raises many types; all mean "cannot read this"
            # JSON Lines: name the first line at fault, if one is (else datasets' reason)
            blank = _diagnose_json_lines(p) if json_lines else None
            hint = (
                f"; line {blank} is blank: remove the blank lines (datasets' JSON reader "
                "fails on them when a column holds values of several types)"
                if blank
                else ""
            )
            raise DataError(f"{_unreadable(p, builder, split, exc)}{hint}") from exc
    return OpenedData(rows, str(p), _line_numbers(p, len(rows)) if json_lines else None, p)


def _open_directory(path: Path, split: str) -> OpenedData:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError:  # not written by save_to_disk: a directory of data files
        try:
            rows = datasets.load_dataset(str(path), split=split)
        except Exception as exc:
            raise DataError(
                f"{_unreadable(path, 'a directory of data files', split, exc)} (and it is not "
                "a dataset saved with save_to_disk)"
            ) from exc
        return OpenedData(rows, f"{path}[{split}]")
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(
                f"{path}: no split {split!r}; its splits are {sorted(saved)} (set data.split)"
            )
        return OpenedData(saved[split], f"{path}[{split}]")
    if split != DEFAULT_SPLIT:
        raise DataError(
            f"{path}: a single dataset saved with save_to_disk has no splits; "
            f"data.split={split!r} given (leave it at {DEFAULT_SPLIT!r})"
        )
    return OpenedData(saved, str(path))


def _unreadable(path: Path, builder: str, split: str, exc: BaseException) -> str:
    """``datasets``' error by its root cause (the outer one says only "An error occurred")."""
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    if isinstance(exc, ValueError) and "Unknown split" in str(exc):
        return f"{path}: {exc} (set data.split)"
    detail = f"{type(root).__name__}: {root}" if str(root) else type(root).__name__
    return f"{path}: datasets could not read it ({builder}, split {split!r}): {detail}"


@contextlib.contextmanager
def _progress_bars(enabled: bool | None) -> Iterator[None]:
    """``datasets``' progress bars on or off for a while (None: as they are)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    if enabled is not None:
        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.disable_progress_bars if was_disabled else datasets.enable_progress_bars)()


def _starts_with(path: Path, char: bytes) -> bool:
    """Whether the file's first non-blank byte (after a BOM) is ``char``: ``{`` for JSON Lines,
    where a ``.json`` file may instead hold one array (rows then have no lines of their own)."""
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head[:1] == char


def _line_numbers(path: Path, rows: int) -> array | None:
    """The line of each row of a JSON Lines file: ``datasets`` skips blank lines. None if the
    count disagrees with ``datasets``' rows (then rows are named by index)."""
    lines = array("q")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                lines.append(number)
    return lines if len(lines) == rows else None


def _diagnose_json_lines(path: Path) -> int | None:
    """Raise ``DataError`` for the first line that is not a UTF-8 JSON object (a BOM is
    accepted), or for no records at all; else return the first blank line's number (None:
    there is none)."""
    blank, records = None, False
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1})"
                ) from None
            line = line.removeprefix("\ufeff") if number == 1 else line
            if not line.strip():
                blank = blank or number
                continue
            records = True
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: invalid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not records:
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines)")
    return blank
