"""Run logging: an offline W&B run records our metrics, config and table; disabled mode works."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from rich.console import Console
from wandb_records import wandb_config, wandb_history, wandb_records

from longstraw_core.config import load_config, to_dict
from longstraw_core.metrics import names
from longstraw_core.metrics.curves import METRICS_CSV
from longstraw_core.metrics.summary import SUMMARY_TXT
from longstraw_core.process.progress import StepProgress, counter
from longstraw_core.training.tracking import RunLogger, flatten_metrics, log_with, wandb_metrics

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"


def test_offline_wandb_run_records_metrics_config_and_completions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(TINY, [f"train.output_dir={tmp_path}", "train.steps=3"])
    assert log_with(cfg.tracking) == ["wandb"]
    accelerator = Accelerator(cpu=True, log_with=log_with(cfg.tracking))
    lines: list[str] = []
    logger = RunLogger.from_config(accelerator, cfg, completions_every=2, write=lines.append)
    run_dir = logger.run_dir
    assert run_dir is not None and tmp_path in run_dir.parents

    for step in (1, 2, 3):
        metrics = {
            "reward": 0.25 * step,
            "reward_std": torch.tensor(0.5),
            "loss": 1.0 / step,
            "time": {"prefill": 2.0, "step": 3.0},
            "state_bytes": {"linear_attention": 1024, "full_attention": 4096},
        }
        if step == 3:
            metrics |= {"eval/reward": 0.75, "eval/greedy_accuracy": 0.5}
        logger.log(step, metrics)
        rows = [{"prompt": "x" * 10_000, "completion": f"<answer>{step}</answer>", "reward": 1.0}]
        logged = logger.log_completions(step, rows * 2)
        assert logged == (step == 2)
    logger.finish(print_summary=False)

    assert len(lines) == 3 and lines[0].startswith("step 1/3") and "reward 0.250" in lines[0]
    records = wandb_records(next(run_dir.glob("run-*.wandb")))
    steps = wandb_history(records)
    # TRL's W&B names (tracking.trl_names, the default): what transformers' WandbCallback
    # records for a TRL run, so its dashboards' panels (train/reward, ...) show this run.
    assert steps[3]["train/loss"] == pytest.approx(1 / 3) and steps[1]["train/reward"] == 0.25
    assert steps[2]["train/time/prefill"] == 2.0
    assert steps[2]["train/state_bytes/full_attention"] == 4096
    assert [steps[s]["train/global_step"] for s in (1, 2, 3)] == [1, 2, 3]
    assert steps[3]["eval/reward"] == 0.75 and steps[3]["eval/greedy_accuracy"] == 0.5
    logged = {key for row in steps.values() for key in row if not key.startswith("_")}
    assert not logged & {"reward", "loss", "train/eval/reward"}, "bare or doubled names"
    assert steps[2]["completions/_type"] == "table-file"  # TRL's table name, as TRL logs it
    assert steps[3]["run_summary/_type"] == "table-file"  # the whole summary table
    (summary,) = run_dir.glob("files/media/table/run_summary_3_*.table.json")
    cells = json.loads(summary.read_text())
    assert cells["columns"] == ["metric", "first", "last", "min", "max", "mean"]
    assert [row[0] for row in cells["data"]][:3] == ["reward", "reward_std", "loss"]
    config = wandb_config(records)
    assert config["rollout"]["num_generations"] == cfg.rollout.num_generations
    assert config["model"] == to_dict(cfg)["model"]
    (table,) = run_dir.glob("files/media/table/completions_2_*.table.json")
    cells = json.loads(table.read_text())
    assert cells["columns"] == ["prompt", "completion", "reward"] and len(cells["data"]) == 2
    assert len(cells["data"][0][0]) < 5000  # a long prompt is clipped, head and tail


@pytest.mark.parametrize("switch", ["tracking.wandb=false", "tracking.mode=disabled"])
def test_disabled_tracking_still_logs_to_the_console(
    tmp_path: Path, switch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(TINY, [f"train.output_dir={tmp_path / 'run'}", switch])
    assert log_with(cfg.tracking) is None
    accelerator = Accelerator(cpu=True, log_with=log_with(cfg.tracking))
    lines: list[str] = []
    logger = RunLogger.from_config(accelerator, cfg, write=lines.append)
    assert logger.run_dir is None
    for step in (1, 2):
        logger.log(step, {"reward": 0.5, "loss": 0.1 * step, "step_peak_memory_bytes": 2**30})
    assert not logger.log_completions(2, [{"completion": "hi"}])
    logger.finish()
    assert "peak 1.00 GiB" in lines[0]
    table = capsys.readouterr().out
    assert "Run summary" in table and "loss" in table and "0.2" in table
    # No W&B directory: only the run's own record of its metrics (run_curves), no PNG unless
    # tracking.curves_png asks for it.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [METRICS_CSV, SUMMARY_TXT]
    resumed = RunLogger.from_config(accelerator, cfg, write=lines.append)
    resumed.load_state_dict(json.loads(json.dumps(logger.state_dict())))  # via trainer_state.json
    assert resumed.history == logger.history


def test_step_line_shows_length_throughput_and_peak_memory(tmp_path: Path) -> None:
    """Every key of the step line is a name the recipes emit (``longstraw_core.metrics.names``)."""
    cfg = load_config(TINY, [f"train.output_dir={tmp_path / 'run'}", "tracking.wandb=false"])
    lines: list[str] = []
    logger = RunLogger.from_config(Accelerator(cpu=True), cfg, write=lines.append)
    step_metrics = {
        names.REWARD: 0.5,
        names.REWARD_STD: 0.25,
        names.LOSS: 0.01,
        names.ENTROPY: 5.2,
        names.COMPLETIONS_MEAN_LENGTH: 11.6,
        names.ROLLOUT_TOKENS_PER_SECOND: 12345.6,
        names.STEP_PEAK_MEMORY_BYTES: 3 * 2**30,
        names.STEP_SECONDS: 1.25,
    }
    logger.log(1, step_metrics)
    eval_metrics = {names.EVAL_GREEDY_ACCURACY: 0.25, "eval/pass@8": 0.75, "eval/pass@1": 0.5}
    logger.log(2, step_metrics | eval_metrics)  # an eval step
    line = "reward 0.500 ±0.250  loss 0.01  entropy 5.200  len 12  tok/s 12,346  peak 3.00 GiB"
    assert lines == [
        f"step 1/{cfg.train.steps}  {line}  step 1.2s",
        f"step 2/{cfg.train.steps}  {line}  step 1.2s  eval greedy 0.250  pass@8 0.750  "
        "pass@1 0.500",
    ]
    shown = {key for key, _, _ in names.STEP_LINE}
    assert shown == step_metrics.keys() | {
        names.KL,
        names.EVAL_GREEDY_ACCURACY,
        names.EVAL_PASS_AT_K,
    }
    wide = Console(file=io.StringIO(), width=200)  # an 80-column terminal clips the names
    wide.print(logger.summary_table())
    table = wide.file.getvalue()
    for key in ("completions/mean_length", "rollout_tokens_per_second", "step_peak_memory_bytes"):
        assert key in table


def test_num_tokens_is_the_running_total_and_resumes(tmp_path: Path) -> None:
    """TRL's num_tokens counts every token seen so far: each step reports its own count, the
    logger logs the sum, and a logger restored from a checkpoint continues it."""
    cfg = load_config(TINY, [f"train.output_dir={tmp_path / 'run'}", "tracking.wandb=false"])
    logger = RunLogger.from_config(Accelerator(cpu=True), cfg, write=lambda line: None)
    assert logger.log(1, {names.NUM_TOKENS: 100.0})[names.NUM_TOKENS] == 100.0
    assert logger.log(2, {names.LOSS: 0.5})[names.LOSS] == 0.5  # a step without the count
    assert logger.log(3, {names.NUM_TOKENS: 40.0})[names.NUM_TOKENS] == 140.0
    resumed = RunLogger.from_config(Accelerator(cpu=True), cfg, write=lambda line: None)
    resumed.load_state_dict(json.loads(json.dumps(logger.state_dict())))
    assert resumed.log(4, {names.NUM_TOKENS: 10.0})[names.NUM_TOKENS] == 150.0


def test_wandb_on_without_the_tracker_in_accelerate_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="log_with"):
        RunLogger(Accelerator(cpu=True), output_dir=tmp_path, wandb=True, mode="offline")


def test_wandb_names_are_what_transformers_wandb_callback_makes_of_trls_logs() -> None:
    """TRL logs ``reward``, ``eval_reward`` through ``Trainer.log``; transformers' W&B callback
    rewrites them (``rewrite_logs``) and adds ``train/global_step``. LongStraw's names, so
    rewritten, are the same keys; ``tracking.trl_names=false`` keeps the bare ones."""
    from transformers.integrations.integration_utils import rewrite_logs

    flat = {
        names.REWARD: 0.5, names.LOSS: 0.1, "rewards/exact_match/mean": 0.5,
        names.COMPLETIONS_MEAN_LENGTH: 12.0, names.STEP_SECONDS: 3.0, "eval/reward": 0.25,
        "eval/completions/mean_length": 9.0, names.EVAL_GREEDY_ACCURACY: 1.0,
    }  # fmt: skip
    trl_logs = {f"eval_{k[5:]}" if k.startswith("eval/") else k: v for k, v in flat.items()}
    expected = rewrite_logs(trl_logs) | {"train/global_step": 7.0}
    assert wandb_metrics(7, flat, trl_names=True) == expected
    assert expected["train/reward"] == 0.5 and expected["eval/reward"] == 0.25
    assert wandb_metrics(7, flat, trl_names=False) == flat


def test_flatten_metrics_names_what_it_cannot_log() -> None:
    flat = flatten_metrics({"a": {"b": torch.tensor(2.0), "c": None}, "d": True, "e": 3})
    assert flat == {"a/b": 2.0, "d": 1.0, "e": 3.0}
    with pytest.raises(TypeError, match="'a/s'"):
        flatten_metrics({"a": {"s": "text"}})


def test_step_progress_times_each_phase() -> None:
    progress = StepProgress(total_steps=2, enabled=False)
    with progress.phase("prefill"):
        assert progress.current == "prefill"
    with progress.phase("replay"):
        pass
    timings = progress.step_done()
    assert set(timings) == {"time/prefill", "time/replay", "time/step"}
    assert timings["time/step"] >= timings["time/prefill"] + timings["time/replay"]
    assert progress.step_done().keys() == {"time/step"} and progress.steps_done == 2
    progress.close()


def _count(desc: str, total: int, progress: bool | None = None) -> None:
    with counter(total, desc, "tok", progress) as bar:
        for _ in range(total):
            bar.update(1)


def test_counters_print_plain_lines_off_a_terminal_only_as_often_as_asked(capsys) -> None:
    """stderr not a terminal (pytest captures it): a pass's counter prints lines only while a
    run's StepProgress with an interval is open, never sooner than the interval, nothing
    for a pass with nothing to do, nothing where reporting is off (other ranks)."""
    _count("prefill", 4)  # outside a run (a library call): nothing
    assert capsys.readouterr().err == ""
    with StepProgress(total_steps=3, initial=1, every_seconds=30.0) as progress:
        with progress.phase("prefill"):
            _count("prefill", 4)  # a pass shorter than the interval: nothing
        assert capsys.readouterr().err == ""
    progress = StepProgress(total_steps=3, initial=1, every_seconds=0.0)
    with progress, progress.phase("replay"):
        _count("sweep", 2)
        _count("replay", 0)  # no branch to replay
        _count("sweep", 2, progress=False)  # a rank that does not report
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in lines] == [
        "step 2/3 replay: sweep:   0% 0/2 tok",
        "step 2/3 replay: sweep:  50% 1/2 tok",
        "step 2/3 replay: sweep: 100% 2/2 tok",
        "step 2/3 replay: sweep: 100% 2/2 tok",  # its last line, at the pass's end
    ]
    _count("prefill", 4)  # the run's StepProgress closed: nothing again
    assert capsys.readouterr().err == ""
