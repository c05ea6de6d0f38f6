"""``make learn-real``'s config as a user runs it: the real SmolLM2 from its wheel, the
real-text task, the held-out eval before the first step and after the last, and the curves
written beside the run. (The learning itself takes ~30 minutes: docs/benchmarks.md.)"""

from __future__ import annotations

import csv
import subprocess
import sys

from real_model import smollm2_dir
from recipe_runs import ROOT

from longstraw_core.metrics import names
from longstraw_core.metrics.curves import CURVES_PNG, METRICS_CSV

CONFIG = ROOT / "configs" / "smollm2" / "learn_real_cpu.yaml"


def test_the_learn_real_config_runs_evaluates_and_draws_its_curves(tmp_path):
    smollm2_dir()  # converted once, or skipped with the reason
    out = tmp_path / "learn"
    command = [
        sys.executable, str(ROOT / "recipes" / "grpo_qwen36.py"), "--config", str(CONFIG),
        "train.steps=1", "eval.every=1", "eval.samples=1", "rollout.num_generations=2",
        "rollout.max_new_tokens=8", "tracking.wandb=false", f"train.output_dir={out}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: train.chunk_size:" in result.stdout + result.stderr  # the planner's chunk
    with open(out / METRICS_CSV) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1"]  # eval.on_start, then the step
    assert all(r[names.EVAL_GREEDY_ACCURACY] != "" for r in rows)
    assert rows[0][names.REWARD] == "" and rows[1][names.REWARD] != ""
    assert (out / CURVES_PNG).read_bytes()[:4] == b"\x89PNG"
