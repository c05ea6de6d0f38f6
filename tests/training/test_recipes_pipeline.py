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
import re
import shutil
from pathlib import Path

import launch
import pytest
import torch
from recipe_runs import (
    GROUP,
    QWEN,
    ROOT,
    SMALL,
    assert_same_optimizer_state,
    launch_recipe,
    run_on_ranks,
    stopped_at,
    tensors,
)
from reference import float32_sum_rtol

from longstraw_core.config import load_config
from longstraw_core.models import build as models

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


# float32 round-off of the gradients two layouts sum in another order (stages: the clip's
# norm; FSDP: the replicas' reduce-scatter against their all-reduce): each entry sums the
# GROUP branches of two replicas, so float32's bound for 2 x GROUP terms, relative to the
# model's largest gradient entry (4.8e-7; measured 1.9e-7, issue 38).
GRAD_RTOL = float32_sum_rtol(2 * GROUP)
# The config's optim.lr and betas; AdamW's default eps.
LR, ADAM_EPS, BETA1, BETA2 = 1e-4, 1e-8, 0.9, 0.999
F32 = torch.finfo(torch.float32).eps


def parameter_names(config_path: str) -> list[str]:
    """The trainable parameters' names in the optimizer's order (its state is by index)."""
    cfg = load_config(ROOT / config_path, SMALL)
    model = models.build_model(cfg.model, seed=cfg.train.seed)
    return [name for name, p in model.named_parameters() if p.requires_grad]


def assert_first_step_close(run: Path, reference: Path, config_path: str) -> None:
    """One AdamW step of two layouts: the gradients (first moment / (1 - beta1)) within
    ``GRAD_RTOL`` of the largest, and each weight within what AdamW makes of that.

    The first step moves an entry by ``lr g / (|g| + eps)``: whole steps of +-lr wherever
    |g| >> eps, so a gradient entry within round-off of zero (1.7e-10 against 2.4e-10 in
    issue 38) moves its weight by a fraction of lr (6.5e-7 there), up to 2 lr where the
    round-off flips its sign. With ``delta`` the gradients' bound, the step's change is at
    most ``lr delta eps / (max(|g| - delta, 0) + eps)^2`` (the slope of g / (|g| + eps) over
    g +- delta) and at most 2 lr; plus the update's own rounding (2 eps32 (|w| + lr)).
    """
    ours, theirs = (optimizer_moments(d / "step-000001") for d in (run, reference))
    names = parameter_names(config_path)
    assert len(names) == len(theirs) == len(ours)
    grads = {names[i]: state["exp_avg"] / (1 - BETA1) for i, state in theirs.items()}
    largest = max(float(g.abs().max()) for g in grads.values())
    delta = GRAD_RTOL * largest
    weights, expected = (tensors(d / "step-000001/model") for d in (run, reference))
    for i, state in theirs.items():
        name, g = names[i], grads[names[i]]
        err = float((ours[i]["exp_avg"] / (1 - BETA1) - g).abs().max())
        assert err <= delta, f"{name}: gradient off by {err:.3e} > {GRAD_RTOL:.1e} x {largest:.3e}"
        # the second moment is (1 - beta2) g^2: off by at most (1 - beta2)(2 |g| delta + delta^2)
        err = float((ours[i]["exp_avg_sq"] - state["exp_avg_sq"]).abs().max())
        assert err <= (1 - BETA2) * (2 * largest + delta) * delta * (1 + 4 * F32), name
        reach = (g.abs() - delta).clamp_min(0)
        slope = (delta * ADAM_EPS / (reach + ADAM_EPS) ** 2).clamp_max(2.0)
        bound = LR * slope + 2 * F32 * (expected[name].abs() + LR)
        diff = (weights[name] - expected[name]).abs()
        assert bool((diff <= bound).all()), (
            f"{name}: {int((diff > bound).sum())} weights beyond AdamW's bound "
            f"(largest difference {float(diff.max()):.3e})"
        )


def assert_later_steps_close(
    run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], previous: dict, steps: int
) -> None:
    """Weights of two runs ``steps`` AdamW steps after the weights they shared (the same
    init, or the same checkpoint); ``previous``: the reference's weights a step before.

    An entry whose gradient round-off decides its sign can move a whole step the other way,
    and every later gradient differs by what that changed: each entry within 2 lr x 1.002 a
    step (|m_hat| / sqrt(v_hat) <= 1.002 at betas (0.9, 0.999) for two steps, by
    Cauchy-Schwarz); and such entries are few (1 of 184924 in issue 38), so over the model
    the difference is at most 5% of the last step's update (measured 0.07%)."""
    assert run.keys() == reference.keys()
    per_entry = steps * 2 * 1.002 * LR
    for name, want in reference.items():
        err = float((run[name] - want).abs().max())
        assert err <= per_entry + 2 * F32 * float(want.abs().max()), f"{name}: {err:.3e}"
    diff = sum(float(((run[n] - w) ** 2).sum()) for n, w in reference.items()) ** 0.5
    update = sum(float(((w - previous[n]) ** 2).sum()) for n, w in reference.items()) ** 0.5
    assert update > 0, "the steps changed nothing"
    assert diff <= 0.05 * update, f"weights off by {diff:.3e}, 5% of the update {update:.3e}"


def assert_close(
    first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], tolerance: float
) -> None:
    """Every tensor within ``tolerance`` of the other's largest entry."""
    assert first.keys() == second.keys()
    for name in first:
        scale = float(second[name].abs().max())
        diff = (first[name] - second[name]).abs()
        err = float(diff.max())
        assert err <= tolerance * scale, (
            f"{name}: max error {err:.3e} > {tolerance:.1e} x largest entry {scale:.3e} "
            f"({int((diff > tolerance * scale).sum())} of {diff.numel()} entries)"
        )


def logged_metrics(checkpoint: Path) -> dict[int, dict[str, float]]:
    """Every metric a run logged, by step (its checkpoint's logger history)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return dict(state["extra"]["logger"]["history"])


def eval_metrics(checkpoint: Path) -> dict[int, dict[str, float]]:
    """The ``eval/...`` metrics a run logged, by step."""
    return {step: {k: v for k, v in m.items() if k.startswith("eval/")}
            for step, m in logged_metrics(checkpoint).items()}  # fmt: skip


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
    assert log.count("step 2/2  ") == 1, "only rank 0 prints the per-step line"
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
    assert_first_step_close(staged, one, config_path)
    first = tensors(one / "step-000001/model")
    assert_later_steps_close(final, tensors(one / "step-000002/model"), first, steps=2)

    # Stopped after step 1 (the staged run's checkpoint of it) and resumed on two stages:
    # bit-equal to the uninterrupted run.
    stopped_at(staged, 1, stopped)
    staged_first = tensors(staged / "step-000001/model")
    for stages, ranks in resume_on:  # the same step-1 checkpoint, other stage counts
        other = tmp_path / f"resumed-S{stages}"
        shutil.copytree(stopped, other)
        overrides = [f"distributed.pipeline_stages={stages}", "train.save_every=1", ONE_PIECE]
        run_on_ranks(recipe, config_path, other, "train.steps=2", "train.resume_from=latest",
            *overrides, *extra, ranks=ranks)  # fmt: skip
        assert_later_steps_close(tensors(other / "step-000002/model"), final, staged_first, 1)
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


def test_more_stages_than_branches_train_like_one_process(tmp_path):
    """Two branches on three and on four stages (G < S, where one NCCL stream per rank
    would hang the ring's rollout: ``longstraw_core.pipeline.transport``), and the greedy
    evaluation's one branch on them: one step and its eval metrics equal one process's.
    The reward differs between the two branches, so the step trains, and between ranks
    (constant but on the last): the stages train on the last stage's one scoring
    (``prompt_group.score_once``); scored on each stage, the others would skip the
    replays the last stage runs. Under the tests' NCCL-rules harness, as every torchrun here."""
    overrides = ["train.steps=1", "train.save_every=1", "rollout.num_generations=2", *EVAL,
                 "rewards=[{name: 'varied_reward:differs_by_rank'}]"]  # fmt: skip
    one = tmp_path / "one"
    run_on_ranks("grpo_qwen36.py", QWEN, one, *overrides, ranks=1)
    for stages in (3, 4):  # the tiny Qwen3.6 has four layers
        staged = tmp_path / f"S{stages}"
        log = run_on_ranks("grpo_qwen36.py", QWEN, staged, *overrides, ONE_PIECE,
            f"distributed.pipeline_stages={stages}", "train.progress_every_seconds=0",
            ranks=stages)  # fmt: skip
        assert log.count("step 1/1  ") == 1, "only rank 0 prints the per-step line"
        assert f"pipeline stages x replicas {stages} x 1; FSDP off" in log
        # Progress inside the step from rank 0 (stage 0) alone: each pass starts once, and
        # the replay counts both branches (its line at the second, and its last line).
        for name in ("prefill", "rollout", "replay", "replay: sweep"):
            starts = re.findall(rf"^step 1/1 {name}: +0% 0(?:\.00)?/", log, re.M)
            assert len(starts) == 1, log[-5000:]
        assert log.count("step 1/1 replay: 100% 2/2 branch ") == 2, log[-5000:]
        assert_same_eval(
            eval_metrics(staged / "step-000001")[1], eval_metrics(one / "step-000001")[1]
        )
        # rank 0 logs the rewards the last stage scored (what the loss there trained on)
        logged_reward = [logged_metrics(d / "step-000001")[1]["reward"] for d in (staged, one)]
        assert logged_reward[0] == pytest.approx(logged_reward[1], rel=1e-9)
        assert_first_step_close(staged, one, QWEN)


def test_fsdp_across_replicas_trains_like_averaged_replicas(tmp_path, monkeypatch):
    """Two stages x two replicas, each stage sharded over its replicas by FSDP2
    (``distributed.fsdp=true``), train like the same stages whose replicas average their
    gradients, and the sharded run's checkpoint resumes unsharded and ends where that run
    does. Both evaluate three prompts on their two replicas (the sharded one's second replica
    runs a third prompt it drops, as its ranks gather together): the same eval metrics."""
    recipe, overrides = "grpo_qwen36.py", [*STAGED, "grpo.gradient=exact"]
    sharded, averaged, resumed = tmp_path / "fsdp", tmp_path / "averaged", tmp_path / "resumed"
    # The sharded run's ranks at 2 threads, the averaged run's at 1: the bounds also hold
    # where a thread count changes where the sums split (issue 38).
    monkeypatch.setenv(launch.RANK_THREADS, "2")
    log = run_on_ranks(recipe, QWEN, sharded, "train.steps=2", "distributed.fsdp=true", *overrides,
              *EVAL, ranks=4)  # fmt: skip
    monkeypatch.delenv(launch.RANK_THREADS)
    assert log.count("step 2/2  ") == 1, "only rank 0 prints the per-step line"
    run_on_ranks(recipe, QWEN, averaged, "train.steps=2", *overrides, *EVAL, ranks=4)
    assert_same_eval(
        eval_metrics(sharded / "step-000002")[1], eval_metrics(averaged / "step-000002")[1]
    )
    first, final = tensors(averaged / "step-000001/model"), tensors(averaged / "step-000002/model")
    assert_first_step_close(sharded, averaged, QWEN)
    assert_later_steps_close(tensors(sharded / "step-000002/model"), final, first, steps=2)
    for step in ("step-000001", "step-000002"):
        state = json.loads((sharded / step / "trainer_state.json").read_text())
        assert state["data_position"] == 2 * int(step[-1])  # two replicas: two samples a step
    shutil.copytree(sharded, resumed)
    shutil.rmtree(resumed / "step-000002")
    (resumed / "latest").unlink(missing_ok=True)
    run_on_ranks(
        recipe, QWEN, resumed, "train.steps=2", "train.resume_from=latest", *overrides, ranks=4
    )
    assert_later_steps_close(tensors(resumed / "step-000002/model"), final, first, steps=1)


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
