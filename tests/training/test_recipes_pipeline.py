"""The recipes on pipeline stages: ``torchrun ... distributed.pipeline_stages=S``.

CPU ranks (gloo) run the real entry point on the tiny Qwen3.6 (four layers) and GLM-5.2
toys. A run on two stages trains like one process (the same samples; after one step the
weights and AdamW state within float32 rounding of the clip's norm, which the stages sum in
another order; float64 equality is ``tests/pipeline/test_pipeline.py``'s); a stopped and resumed two-stage run equals an uninterrupted one bit for bit;
its checkpoint (the single-process layout) resumes on one process and on four stages and
ends where the two-stage run does; misconfigurations stop before training, naming the key.
Evaluation runs on the stages and on FSDP replicas and gives one process's metrics, and a
resumed run keeps its schedule.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from recipe_runs import (
    QWEN,
    ROOT,
    SMALL,
    assert_same_optimizer_state,
    launch_recipe,
    run_on_ranks,
    stopped_at,
    tensors,
)

from longstraw_core import models
from longstraw_core.config import load_config

pytestmark = pytest.mark.multiprocess

# One piece per replayed branch: one process's replay arithmetic, so a two-stage run differs
# from one process only by the clip norm's order of summation (pieces change where float32
# rounds, and AdamW's first step turns a near-zero gradient's rounding into a whole step;
# tests/pipeline/test_pipeline.py compares replay in pieces in float64).
ONE_PIECE = "distributed.replay_pieces=1"
STAGED = ["distributed.pipeline_stages=2", "train.save_every=1", ONE_PIECE]
# Evaluation after every step: three prompts of the task's other seed, greedy and 2 samples.
EVAL = ["eval.every=1", "eval.data.seed=1", "eval.samples=3", "eval.num_generations=2",
        "eval.max_new_tokens=8", "eval.correct_reward=0.2"]  # fmt: skip
CASES = {  # name: (recipe, config, overrides, the (stages, ranks) a checkpoint resumes on)
    "qwen36-full-exact": ("grpo_qwen36.py", QWEN, ["grpo.gradient=exact"], [(1, 1), (4, 4)]),
}  # fmt: skip
# LoRA on stages (and its checkpoints across stage counts) is tests/pipeline/test_pipeline.py's.


def assert_close(
    first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], tolerance: float
) -> None:
    """Every tensor within ``tolerance`` of the other's largest entry: the stages sum the
    clip's norm in another order, so float32 rounding differs; AdamW then magnifies it in
    tiny gradient entries (m / sqrt(v)), which a second step shows."""
    assert first.keys() == second.keys()
    for name in first:
        scale = float(second[name].abs().max())
        assert float((first[name] - second[name]).abs().max()) <= tolerance * scale, name


def eval_metrics(checkpoint: Path) -> dict[int, dict[str, float]]:
    """The ``eval/...`` metrics a run logged, by step (its checkpoint's logger history)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    history = state["extra"]["logger"]["history"]
    return {step: {k: v for k, v in m.items() if k.startswith("eval/")} for step, m in history}


def assert_same_eval(first: dict[str, float], second: dict[str, float]) -> None:
    """The same eval metrics: the same completions, so the same rewards (and sums)."""
    assert first and first.keys() == second.keys()
    for key, value in first.items():
        assert value == pytest.approx(second[key], rel=1e-9, abs=1e-12), key


def optimizer_moments(directory: Path) -> dict[int, dict[str, torch.Tensor]]:
    return torch.load(directory / "optimizer.pt", weights_only=True)["state"]


@pytest.mark.parametrize("case", list(CASES))
def test_staged_run_trains_like_one_process_and_resumes_at_any_stage_count(tmp_path, case):
    recipe, config_path, extra, resume_on = CASES[case]
    one, staged, stopped = tmp_path / "one", tmp_path / "staged", tmp_path / "stopped"
    log = run_on_ranks(
        recipe, config_path, staged, "train.steps=2", *STAGED, *extra, *EVAL, ranks=2
    )
    assert log.count("step 2/2") == 1, "only rank 0 prints the per-step line"
    run_on_ranks(
        recipe, config_path, one, "train.steps=2", "train.save_every=1", *extra, *EVAL, ranks=1
    )
    # Eval on two stages: the completions and metrics of one process (after step 1, whose
    # weights agree to float32 rounding; step 2's differ by AdamW's magnification of it).
    assert_same_eval(eval_metrics(staged / "step-000002")[1], eval_metrics(one / "step-000002")[1])
    final = tensors(staged / "step-000002/model")
    assert any(
        not torch.equal(tensors(staged / "step-000001/model")[n], final[n]) for n in final
    ), "the second step changed nothing"
    # One step: the gradients' float32 rounding; two: AdamW's magnification of it.
    assert_close(tensors(staged / "step-000001/model"), tensors(one / "step-000001/model"), 1e-6)
    assert_close(final, tensors(one / "step-000002/model"), 1e-3)
    for index, moments in optimizer_moments(one / "step-000001").items():
        for key, value in moments.items():
            saved = optimizer_moments(staged / "step-000001")[index][key]
            assert float((saved - value).abs().max()) <= 1e-5 * float(value.abs().max())

    # Stopped after step 1 (the staged run's checkpoint of it) and resumed on two stages:
    # bit-equal to the uninterrupted run.
    stopped_at(staged, 1, stopped)
    for stages, ranks in resume_on:  # the same step-1 checkpoint, other stage counts
        other = tmp_path / f"resumed-S{stages}"
        shutil.copytree(stopped, other)
        overrides = [f"distributed.pipeline_stages={stages}", "train.save_every=1", ONE_PIECE]
        run_on_ranks(recipe, config_path, other, "train.steps=2", "train.resume_from=latest",
            *overrides, *extra, ranks=ranks)  # fmt: skip
        assert_close(tensors(other / "step-000002/model"), final, 1e-3)
        state = json.loads((other / "step-000002" / "trainer_state.json").read_text())
        assert (state["step"], state["data_position"]) == (2, 2)  # one replica: one sample a step
    run_on_ranks(recipe, config_path, stopped, "train.steps=2", "train.resume_from=latest", *STAGED,
        *extra, *EVAL, ranks=2)  # fmt: skip
    # The eval schedule survives the resume: both steps evaluated, each as uninterrupted.
    assert eval_metrics(stopped / "step-000002") == eval_metrics(staged / "step-000002")
    resumed = tensors(stopped / "step-000002/model")
    assert resumed.keys() == final.keys()
    for name in final:
        assert torch.equal(resumed[name], final[name]), name
    assert_same_optimizer_state(staged / "step-000002", stopped / "step-000002")


def test_fsdp_across_replicas_trains_like_averaged_replicas(tmp_path):
    """Two stages x two replicas, each stage sharded over its replicas by FSDP2
    (``distributed.fsdp=true``), train like the same stages whose replicas average their
    gradients, and the sharded run's checkpoint resumes unsharded and ends where that run
    does. Both evaluate three prompts on their two replicas (the sharded one's second replica
    runs a third prompt it drops, as its ranks gather together): the same eval metrics."""
    recipe, overrides = "grpo_qwen36.py", [*STAGED, "grpo.gradient=exact"]
    sharded, averaged, resumed = tmp_path / "fsdp", tmp_path / "averaged", tmp_path / "resumed"
    log = run_on_ranks(recipe, QWEN, sharded, "train.steps=2", "distributed.fsdp=true", *overrides,
              *EVAL, ranks=4)  # fmt: skip
    assert log.count("step 2/2") == 1, "only rank 0 prints the per-step line"
    run_on_ranks(recipe, QWEN, averaged, "train.steps=2", *overrides, *EVAL, ranks=4)
    assert_same_eval(
        eval_metrics(sharded / "step-000002")[1], eval_metrics(averaged / "step-000002")[1]
    )
    first, final = tensors(averaged / "step-000001/model"), tensors(averaged / "step-000002/model")
    assert_close(tensors(sharded / "step-000001/model"), first, 1e-6)
    assert_close(tensors(sharded / "step-000002/model"), final, 1e-3)
    for step in ("step-000001", "step-000002"):
        state = json.loads((sharded / step / "trainer_state.json").read_text())
        assert state["data_position"] == 2 * int(step[-1])  # two replicas: two samples a step
    shutil.copytree(sharded, resumed)
    shutil.rmtree(resumed / "step-000002")
    (resumed / "latest").unlink(missing_ok=True)
    run_on_ranks(
        recipe, QWEN, resumed, "train.steps=2", "train.resume_from=latest", *overrides, ranks=4
    )
    assert_close(tensors(resumed / "step-000002/model"), final, 1e-3)


@pytest.mark.parametrize("base", ["toy", "checkpoint"])
def test_qlora_on_stages_trains_like_one_process(base, tmp_path):
    """A 4-bit (NF4) base under LoRA on two stages: each stage quantizes its own layers the
    same way, and one exact step's adapters equal one process's within float32 rounding.
    ``toy``: the random-init toy, built whole and quantized on every rank; ``checkpoint``:
    its weights saved, each stage reading and quantizing only its own (``loading``)."""
    config_path = "configs/qwen36/tiny_qlora_grpo_cpu.yaml"
    overrides = ["grpo.gradient=exact", "train.steps=1", "train.save_every=1"]
    if base == "checkpoint":
        toy = load_config(ROOT / config_path, [*SMALL, "model.quantization=null"])
        models.build_model(toy.model, seed=toy.train.seed).save_pretrained(tmp_path / "base")
        overrides += [
            "model.tiny=null",
            "model.tiny_overrides={}",
            f"model.path={tmp_path / 'base'}",
            "tokenizer.path=builtin:bytes",  # the toy's ids; its directory holds no tokenizer
        ]
    staged, one = tmp_path / "staged", tmp_path / "one"
    run_on_ranks("grpo_qwen36.py", config_path, staged, *overrides, "distributed.pipeline_stages=2",
        ranks=2)  # fmt: skip
    run_on_ranks("grpo_qwen36.py", config_path, one, *overrides, ranks=1)
    adapters = tensors(staged / "step-000001/model")
    assert adapters and all("lora_" in name for name in adapters)  # the base is not saved
    assert any(float(v.abs().max()) > 0 for n, v in adapters.items() if "lora_B" in n)  # moved
    assert_close(adapters, tensors(one / "step-000001/model"), 1e-5)


def test_bad_stage_settings_stop_before_training(tmp_path):
    """Three stages on two processes, stage starts that do not match the stage count."""
    cases = [
        (2, ["distributed.pipeline_stages=3"], "does not divide the 2 processes"),
        (1, ["distributed.stage_starts=[0, 2]"], "distributed.stage_starts"),
    ]
    for ranks, overrides, message in cases:
        args = ["--config", str(ROOT / QWEN), *SMALL, f"train.output_dir={tmp_path / 'run'}"]
        returncode, log = launch_recipe("grpo_qwen36.py", *args, *overrides, ranks=ranks)
        assert returncode != 0 and message in log, (overrides, log[-3000:])
        assert "distributed.pipeline_stages" in log or "distributed.stage_starts" in log
        assert not (tmp_path / "run" / "latest").exists()
