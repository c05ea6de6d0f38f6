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
Lines or CSV file (the line its record starts on) and ``<path>:row <i>``
(``<path>[<split>]:row <i>`` with splits) otherwise. When ``datasets`` cannot read a JSON Lines
file, the file is read line by line to name the first bad line (not UTF-8, not JSON, not an
object, a key given twice) instead of passing on pyarrow's message. A CSV file is read once
with Python's ``csv`` module first: pandas fills a short row with nulls and names a long one
only by a line number in its own message, so a row whose field count differs from the
header's, or a quote never closed, is refused naming its line.

``fingerprint``: a data file's (or directory's) size and sha256, which a checkpoint records
and ranks compare, so that other data at the same path is noticed.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
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
        if self.path is not None and self.lines is not None and _is_json(self.path):
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
        csv_lines = _check_csv(p) if builder == "csv" else None  # names a malformed row
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
    if json_lines:
        lines = _line_numbers(p, len(rows))
    else:
        lines = csv_lines if csv_lines is not None and len(csv_lines) == len(rows) else None
    return OpenedData(rows, str(p), lines, p)


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


def _is_json(path: Path) -> bool:
    return FILE_BUILDERS.get(path.suffix.lower()) == "json"


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
                record = json.loads(line, object_pairs_hook=_no_repeated_keys)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: invalid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except _RepeatedKey as exc:
                raise DataError(
                    f"{where}: the key {exc.key!r} appears twice in one object; keep one (a "
                    "JSON object's keys must differ, and datasets' reader refuses the file)"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not records:
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines)")
    return blank


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook that refuses a key given twice (Python keeps the last;
    pyarrow refuses the file and pandas then reports only "Trailing data")."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def _check_csv(path: Path) -> array:
    """Raise ``DataError`` naming the line of the first CSV record that is not UTF-8, whose
    quote is never closed, or whose field count differs from the header's (pandas fills a
    short row with nulls, silently); else the line each record (after the header) starts on,
    blank lines skipped as pandas skips them."""
    lines = array("q")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, strict=True)
            header: list[str] | None = None
            start = 1
            for row in reader:
                if row:
                    if header is None:
                        header = row
                    elif len(row) != len(header):
                        many = "fields" if len(row) != 1 else "field"
                        raise DataError(
                            f"{path}:{start}: {len(row)} {many}, but the header has "
                            f"{len(header)} ({', '.join(header)}); quote a value that holds a "
                            'comma ("a, b"), and give every row each column (an empty value: ,,)'
                        )
                    else:
                        lines.append(start)
                start = reader.line_num + 1
    except csv.Error as exc:
        what = (
            "a quote opened in this record is never closed"
            if "end of data" in str(exc)
            else f"not valid CSV ({exc})"
        )
        raise DataError(
            f"{path}:{start}: {what}: a quoted value ends with a quote followed by a comma or "
            'the end of the line, and a quote inside one is doubled ("")'
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"{_first_non_utf8(path)}: not valid UTF-8") from None
    return lines


def _first_non_utf8(path: Path) -> str:
    """``<path>:<line>`` of the first line that is not UTF-8 (``<path>`` if none is)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"{path}:{number}"
    return str(path)


# sha256 of the files already hashed in this process, by path, size, mtime and inode: a
# run fingerprints its data at start (ranks compare it), at resume and at each save.
_HASHED: dict[tuple[str, int, int, int], str] = {}


def fingerprint(path: str | Path) -> dict[str, Any]:
    """``{"path", "bytes", "sha256"}`` of a data file, or of a directory's files (their
    relative paths, sizes and contents, hashed in name order): what a checkpoint records and
    every rank compares, so that other data at the same path is noticed. Reads every byte
    once per process (about a second a gigabyte; far less than the scan that tokenizes it)."""
    root = Path(path).expanduser()
    if not root.exists():  # the scan names it
        return {"path": str(path), "bytes": None, "sha256": None}
    if root.is_file():
        return {"path": str(path), "bytes": root.stat().st_size, "sha256": _file_sha256(root)}
    files = sorted(p for p in root.rglob("*") if p.is_file())
    digest, size = hashlib.sha256(), 0
    for file in files:
        name = file.relative_to(root).as_posix()
        length = file.stat().st_size
        digest.update(f"{name}\0{length}\0{_file_sha256(file)}\n".encode())
        size += length
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest()}


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _HASHED:
        with path.open("rb") as f:
            _HASHED[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _HASHED[key]
