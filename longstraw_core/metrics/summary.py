"""The table a run prints when it ends, and the whole one it leaves beside the run.

A run logs some 55 metrics; printed whole, the one a TRL user looks for first (``reward``)
sits twenty rows down and an 80-column terminal folds the names mid-word. So the console
shows the headline: TRL's first metrics (``reward``, ``reward_std``, ``loss``, ``kl``,
``entropy``, the completion lengths), the step time and peak memory, and the evaluation's
accuracy, each name whole at 80 columns. Every metric, the headline first, goes to
``summary.txt`` in ``train.output_dir`` and to W&B as the table ``run_summary``
(``RunLogger.finish``)::

    stats = summary_rows(history)                 # (name, first, last, min, max, mean)
    Console().print(summary_table(stats, title, headline_only=True))
    write_summary(stats, title, output_dir)       # summary.txt
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from longstraw_core.metrics import names
from longstraw_core.metrics.curves import History, replace_atomically

SUMMARY_TXT = "summary.txt"
COLUMNS = ("first", "last", "min", "max", "mean")
# The console's rows, in this order when logged; a "{}" matches any value there (pass@k).
HEADLINE: tuple[str, ...] = (
    names.REWARD,
    names.REWARD_STD,
    names.LOSS,
    names.KL,
    names.ENTROPY,
    names.COMPLETIONS_MEAN_LENGTH,
    names.COMPLETIONS_MIN_LENGTH,
    names.COMPLETIONS_MAX_LENGTH,
    names.STEP_SECONDS,
    names.STEP_PEAK_MEMORY_BYTES,
    names.EVAL_GREEDY_ACCURACY,
    names.EVAL_PASS_AT_K,
    names.EVAL_PREFIX + names.REWARD,
)
ABSENT = "-"  # a statistic with no finite value (nothing measured)
NUMBER_CHARS = 9  # the widest cell _short writes: with the names above, 78 columns in all

Row = tuple[str, float, float, float, float, float]


def summary_rows(history: History) -> list[Row]:
    """First, last, min, max and mean of every logged metric (the finite values; NaN where
    there is none), the headline's metrics first, then the rest in first-seen order."""
    keys: list[str] = []
    for _, flat in history:
        keys += [k for k in flat if k not in keys]
    rows = []
    for key in headline_first(keys):
        values = [flat[key] for _, flat in history if key in flat]
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            low, high, mean = min(finite), max(finite), sum(finite) / len(finite)
        else:
            low = high = mean = math.nan
        rows.append((key, values[0], values[-1], low, high, mean))
    return rows


def headline_first(keys: Sequence[str]) -> list[str]:
    """``keys`` with the headline's (``HEADLINE``'s order) first, then the others."""
    first = [key for pattern in HEADLINE for key in keys if _matches(pattern, key)]
    return first + [key for key in keys if key not in first]


def is_headline(key: str) -> bool:
    return any(_matches(pattern, key) for pattern in HEADLINE)


def summary_table(rows: Sequence[Row], title: str, *, headline_only: bool = False) -> Table:
    """The rows as a table: no vertical rules and numbers of at most ``NUMBER_CHARS``
    characters, so the headline fits 80 columns with every name whole. ``headline_only``:
    the headline's rows (all rows when none of them was logged)."""
    shown = [row for row in rows if is_headline(row[0])] if headline_only else list(rows)
    table = Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True
    )
    table.add_column("metric", justify="left", no_wrap=True)
    for column in COLUMNS:
        table.add_column(column, justify="right", no_wrap=True)
    for name, *stats in shown or rows:
        table.add_row(name, *(_short(value, bytes_="bytes" in name) for value in stats))
    return table


def write_summary(rows: Sequence[Row], title: str, output_dir: Path) -> Path:
    """The whole table as plain text in ``output_dir/summary.txt``, replaced atomically."""
    buffer = io.StringIO()
    Console(file=buffer, width=10_000, color_system=None).print(summary_table(rows, title))
    text = "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")
    output_dir.mkdir(parents=True, exist_ok=True)
    return replace_atomically(
        output_dir / SUMMARY_TXT, lambda path: path.write_text(text + "\n", encoding="utf-8")
    )


def wandb_rows(rows: Sequence[Row]) -> tuple[list[str], list[list[object]]]:
    """Columns and data for W&B's table (the numbers as they are; None where not finite)."""
    data = [[name, *(v if math.isfinite(v) else None for v in stats)] for name, *stats in rows]
    return ["metric", *COLUMNS], data


def _matches(pattern: str, key: str) -> bool:
    if "{}" not in pattern:
        return key == pattern
    head, tail = pattern.split("{}", 1)
    return key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail)


def _short(value: float, *, bytes_: bool = False) -> str:
    """A number in at most ``NUMBER_CHARS`` characters: four or five significant digits
    between 1e-3 and 1e5, three with an exponent outside; a size in bytes in binary units."""
    if math.isnan(value):
        return ABSENT
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if bytes_:
        return _size(value)
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        exponent = math.floor(math.log10(abs(value)))
        digits = 3 - exponent if exponent < 0 else 4 - exponent  # 0.001234, 3.8622, 12346
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"
    return f"{value:.2e}"


def _size(num_bytes: float) -> str:
    """``748 MiB``, ``74.8 MiB``, ``3.00 GiB``: three significant digits, at most 8 chars."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{round(value)} B"
    if abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}" if abs(value) >= 10 else f"{value:.2f} {unit}"
