"""Run logging: W&B through accelerate's tracker, a one-line summary per step, a final table.

accelerate owns the tracker so that only the main process logs and a multi-node run needs
no extra code; ``RunLogger`` adds what a GRPO run wants on top: nested metrics flattened to
``a/b`` keys, a table of sample completions every N steps, a readable line per step and a
summary table at the end (``run_summary``: the headline on the console, every metric in
``summary.txt`` and W&B's ``run_summary``). With tracking off (``tracking.wandb=false`` or
``mode=disabled``) everything but the W&B calls still happens::

    accelerator = Accelerator(log_with=log_with(cfg.tracking))
    logger = RunLogger.from_config(accelerator, cfg)
    logger.log(step, {"reward": 0.5, "loss": 0.01, "time": {"prefill": 12.0}})
    logger.log_completions(step, completion_rows(scored, result.advantages, sample=sample.id))
    logger.finish()

The recipes' metric names are listed in ``longstraw_core.metrics.names``: TRL's where it has one
(``reward``, ``reward_std``, ``rewards/<func>/mean``, ``kl``, ``entropy``,
``clip_ratio/low_mean``, ``completions/mean_length``, ``num_tokens``, ``loss``,
``grad_norm``, ``learning_rate``; ``eval/...`` for the evaluation) and LongStraw's own:
``time/<phase>`` seconds (``progress.StepProgress``), ``grpo_step``'s (``peak_memory_bytes``,
``sweep_seconds``, ...), ``rollout_tokens_per_second``, ``step_peak_memory_bytes`` and
``state_bytes/<layer type>`` (``PrefixState.summary``). ``metrics.RUNNING_TOTALS``
(``num_tokens``) are logged as running sums of what each step reports. The per-step line
shows ``metrics.STEP_LINE``.

W&B records them under TRL's names (``tracking.trl_names``, ``wandb_metrics``): what
transformers' W&B callback makes of a TRL run's logs, ``train/reward``, ``train/loss``, ...,
``eval/reward`` for ``eval_reward``, with ``train/global_step`` as the x-axis, so a TRL
run's panels show a LongStraw run. The console, ``metrics.csv``, checkpoints' history and
``summary.txt`` keep the bare names.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text
from tqdm.auto import tqdm

from longstraw_core.checkpoint import ownership
from longstraw_core.config import RunConfig, TrackingSection, to_dict
from longstraw_core.metrics import names
from longstraw_core.metrics import summary as run_summary
from longstraw_core.metrics.curves import write_run_curves
from longstraw_core.state.prefix import format_bytes

if TYPE_CHECKING:
    from accelerate import Accelerator

    from longstraw_core.data.tasks import Sample
    from longstraw_core.rewards import RewardResult

# Shown in the per-step line when present, in this order: (key, label, format).
SUMMARY_KEYS: tuple[tuple[str, str, str], ...] = names.STEP_LINE
MAX_CELL_CHARS = 4000  # a million-token prompt must not become a million-character W&B cell
ABSENT = "-"  # how a NaN metric (nothing measured that step) is shown on the console
TRAIN_PREFIX = "train/"  # transformers' W&B callback: a training metric's W&B name
GLOBAL_STEP = "train/global_step"  # and the x-axis it defines for every metric
# A dataset's reference-answer columns, shown in the completions table under their own names
# (TRL's examples read ``solution``; verl-style data ``ground_truth``).
ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "reference", "target")


def wandb_metrics(step: int, flat: Mapping[str, float], *, trl_names: bool) -> dict[str, float]:
    """A step's metrics by the names W&B records them under (``tracking.trl_names``).

    TRL's: what transformers' W&B callback makes of ``Trainer.log`` (``rewrite_logs``):
    ``eval_<name>`` becomes ``eval/<name>`` (LongStraw's ``eval/`` names already are), every
    other name gets ``train/`` (``train/reward``, ``train/rewards/<func>/mean``,
    ``train/time/step``), and each row carries ``train/global_step``, the step (TRL's
    x-axis). Otherwise the names as they are."""
    if not trl_names:
        return dict(flat)
    out = {
        name if name.startswith(names.EVAL_PREFIX) else f"{TRAIN_PREFIX}{name}": value
        for name, value in flat.items()
    }
    out[GLOBAL_STEP] = float(step)
    return out


def log_with(tracking: TrackingSection) -> list[str] | None:
    """The ``Accelerator(log_with=...)`` argument for a tracking config."""
    return ["wandb"] if wandb_enabled(tracking) else None


def wandb_enabled(tracking: TrackingSection) -> bool:
    return tracking.wandb and tracking.mode != "disabled"


class RunLogger:
    """Metrics to W&B (when enabled) and to the console, for one run.

    ``accelerator`` must have been built with ``log_with=["wandb"]`` when ``wandb`` is on.
    ``config``: the resolved run config (nested dict), stored as the W&B run config.
    ``run_id``: a W&B run id to continue (kept in the checkpoint's ``extra`` on resume).
    ``write``: where summary lines go (default: above tqdm bars).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        output_dir: str | Path,
        project: str = "longstraw",
        run_name: str | None = None,
        mode: str = "offline",
        wandb: bool = True,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        log_every: int = 1,
        completions_every: int = 0,
        run_id: str | None = None,
        write: Callable[[str], None] | None = None,
        curves_png: bool = False,
        trl_names: bool = True,
    ) -> None:
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.wandb = wandb and mode != "disabled"
        self.mode = mode
        self.run_name = run_name
        self.curves_png = curves_png
        self.trl_names = trl_names
        self.total_steps = total_steps
        self.log_every = log_every
        self.completions_every = completions_every
        self.history: list[tuple[int, dict[str, float]]] = []
        self.totals: dict[str, float] = {}  # metrics.RUNNING_TOTALS so far
        self._write = write or tqdm.write
        self.is_main = accelerator.is_main_process
        if self.wandb:
            self._init_wandb(project, run_name, mode, dict(config or {}), run_id)

    @classmethod
    def from_config(cls, accelerator: Accelerator, cfg: RunConfig, **kwargs: Any) -> RunLogger:
        """A logger with every setting taken from the run config."""
        t = cfg.tracking
        settings: dict[str, Any] = {
            "output_dir": cfg.train.output_dir,
            "project": t.project,
            "run_name": t.run_name,
            "mode": t.mode,
            "wandb": t.wandb,
            "config": to_dict(cfg),
            "total_steps": cfg.train.steps,
            "log_every": cfg.train.log_every,
            "completions_every": cfg.train.completions_every,
            "curves_png": t.curves_png,
            "trl_names": t.trl_names,
        }
        return cls(accelerator, **(settings | kwargs))

    def _init_wandb(
        self, project: str, run_name: str | None, mode: str, config: dict, run_id: str | None
    ) -> None:
        if "wandb" not in [str(getattr(t, "value", t)) for t in self.accelerator.log_with]:
            raise ValueError(
                "W&B tracking is on but the Accelerator was built without it; build it with "
                "Accelerator(log_with=log_with(cfg.tracking))"
            )
        import wandb  # only when W&B is on (accelerate imports it then too)

        self.output_dir.mkdir(parents=True, exist_ok=True)
        # quiet: no W&B history and summary block at the end, above our own summary table
        # (finish prints the one line of it that matters offline: how to upload the run).
        init = {
            "mode": mode,
            "name": run_name,
            "dir": str(self.output_dir),
            "settings": wandb.Settings(quiet=True),
        }
        if run_id is not None:
            init |= {"id": run_id, "resume": "allow"}
        self.accelerator.init_trackers(project, config=config, init_kwargs={"wandb": init})
        run = self.wandb_run
        if self.trl_names and run is not None:  # TRL's x-axis, as transformers' WandbCallback
            run.define_metric(GLOBAL_STEP)
            run.define_metric("*", step_metric=GLOBAL_STEP, step_sync=True)

    # ----------------------------------------------------------------------- W&B run

    @property
    def wandb_run(self) -> Any | None:
        """The ``wandb.Run`` on the main process, else None."""
        if not (self.wandb and self.is_main):
            return None
        return self.accelerator.get_tracker("wandb", unwrap=True)

    @property
    def run_dir(self) -> Path | None:
        """Where W&B writes this run's files (``<output_dir>/wandb/<run>``), or None."""
        run = self.wandb_run
        return Path(run.dir).parent if run is not None else None

    @property
    def run_id(self) -> str | None:
        run = self.wandb_run
        return run.id if run is not None else None

    # ----------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's ``extra`` keeps so a resumed run reports the whole run:
        the metrics history (for the final table) and the W&B run id (to continue it)."""
        # Strict JSON (no bare NaN tokens): a non-finite metric is stored as null.
        history = [
            [step, {k: _json_number(v) for k, v in flat.items()}] for step, flat in self.history
        ]
        return {"history": history, "run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the history (and the running totals it ends with); pass
        ``state["run_id"]`` as ``run_id`` when building."""
        self.history = [
            (int(step), {k: math.nan if v is None else v for k, v in flat.items()})
            for step, flat in state.get("history", [])
        ]
        self.totals = {}
        for _, flat in self.history:
            self.totals |= {k: flat[k] for k in names.RUNNING_TOTALS if k in flat}

    # ----------------------------------------------------------------------- logging

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Flatten and log one step's metrics; print a summary line every ``log_every``."""
        flat = flatten_metrics(metrics)
        for key in names.RUNNING_TOTALS:  # this step's count -> the run's total so far
            if key in flat:
                flat[key] = self.totals[key] = self.totals.get(key, 0.0) + flat[key]
        self.history.append((step, flat))
        if self.wandb:
            self.accelerator.log(wandb_metrics(step, flat, trl_names=self.trl_names), step=step)
        if self.is_main and self.log_every and step % self.log_every == 0:
            self._write(render(self.summary_line(step, flat)))
        return flat

    def log_completions(self, step: int, rows: Sequence[Mapping[str, Any]]) -> bool:
        """A ``completions`` table at ``step`` if it is a multiple of ``completions_every``.

        Rows are dicts (prompt, completion, reward, per-function rewards, advantage, ...);
        columns are the union of their keys, in first-seen order; long strings are clipped
        to their head and tail. Returns whether a table was logged.
        """
        if not (self.wandb and self.is_main and rows and self.completions_every):
            return False
        if step % self.completions_every:
            return False
        columns: list[str] = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        self.accelerator.get_tracker("wandb").log_table(
            "completions", columns=columns, data=data, step=step
        )
        return True

    def finish(self, print_summary: bool = True) -> None:
        """Write the run's files, end the W&B run and print the summary table.

        The process group stays up (``accelerator.end_training()`` ends it, after this), so
        ranks can still wait for rank 0 to finish writing the run.
        """
        summary = None
        if self.is_main and ownership.replaced(self.output_dir) is None:  # not another run's
            self._write_curves()
            summary = self._write_summary()
        if self.wandb:
            offline_dir = self.run_dir if self.mode == "offline" else None
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []  # finished: end_training must not finish them again
            if offline_dir is not None:
                print(f"wandb: to upload this offline run: wandb sync {offline_dir}")
        if print_summary and self.is_main and self.history:
            Console().print(self.summary_table(headline_only=True))
            if summary is not None:
                print(f"full summary (every metric): {summary}")

    def _write_curves(self) -> None:
        """``metrics.csv`` and ``curves.png`` beside the run (``run_curves``); the PNG also
        to W&B, as the image ``curves``."""
        written = write_run_curves(
            self.history, self.output_dir, self.run_name or "", png=self.curves_png
        )
        png = [p for p in written if p.suffix == ".png"]
        if png and self.wandb:
            import wandb

            self.accelerator.log({"curves": wandb.Image(str(png[0]))}, step=self.history[-1][0])

    def _write_summary(self) -> Path | None:
        """The whole summary table as ``summary.txt`` beside the run and, with W&B, as the
        table ``run_summary`` (``run_summary``); the file's path (None: nothing logged)."""
        if not self.history:
            return None
        rows = run_summary.summary_rows(self.history)
        path = run_summary.write_summary(rows, self._summary_title(), self.output_dir)
        if self.wandb:
            columns, data = run_summary.wandb_rows(rows)
            self.accelerator.get_tracker("wandb").log_table(
                "run_summary", columns=columns, data=data, step=self.history[-1][0]
            )
        return path

    # ----------------------------------------------------------------------- rendering

    def summary_line(self, step: int, flat: Mapping[str, float]) -> Text:
        total = f"/{self.total_steps}" if self.total_steps else ""
        line = Text(f"step {step}{total}", style="bold")
        for key, label, fmt in SUMMARY_KEYS:
            for name, part in _matching(key, flat):
                shown = format_value(flat[name], fmt)
                line.append("  " if label != "±" else " ")
                line.append(f"{label.format(part)} " if label != "±" else label, style="dim")
                line.append(shown, style="cyan")
        return line

    def summary_table(self, *, headline_only: bool = False) -> Table:
        """First, last, min, max and mean of every metric over the logged steps, TRL's
        headline metrics first (``run_summary``); ``headline_only``: those alone, what the
        console shows (every name whole at 80 columns)."""
        rows = run_summary.summary_rows(self.history)
        return run_summary.summary_table(rows, self._summary_title(), headline_only=headline_only)

    def _summary_title(self) -> str:
        steps = [s for s, _ in self.history]
        return f"Run summary: steps {steps[0]}..{steps[-1]} ({len(steps)} logged)"


# --------------------------------------------------------------------------- helpers


def completion_rows(
    scored: RewardResult, advantages: Sequence[float], **fixed: Any
) -> list[dict[str, Any]]:
    """The completions table's rows for one scored group, TRL's columns in TRL's order:
    ``prompt`` (clipped: a million-token prompt must not travel to rank 0 whole),
    ``completion``, each reward function's value, what they logged with ``log_extra``,
    ``advantage``; ``fixed`` first (e.g. the sample's id) and the weighted ``reward`` after
    the functions' values."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(scored.prompts, scored.completions, strict=True)):
        row = dict(fixed)
        row["prompt"] = clip_text(_text(prompt))
        row["completion"] = clip_text(_text(completion))
        row |= {name: values[i] for name, values in scored.columns().items()}
        row["reward"] = scored.rewards[i]
        row |= {
            name: values[i] if i < len(values) else None
            for name, values in scored.extra_columns.items()
        }
        row["advantage"] = advantages[i]
        rows.append(row)
    return rows


def answer_columns(sample: Sample) -> dict[str, Any]:
    """The sample's reference answer for the completions table, under the dataset's own
    column names (``ANSWER_COLUMNS`` it has: ``solution``, ``ground_truth``, ...), else
    ``answer`` (a task's, or a ``messages`` row's last assistant turn); none without one."""
    found = {
        name: sample.columns[name]
        for name in ANSWER_COLUMNS
        if sample.columns.get(name) not in (None, "")
    }
    if not found and sample.answer:
        found["answer"] = sample.answer
    return found


def _matching(key: str, flat: Mapping[str, float]) -> list[tuple[str, str]]:
    """The logged names ``key`` shows, each with what fills its ``{}`` (``eval/pass@{}`` ->
    ``("eval/pass@4", "4")``); a plain key is itself, if logged."""
    if "{}" not in key:
        return [(key, "")] if key in flat else []
    head, tail = key.split("{}", 1)
    return [
        (name, name[len(head) : len(name) - len(tail)])
        for name in flat
        if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail)
    ]


def _text(value: Any) -> str:
    """A prompt or completion as text: chat messages as ``role: content`` lines; an agent's
    turns with their tool calls (``-> name(arguments)``) and results (``tool (name): ...``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(m, Mapping) for m in value):
        return "\n".join(_message_text(m) for m in value)
    return str(value)


def _message_text(message: Mapping[str, Any]) -> str:
    role = message.get("role", "?")
    if role == "tool" and message.get("name"):
        role = f"tool ({message['name']})"
    lines = [f"{role}: {message.get('content') or ''}"]
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments", {})
        shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
        lines.append(f"  -> {function.get('name', '?')}({shown})")
    return "\n".join(lines)


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"time": {"prefill": 1.0}}`` -> ``{"time/prefill": 1.0}``; numbers as floats.

    0-d tensors, numpy scalars and bools become floats; None is skipped. Anything else
    (a string, a tensor with several elements) is a TypeError naming the key, rather than a
    metric that silently never shows up.
    """
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_metrics(value, f"{name}/")
        elif value is None:
            continue
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            flat[name] = float(value.item())
        elif isinstance(value, numbers.Real):
            flat[name] = float(value)
        else:
            raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a number")
    return flat


def _json_number(value: float) -> float | None:
    """``value``, or None where strict JSON has no number for it (NaN, inf)."""
    return value if math.isfinite(value) else None


def render(text: Text) -> str:
    """Rich text as a string (ANSI colours on a terminal), so tqdm.write can print it."""
    buffer = io.StringIO()
    Console(file=buffer, force_terminal=sys.stdout.isatty(), width=10_000).print(text)
    return buffer.getvalue().rstrip("\n")


def clip_text(text: str, max_chars: int = MAX_CELL_CHARS) -> str:
    """Head and tail of a long string with the number of characters left out."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]} [... {len(text) - 2 * half:,} characters ...] {text[-half:]}"


def _cell(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, str):
        return clip_text(value)
    if value is None or isinstance(value, (bool, numbers.Real)):
        return value
    return clip_text(str(value))


def format_value(value: float, fmt: str) -> str:
    """A step-line value: ``"bytes"`` as a size, ``"decimals"`` as ``decimals_or_significant``,
    else a format string; NaN (nothing to measure this step, e.g. the entropy of a step with
    no replayed branch) as ``-``."""
    if math.isnan(value):
        return ABSENT
    if fmt == "bytes":
        return format_bytes(value)
    if fmt == "decimals":
        return decimals_or_significant(value)
    return fmt.format(value)


def decimals_or_significant(value: float, decimals: int = 3) -> str:
    """``value`` to ``decimals`` places, or to two significant digits where those places
    would show less (a reward std of 5e-4 is ``0.0005``, not ``0.000``)."""
    if value == 0 or not math.isfinite(value) or abs(value) >= 10.0 ** (1 - decimals):
        return f"{value:.{decimals}f}"
    return f"{value:.2g}"
