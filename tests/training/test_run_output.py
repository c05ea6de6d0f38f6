"""What a run prints reads right: no value that looks like a bug (``nan``, ``±0.000``), no
names cut to look alike, nobody else's noise (setuptools, peft, transformers' save bar,
W&B's own summary), and a config error once, not once per rank."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from accelerate import Accelerator
from launch import torchrun
from recipe_runs import FAST, recipe_in_process
from rich.console import Console
from tiny_training import optimizer_and_schedule, tiny_policy, train_step
from wandb_records import wandb_history, wandb_records

from longstraw_core.checkpoint import save_checkpoint
from longstraw_core.config import LoraSection, load_config
from longstraw_core.metrics import names
from longstraw_core.metrics.curves import CURVES_PNG, METRICS_CSV
from longstraw_core.metrics.summary import SUMMARY_TXT
from longstraw_core.models import build as models
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import chunk_for_config
from longstraw_core.training.tracking import RunLogger, log_with

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"


def _logger(tmp_path: Path, *overrides: str, lines: list[str] | None = None) -> RunLogger:
    cfg = load_config(TINY, [f"train.output_dir={tmp_path / 'run'}", *overrides])
    accelerator = Accelerator(cpu=True, log_with=log_with(cfg.tracking))
    write = lines.append if lines is not None else (lambda line: None)
    return RunLogger.from_config(accelerator, cfg, write=write)


def test_a_step_with_nothing_replayed_shows_entropy_as_absent_and_a_small_std_in_full(
    tmp_path,
):
    """A step whose groups all had zero reward variance replays no branch: its entropy is
    NaN (nothing measured), shown as ``-``; a reward std of 5e-4 is not ``±0.000``."""
    lines: list[str] = []
    logger = _logger(tmp_path, "tracking.wandb=false", lines=lines)
    logger.log(1, {names.REWARD: 0.5, names.REWARD_STD: 0.0, names.ENTROPY: float("nan")})
    logger.log(2, {names.REWARD: 0.00052, names.REWARD_STD: 5e-4, names.ENTROPY: 5.25})
    assert lines[0] == "step 1/4  reward 0.500 ±0.000  entropy -"
    assert lines[1] == "step 2/4  reward 0.00052 ±0.0005  entropy 5.250"
    wide = Console(file=io.StringIO(), width=200)
    wide.print(logger.summary_table())
    (row,) = [line for line in wide.file.getvalue().splitlines() if line.startswith("entropy ")]
    assert "nan" not in row and row.split()[1] == "-"  # first: absent, not nan


# A step's metrics as the recipes log them (a run logs ~55), the headline's among them in
# another order, with values as wide as they come (negative, tiny, huge, sizes).
EVERY_METRIC = [
    names.LOSS, names.GROUP_REWARD_MEAN, names.GROUP_REWARD_STD, names.ENTROPY,
    names.PROMPT_TOKENS, names.COMPLETION_TOKENS, names.COMPLETIONS_MEAN_LENGTH,
    names.BRANCHES_REPLAYED, names.STATE_BYTES, names.PEAK_MEMORY_BYTES, "sweep_seconds",
    "clip_ratio/low_mean", "rewards/answer_char_recall/mean", names.REWARD, names.REWARD_STD,
    names.FRAC_REWARD_ZERO_STD, "state_bytes/full_attention", names.ADVANTAGE_ABS_MEAN,
    names.GRAD_NORM, names.LEARNING_RATE, names.ROLLOUT_TOKENS_PER_SECOND,
    names.COMPLETIONS_MIN_LENGTH, names.COMPLETIONS_MAX_LENGTH,
    names.COMPLETIONS_MEAN_TERMINATED_LENGTH, names.NUM_TOKENS, names.STEP_PEAK_MEMORY_BYTES,
    "time/prefill", names.STEP_SECONDS, names.KL, names.EVAL_GREEDY_ACCURACY, "eval/pass@16",
    "eval/reward",
]  # fmt: skip
HEADLINE_SHOWN = [
    names.REWARD, names.REWARD_STD, names.LOSS, names.KL, names.ENTROPY,
    names.COMPLETIONS_MEAN_LENGTH, names.COMPLETIONS_MIN_LENGTH, names.COMPLETIONS_MAX_LENGTH,
    names.STEP_SECONDS, names.STEP_PEAK_MEMORY_BYTES, names.EVAL_GREEDY_ACCURACY,
    "eval/pass@16", "eval/reward",
]  # fmt: skip


def test_the_summary_shows_trls_headline_first_every_name_whole_at_80_columns(tmp_path, capsys):
    """What a person reads at the end of a run: TRL's headline metrics (reward first), each
    name whole on one line at 80 columns, however wide the numbers; every metric, the
    headline first, in ``summary.txt`` beside the run."""
    logger = _logger(tmp_path, "tracking.wandb=false")
    wide_values = [-2.776e-17, 1023.9 * 2**30, -0.0012345, 99999.7, 123456789.0]
    for step, value in enumerate(wide_values, start=1):
        logger.log(step, {name: value * (1 + i / 7) for i, name in enumerate(EVERY_METRIC)})
    narrow = Console(file=io.StringIO(), width=80)
    narrow.print(logger.summary_table(headline_only=True))
    rendered = narrow.file.getvalue().splitlines()
    assert "…" not in "".join(rendered) and max(map(len, rendered)) <= 80
    rows = [line.split() for line in rendered if line and line.split()[0] in EVERY_METRIC]
    assert [row[0] for row in rows] == HEADLINE_SHOWN  # whole names, in the headline's order
    cells = [
        len(row) - 1 - sum(cell in ("B", "KiB", "MiB", "GiB", "TiB") for cell in row)
        for row in rows
    ]
    assert cells == [5] * len(rows), "a name or number folded onto another line"
    logger.finish()
    printed = capsys.readouterr().out
    assert printed.index("\nreward ") < printed.index("\nloss ") and "grad_norm" not in printed
    summary = tmp_path / "run" / SUMMARY_TXT
    assert f"full summary (every metric): {summary}" in printed
    names_in_file = [line.split()[0] for line in summary.read_text().splitlines()[3:]]
    assert names_in_file[: len(HEADLINE_SHOWN)] == HEADLINE_SHOWN
    assert sorted(names_in_file) == sorted(EVERY_METRIC)


def test_wandb_leaves_the_summary_to_ours(tmp_path, capfd):
    """W&B prints no history or summary block of its own before our table; the offline
    run's upload command is kept, in one line."""
    logger = _logger(tmp_path, "tracking.mode=offline")
    for step in (1, 2):
        logger.log(step, {names.LOSS: 0.1 * step, names.REWARD: 0.5})
    run_dir = logger.run_dir
    logger.finish()
    out, err = capfd.readouterr()
    text = out + err
    assert "Run history" not in text and "wandb: Run summary" not in text
    assert f"wandb: to upload this offline run: wandb sync {run_dir}" in text
    assert "Run summary: steps 1..2" in text  # ours


def test_a_lora_model_is_built_without_peft_deprecation_noise():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = models.add_lora(tiny_model("qwen3"), LoraSection(enabled=True, r=4))
    assert model.peft_config  # adapters on
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):  # elsewhere it stays
        tiny_model("qwen3").is_gradient_checkpointing  # noqa: B018


def test_a_checkpoint_save_draws_no_progress_bar(tmp_path, capfd):
    model = tiny_policy()
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    capfd.readouterr()
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and "it/s" not in out + err


def test_the_package_installs_without_setuptools_warnings():
    """`pip install -e .` reads pyproject.toml through setuptools: a deprecated field (the
    license as a table) warns at every install."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught] == []


@pytest.mark.multiprocess
def test_a_config_error_under_torchrun_prints_once_and_is_the_launchers_root_cause():
    returncode, log = torchrun(ROOT / "recipes" / "grpo_qwen36.py", "train.stepz=3", ranks=2)
    assert returncode != 0
    ours = [line for line in log.splitlines() if line.startswith("config error:")]
    assert len(ours) == 1 and ours[0].startswith("config error: train.stepz: unknown key")
    # torchrun's own failure summary quotes the line as the root cause (the ranks' error
    # file), instead of a link to how to record one.
    root_cause = log.split("Root Cause", 1)[1]
    assert re.search(r"traceback\s*: config error: train.stepz: unknown key", root_cause), log
    assert "To enable traceback" not in log


def test_a_finished_run_leaves_its_metrics_as_csv_and_its_curves_as_png(tmp_path):
    """Readable without W&B: every metric per step in ``metrics.csv`` (a metric a step did
    not log is an empty cell), the reward and eval curves in ``curves.png``, which W&B
    records too, as the image ``curves``."""
    logger = _logger(tmp_path, "tracking.mode=offline", "tracking.curves_png=true")
    for step in (1, 2, 3):
        logger.log(step, {names.REWARD: 0.1 * step, names.LOSS: float("nan")})
    logger.log(3, {names.EVAL_GREEDY_ACCURACY: 0.25})
    run_file = next(logger.run_dir.glob("run-*.wandb"))
    logger.finish(print_summary=False)
    run = tmp_path / "run"
    with open(run / METRICS_CSV) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3", "3"]
    assert [r[names.REWARD] for r in rows] == [repr(0.1), repr(0.2), repr(0.1 * 3), ""]
    assert rows[0][names.LOSS] == "" and rows[-1][names.EVAL_GREEDY_ACCURACY] == "0.25"
    assert (run / CURVES_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run.glob(".*partial"))  # written whole, then renamed
    history = wandb_history(wandb_records(run_file))
    assert history[3]["curves/_type"] == "image-file" and history[3]["train/reward"] == 0.1 * 3


def test_a_run_says_which_chunk_the_planner_chose_and_why(tmp_path, capfd):
    """``train.chunk_size: null``: one line at start names the chunk and its reason, and the
    run (its config: prefill, sweep, eval, checkpoints, W&B) uses that chunk; a chunk the
    config sets is used as it is, without a word."""
    overrides = ["train.steps=1", "tracking.wandb=false"]
    run = recipe_in_process(
        "grpo_qwen36.py", str(TINY), tmp_path / "auto", "train.chunk_size=null", *overrides
    )
    _, err = capfd.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note: train.chunk_size:")]
    assert len(notes) == 1, err
    chunk = run.cfg.train.chunk_size
    assert notes[0].startswith(f"note: train.chunk_size: {chunk} (auto: a chunk's graph ~")
    assert notes[0].endswith("; set train.chunk_size to override)")
    planned = load_config(TINY, [*FAST, "train.chunk_size=null"])  # the run's step, planned
    assert chunk == chunk_for_config(planned).chunk
    run = recipe_in_process(
        "grpo_qwen36.py", str(TINY), tmp_path / "set", "train.chunk_size=384", *overrides
    )
    _, err = capfd.readouterr()
    assert run.cfg.train.chunk_size == 384 and "train.chunk_size:" not in err


def _on_one_core() -> None:
    """A child process's affinity: one core (as ``taskset -c N`` gives it)."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_a_run_states_its_shape_and_reports_progress_inside_each_step(tmp_path):
    """A log (stderr not a terminal) with ``train.progress_every_seconds=0``: the run's shape
    once at start, then every pass of a step prints plain lines (prefill and sweep tokens,
    decode steps, branches replayed) as it goes, each ending at 100%. Without
    OMP_NUM_THREADS, the threads are this process's cores (here one, by affinity) over its
    node's processes, and the shape says so."""
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "recipes" / "grpo_qwen36.py"), "--config", str(TINY)]
    command += [*FAST, "train.steps=2", "grpo.gradient=exact", "tracking.wandb=false"]
    command += ["train.progress_every_seconds=0", f"train.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=env, preexec_fn=_on_one_core,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert err.count("run shape:") == 1
    shape = err[err.index("run shape:") :].splitlines()[1:7]
    assert (
        shape[0]
        == "  processes  1 (python), 1 on this node; pipeline stages x replicas 1 x 1; FSDP off"
    )
    assert shape[1] == "  device     cpu; weights float32, compute float32"
    assert re.fullmatch(  # the one core, less what other work keeps busy: still one thread
        r"  threads    1 per process \(1 core available, \d+\.\d busy with other work / "
        r"1 process on this node; OMP_NUM_THREADS overrides\)",
        shape[2],
    ), shape[2]
    assert shape[3].startswith(
        "  model      tiny qwen3_5_text: 4 layers (3 deltanet, 1 gated_attention)"
    )
    assert shape[4].startswith(
        "  step       prompts up to 1,024 tokens, G=4 x up to 6 new tokens, gradient exact, "
        "chunk 256, 1 prompt per replica and step"
    )
    assert re.match(
        r"  planner    peak [\d.]+ \wiB per rank \(\w+ phase; no budget set\)", shape[5]
    )
    # Step 2's passes, in the order they run (step 1's rewards did not vary: nothing replayed).
    lines = [line for line in err.splitlines() if line.startswith("step 2/2 ")]
    passes = ["prefill: ", "rollout: ", "replay: ", "replay: sweep: "]
    pattern = r"step 2/2 {}( *\d+)% \S+/\S+ (tok|step|branch) \[[\d:]+<[\d:?]+, "
    found = {p: [m for line in lines if (m := re.match(pattern.format(p), line))] for p in passes}
    assert all(len(found[p]) >= 2 for p in passes), lines  # as it goes, not once at the end
    assert all(found[p][-1].group(1).strip() == "100" for p in passes), lines
    firsts = [
        next(i for i, line in enumerate(lines) if line.startswith(f"step 2/2 {p}")) for p in passes
    ]
    assert firsts == sorted(firsts), lines
    assert [m.group(2) for m in (found[p][0] for p in passes)] == ["tok", "step", "branch", "tok"]
