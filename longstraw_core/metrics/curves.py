"""A run's metrics beside the run, readable without W&B: every logged metric per step as
``metrics.csv`` and the learning curves (training reward, held-out accuracy) as
``curves.png``. Written when the run finishes (``RunLogger.finish``), from the history a
resumed run restores, so both cover the whole run; each file is replaced atomically.

The PNG (``tracking.curves_png``) needs matplotlib (the ``dev`` extra); without it only the
CSV is written and the returned paths say so.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from longstraw_core.metrics import names

METRICS_CSV = "metrics.csv"
CURVES_PNG = "curves.png"
# What the curves show: the training reward (a moving mean over this many steps on top of
# the raw points) beside the held-out greedy reward (the same scale: the weighted rewards),
# and on a [0, 1] panel the held-out accuracy.
REWARD_WINDOW = 10

History = Sequence[tuple[int, dict[str, float]]]


def write_run_curves(
    history: History, output_dir: Path, title: str = "", *, png: bool = True
) -> list[Path]:
    """``metrics.csv`` and (``png``, with matplotlib) ``curves.png`` in ``output_dir``; the
    paths written."""
    if not history:
        return []
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [
        replace_atomically(output_dir / METRICS_CSV, lambda path: write_metrics_csv(history, path))
    ]
    if not png:
        return written
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return written  # the CSV holds the same numbers
    written.append(
        replace_atomically(output_dir / CURVES_PNG, lambda path: plot_curves(history, path, title))
    )
    return written


def write_metrics_csv(history: History, path: Path) -> None:
    """One row per logged step, one column per metric (first-seen order); empty where a
    metric was not logged that step or was not finite."""
    columns: list[str] = []
    for _, flat in history:
        columns += [k for k in flat if k not in columns]
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["step", *columns])
        for step, flat in history:
            writer.writerow([step, *(_cell(flat.get(k)) for k in columns)])


def plot_curves(history: History, path: Path, title: str = "") -> None:
    """Training reward per step (points and a moving mean) and the eval curves, one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    steps, rewards = _series(history, names.REWARD)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(steps, rewards, ".", alpha=0.35, label="reward (each step)")
    if len(rewards) >= 2:
        axes[0].plot(steps, _moving_mean(rewards, REWARD_WINDOW), label=f"mean of {REWARD_WINDOW}")
    eval_steps, values = _series(history, names.EVAL_GREEDY_REWARD)
    if values:
        axes[0].plot(eval_steps, values, "o-", label="held-out greedy reward")
    axes[0].set(xlabel="step", ylabel="weighted reward", title="reward")
    axes[0].legend(loc="best")
    eval_steps, values = _series(history, names.EVAL_GREEDY_ACCURACY)
    if values:
        axes[1].plot(eval_steps, values, "o-", label="greedy accuracy")
        axes[1].legend(loc="best")
    axes[1].set(xlabel="step", title="held-out accuracy", ylim=(-0.02, 1.02))
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)


def _series(history: History, key: str) -> tuple[list[int], list[float]]:
    points = [(s, f[key]) for s, f in history if key in f and math.isfinite(f[key])]
    return [s for s, _ in points], [v for _, v in points]


def _moving_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _cell(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else repr(float(value))


def replace_atomically(target: Path, write) -> Path:
    """Write through a temporary file in the same directory, then rename over ``target``:
    a kill leaves the old file or the new one, never half of one."""
    handle, temporary = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".partial"
    )
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
