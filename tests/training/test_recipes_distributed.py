"""The recipes as sharded runs: ``torchrun --nproc_per_node 2 ... distributed.fsdp=true``.

Two CPU ranks (gloo) run the real entry point in a subprocess, on a tiny model and short
prompts. Each rank must train on its own group (checked through the W&B completions table,
which holds every rank's group), only rank 0 may log, a multi-rank run that does not shard
must stop at once naming ``distributed.fsdp``, and a stopped and resumed 2-rank run must end
with the same parameters and optimizer state as an uninterrupted one, with checkpoints that
peft (LoRA) and a single unsharded process load.
"""

from __future__ import annotations

import json
from pathlib import Path

import launch
import pytest
import torch
from recipe_runs import (
    GLM,
    GROUP,
    QWEN,
    ROOT,
    SMALL,
    assert_resumed_like_straight,
    assert_same_optimizer_state,
    stopped_at,
    tensors,
)
from wandb_records import wandb_history, wandb_records

from longstraw_core import checkpoint, config
from longstraw_core.models import build as models

pytestmark = pytest.mark.multiprocess

CASES = {  # name: (recipe, config, overrides); LoRA and full weights, both recipes
    "qwen36-full-exact": ("grpo_qwen36.py", QWEN, ["grpo.gradient=exact"]),
    "qwen36-lora-exact": (
        "grpo_qwen36.py", "configs/qwen36/tiny_lora_grpo_cpu.yaml", ["grpo.gradient=exact"],
    ),
    "glm52-lora-kl-detached": (
        "grpo_glm52.py", GLM, ["lora.enabled=true", "grpo.gradient=detached", "grpo.beta=0.04"],
    ),
}  # fmt: skip


def torchrun(recipe: str, config_path: str, output_dir: Path, *overrides: str, ranks: int = 2):
    """The recipe on ``ranks`` CPU ranks with the small settings; ``(returncode, log)``."""
    return launch.torchrun(
        ROOT / "recipes" / recipe, "--config", str(ROOT / config_path), *SMALL,
        f"train.output_dir={output_dir}", *overrides, ranks=ranks,
    )  # fmt: skip


def run_ok(*args, **kwargs) -> str:
    returncode, log = torchrun(*args, **kwargs)
    assert returncode == 0, f"torchrun failed ({returncode}):\n{log[-5000:]}"
    return log


@pytest.mark.parametrize(
    ("recipe", "config_path"), [("grpo_qwen36.py", QWEN), ("grpo_glm52.py", GLM)]
)
def test_ranks_train_on_their_own_groups_and_only_rank_0_logs(tmp_path, recipe, config_path):
    out = tmp_path / "run"
    # beta > 0: the full-weight policy's frozen reference is sharded like it (its own FSDP).
    log = run_ok(
        recipe, config_path, out, "distributed.fsdp=true", "train.steps=2",
        "grpo.gradient=detached", "tracking.wandb=true", "train.completions_every=1",
        "grpo.beta=0.04", "eval.every=2", "eval.data.seed=1", "eval.samples=3",
        "eval.num_generations=2", "eval.max_new_tokens=4",
    )  # fmt: skip
    assert log.count("step 2/2  ") == 1, "only rank 0 prints the per-step line"
    # The run's shape, once: two torchrun ranks of one stage, sharded; the tests' threads.
    assert log.count("run shape:") == 1
    assert "  processes  2 (torchrun), 2 on this node; pipeline stages x replicas 1 x 2; " in log
    assert "  threads    1 per process (OMP_NUM_THREADS=1)\n" in log
    assert "\nwarning: accelerate launch" not in log
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one W&B run (rank 0's), got {runs}"
    # Sharded ranks evaluate together (three prompts on two ranks: one runs an extra it drops).
    history = wandb_history(wandb_records(next(runs[0].glob("run-*.wandb"))))
    evaluated = {step for step, row in history.items() if "eval/greedy_accuracy" in row}
    assert evaluated == {2} and 0 <= history[2]["eval/pass@2"] <= 1
    assert history[2]["eval/completions/max_length"] <= 4
    tables = sorted(runs[0].rglob("completions_*.table.json"))
    assert len(tables) == 2, tables
    seen = []
    for table in tables:  # completions_<step>_<hash>: a table per step, rows of both ranks
        body = json.loads(table.read_text())
        column = body["columns"].index("sample")
        samples = [row[column] for row in body["data"]]
        assert len(samples) == 2 * GROUP  # both ranks' groups
        seen.append(sorted(set(samples)))
    # Step 1: samples 0 (rank 0) and 1 (rank 1); step 2: samples 2 and 3.
    indices = [[int(sample.rsplit(":", 1)[1]) for sample in step] for step in seen]
    assert sorted(indices) == [[0, 1], [2, 3]], seen


def test_several_ranks_without_sharding_fail_naming_the_key(tmp_path):
    returncode, log = torchrun("grpo_qwen36.py", QWEN, tmp_path / "run", "train.steps=1")
    assert returncode != 0
    assert "distributed.fsdp" in log, log[-3000:]
    assert not (tmp_path / "run" / "latest").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_sharded_run_equals_uninterrupted_run(tmp_path, case):
    recipe, config_path, extra = CASES[case]
    common = ["distributed.fsdp=true", "train.save_every=2", *extra]
    straight = tmp_path / "straight"
    run_ok(recipe, config_path, straight, "train.steps=4", *common)
    stopped = stopped_at(straight, 2, tmp_path / "stopped")  # as a run stopped there leaves it
    run_ok(recipe, config_path, stopped, "train.steps=4", "train.resume_from=latest", *common)

    for run in (straight, stopped):
        assert (run / "latest").read_text().strip() == "step-000004"
        state = json.loads((run / "step-000004" / "trainer_state.json").read_text())
        assert state["step"] == 4 and state["data_position"] == 8  # 4 steps x 2 ranks
        rng_files = {p.name for p in (run / "step-000004").glob("rng*.pt")}
        assert rng_files == {"rng.pt", "rng-rank1.pt"}  # each rank's generators
    first = tensors(straight / "step-000004/model")
    assert_resumed_like_straight(
        first, tensors(stopped / "step-000004/model"), tensors(straight / "step-000002/model")
    )
    assert_same_optimizer_state(straight / "step-000004", stopped / "step-000004")

    # The checkpoint is the single-process layout: peft and an unsharded process load it.
    cfg = config.load_config(ROOT / config_path, [*SMALL, *common])
    saved = straight / "step-000004"
    lora = "lora" in case
    if lora:
        assert (saved / "model" / "adapter_config.json").is_file()
        assert not (saved / "model" / "model.safetensors").exists()
        loaded = models.load_lora(models.build_model(cfg.model, cfg.train.seed), saved / "model")
        adapters = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
        assert len(adapters) == len(first)
        for key, value in adapters.items():
            assert torch.equal(value, first[key.replace(".default", "")]), key
    model = models.add_lora(models.build_model(cfg.model, seed=123), cfg.lora)
    optimizer = models.build_optimizer(model, cfg.optim)
    info = checkpoint.load_checkpoint(saved, model, optimizer, restore_rng=False)
    assert (info.step, info.data_position) == (4, 8)
    state = model.state_dict()
    for key, value in first.items():
        name = key.replace(".weight", ".default.weight") if lora else key
        assert torch.equal(state[name], value), name
    # optimizer.pt is keyed by parameter index, in the unsharded optimizer's order.
    reference = torch.load(saved / "optimizer.pt", weights_only=True)["state"]
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    assert reference.keys() == optimizer.state_dict()["state"].keys()
    for index, values in optimizer.state_dict()["state"].items():
        assert values["exp_avg"].shape == parameters[index].shape, index
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(values[key], reference[index][key]), (index, key)
