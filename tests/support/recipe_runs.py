"""Running the recipes from the tests: in a subprocess as a user does (``run_recipe``), in
this process (``recipe_in_process``), on several ranks (``run_on_ranks``), and reading what
they saved (``weights``, ``tensors``) and comparing runs.

``FAST``: the settings of a one-process run that finishes in seconds; ``SMALL``: those of a
multi-rank run (its groups vary in reward, so every step trains).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import launch
import torch
from safetensors.torch import load_file

from longstraw_core.config import load_config
from longstraw_core.training.trainer import load_recipe

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "data.prompt_tokens=1024",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=6",
    "train.chunk_size=256",
    "train.completions_every=1",
    "rewards=[{name: answer_char_recall, weight: 1.0}]",
]


def run_recipe(recipe: str, config: str, output_dir: Path, *overrides: str, check: bool = True):
    command = [sys.executable, str(ROOT / "recipes" / recipe), "--config", str(ROOT / config)]
    command += [*FAST, f"train.output_dir={output_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{recipe} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = sorted(checkpoint.rglob("*.safetensors"))
    assert files, f"no weights under {checkpoint}"
    return {k: v for f in files for k, v in load_file(f).items()}


def train_in_process(recipe: str, config: str, output_dir: Path, *overrides: str) -> Path:
    """The recipe's own ``Recipe`` (setup, train, cleanup) in this process: what ``main`` runs,
    without a new interpreter's imports (``test_recipes`` tests the entry point itself)."""
    recipe_in_process(recipe, config, output_dir, *overrides)
    return output_dir


def recipe_in_process(recipe: str, config: str, output_dir: Path, *overrides: str):
    """``train_in_process``, returning the finished ``Recipe`` (its model, adapter, logger)."""
    module = load_recipe(ROOT / "recipes" / recipe)
    cfg = load_config(ROOT / config, [*FAST, *overrides, f"train.output_dir={output_dir}"])
    run = module.Recipe(cfg)
    run.setup()
    try:
        assert run.train() is None
    finally:
        run.cleanup()
    return run


GROUP = 8
SMALL = [
    "data.prompt_tokens=512",  # the passkey task needs ~300 tokens of instructions
    f"rollout.num_generations={GROUP}",
    "rollout.max_new_tokens=16",
    "train.chunk_size=128",  # four prompt chunks: prefill and the exact sweep loop
    "train.completions_every=0",
    "tracking.wandb=false",
    # Partial credit that a random toy sometimes earns: groups with reward variance, so the
    # steps really move the parameters. vocab_size: only ids the byte tokenizer decodes.
    "rewards=[{name: answer_char_recall, weight: 1.0}]",
    "model.tiny_overrides.vocab_size=260",
    # A stopped run is told train.steps=2: a schedule over the run's length would differ.
    "optim.scheduler=constant",
]
QWEN, GLM = "configs/qwen36/tiny_grpo_cpu.yaml", "configs/glm52/tiny_grpo_cpu.yaml"


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no weights in {directory}"
    return {k: v for f in files for k, v in load_file(f).items()}


def assert_same_optimizer_state(a: Path, b: Path) -> None:
    first, second = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
    assert first["param_groups"] == second["param_groups"]
    assert first["state"].keys() == second["state"].keys() and first["state"]
    for index, state in first["state"].items():
        for key, value in state.items():
            assert torch.equal(value, second["state"][index][key]), (index, key)


def launch_recipe(recipe: str, *args: str, ranks: int) -> tuple[int, str]:
    """``recipe args`` under torchrun on ``ranks`` ranks, or (``ranks`` = 1) as a plain
    single process; ``(returncode, log)``."""
    if ranks > 1:
        return launch.torchrun(ROOT / "recipes" / recipe, *args, ranks=ranks)
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / recipe), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def run_on_ranks(
    recipe: str, config_path: str, output_dir: Path, *overrides: str, ranks: int
) -> str:
    """The recipe with the small settings, which must succeed; its log."""
    args = ["--config", str(ROOT / config_path), *SMALL, f"train.output_dir={output_dir}"]
    returncode, log = launch_recipe(recipe, *args, *overrides, ranks=ranks)
    assert returncode == 0, f"run failed ({returncode}):\n{log[-5000:]}"
    return log


def assert_resumed_like_straight(
    straight: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor], initial: dict
) -> None:
    """A stopped and resumed run's weights equal the uninterrupted run's bit for bit, and
    training moved them away from ``initial`` (the straight run's earlier checkpoint)."""
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert any(not torch.equal(initial[n], straight[n]) for n in straight), (
        "training changed nothing"
    )


def stopped_at(straight: Path, step: int, into: Path) -> Path:
    """An output directory ``into`` holding only ``straight``'s checkpoint of ``step``: what a
    run stopped after that step leaves, without training those steps again (the resumed
    run is then a new process that reads it, as after a real stop)."""
    name = f"step-{step:06d}"
    shutil.copytree(straight / name, into / name)
    (into / "latest").write_text(name)
    return into
