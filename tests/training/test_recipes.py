"""The recipes through their real entry points (subprocesses), on tiny CPU configs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import datasets
import pytest
import torch
from recipe_runs import (
    ROOT,
    assert_resumed_like_straight,
    run_recipe,
    stopped_at,
    train_in_process,
    weights,
)
from wandb_records import wandb_history, wandb_records


@pytest.mark.parametrize(
    ("recipe", "config", "extra"),
    [
        ("grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml", ["grpo.gradient=exact"]),
        ("grpo_qwen36.py", "configs/qwen36/tiny_lora_grpo_cpu.yaml", ["grpo.gradient=detached"]),
        ("grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml", ["grpo.gradient=exact"]),
        ("grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml",
         ["grpo.gradient=detached", "lora.enabled=true", "grpo.beta=0.04",
          "rollout.temperature=0.7"]),  # sampled and scored at 0.7
        ("grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml",
         ["grpo.gradient=exact", "offload.attention=cpu", "offload.recurrent=cpu",
          "offload.resident_layers=1"]),
        ("grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml",
         ["grpo.gradient=exact", "offload.latent=cpu"]),
        # Eight hybrid layers: a full-attention layer that is not the (state-only) last.
        ("grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml",
         ["grpo.gradient=exact", "grpo.keep_attention_outputs=true",
          "model.tiny_overrides.num_hidden_layers=8"]),
    ],
)  # fmt: skip
def test_recipe_runs_logs_and_checkpoints(tmp_path, recipe, config, extra):
    out = tmp_path / "run"
    result = run_recipe(recipe, config, out, "train.steps=2", "train.save_every=2", *extra)
    assert "step 2/2" in result.stdout + result.stderr
    assert "gemm_4bit_forward" not in result.stdout + result.stderr  # bitsandbytes' notice
    # transformers' "falling back to its reference PyTorch implementation ... much slower":
    # the adapters call the pure-torch functions themselves where fla / causal-conv1d do not
    # run (CPU), so nothing falls back.
    assert "much slower" not in result.stdout + result.stderr
    # The step line shows what the recipe emits: completion length, tokens/s, peak memory.
    assert re.search(r"step 2/2 .* len \d+ +tok/s [\d,]+ +peak [\d.]+ \w+", result.stdout)
    assert (out / "latest").read_text().strip() == "step-000002"
    state = json.loads((out / "step-000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data_position"] == 2
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    # TRL's W&B names: a TRL dashboard's panels (train/reward, train/loss) show this run.
    logged = wandb_history(wandb_records(run_file))
    assert {"train/reward", "train/loss", "train/global_step"} <= logged[2].keys()
    assert "reward" not in logged[2] and logged[2]["train/global_step"] == 2
    # The summary: TRL's headline on the console, reward first; every metric beside the run.
    assert re.search(r"\nreward +[-\d.e+]+ .*\nreward_std .*\nloss ", result.stdout)
    assert "\ngrad_norm " not in result.stdout
    assert "\ngrad_norm " in "\n" + (out / "summary.txt").read_text()
    # The completions table: TRL's columns (prompt, completion, each reward, advantage).
    table = next((out / "wandb").glob("offline-run-*/files/media/table/completions_*.json"))
    assert json.loads(table.read_text())["columns"] == [
        "sample", "answer", "prompt", "completion", "answer_char_recall", "reward", "advantage",
    ]  # fmt: skip
    if "lora" in config or "lora.enabled=true" in extra:
        assert list((out / "step-000002").rglob("adapter_config.json")), "adapters not saved"
    kept = [metrics["attention_output_bytes"] for _, metrics in state["extra"]["logger"]["history"]]
    assert all(kept) if "grpo.keep_attention_outputs=true" in extra else not any(kept)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # Two prompts per step, two optimizer steps per rollout, the step's reward std: the
        # checkpoint at step 2 falls between the two rollouts.
        ["train.prompts_per_step=2", "grpo.num_iterations=2", "grpo.scale_rewards=batch"],
    ],
)
def test_resumed_run_equals_uninterrupted_run(tmp_path, extra):
    config = "configs/qwen36/tiny_learn_cpu.yaml"  # rewards with variance from the start
    # The run stopped after step 2 is the straight run's checkpoint of step 2, resumed in a
    # new process (a run that ended at train.steps=2 and goes on to 4:
    # test_resuming_with_another_length_says_the_schedule_changes).
    common = ["train.save_every=2", "grpo.gradient=exact", "rollout.num_generations=8",
              "rollout.max_new_tokens=16", "eval.every=0", *extra]  # fmt: skip
    straight = tmp_path / "straight"
    run_recipe("grpo_qwen36.py", config, straight, "train.steps=4", *common)
    stopped = stopped_at(straight, 2, tmp_path / "stopped")
    run_recipe("grpo_qwen36.py", config, stopped, "train.steps=4", "train.resume_from=latest",
               *common)  # fmt: skip

    assert_resumed_like_straight(
        weights(straight / "step-000004"),
        weights(stopped / "step-000004"),
        weights(straight / "step-000002"),
    )
    states = [
        json.loads((run / "step-000004" / "trainer_state.json").read_text())
        for run in (straight, stopped)
    ]
    # Samples drawn: one per step, or two per rollout of two steps.
    assert states[0]["data_position"] == states[1]["data_position"] == 4
    history = [state["extra"]["logger"] for state in states]
    assert history[0] == history[1] or _same_metrics(history[0], history[1])


# A TRL dataset as TRL's examples have them: `prompt` and `solution`, no `answer`; the reward
# reads the `solution` column (tests/support/trl_rewards.py). Solutions with many distinct characters
# give even a random toy's groups reward variance, so every step trains.
SOLVED = [
    ("Name the colours of the rainbow.", "red, orange, yellow, green, blue, violet"),
    ("Count to twelve.", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"),
    ("Spell the alphabet backwards.", "zyxwvutsrqponmlkjihgfedcba"),
]
TRL_DATA = ["data.task=null", "data.prompt_tokens=256", "tracking.wandb=false",
            "rollout.num_generations=8", "rollout.max_new_tokens=12", "grpo.gradient=detached",
            "rewards=[{name: 'trl_rewards:solution_char_recall'}]"]  # fmt: skip


def test_both_recipes_show_the_same_loop_in_plain_formatted_code():
    """What a user copies: one GRPO loop (rollout, rewards, advantages computed in the
    recipe, grpo_step, optimizer step, metrics), the same in both recipes (a family differs
    by its docstring and default config), with no formatter exemptions."""
    loops = {}
    for recipe in ("grpo_qwen36.py", "grpo_glm52.py"):
        text = (ROOT / "recipes" / recipe).read_text()
        assert "fmt: skip" not in text and "fmt: off" not in text, recipe
        loop = text[text.index("class Recipe(") : text.index("def main(")]
        for call in ("self.rollout(", "self.score(", "ls.group_advantages(", "ls.grpo_step("):
            assert call in loop, (recipe, call)
        assert "batch.replay_kwargs(k, advantages)" in loop, recipe  # the replay takes them
        loops[recipe] = loop
    assert loops["grpo_qwen36.py"] == loops["grpo_glm52.py"]


def test_trl_standard_jsonl_trains_unchanged(tmp_path):
    """Plain-text prompts (no chat template, as TRL) with a `solution` column, as JSONL, with
    the generation options TRL has (min_p, repetition_penalty, stop strings)."""
    path = tmp_path / "trl.jsonl"
    datasets.Dataset.from_list([{"prompt": p, "solution": s} for p, s in SOLVED]).to_json(path)
    out = train_in_process(
        "grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml", tmp_path / "run", *TRL_DATA,
        f"data.path={path}", "train.steps=2", "train.save_every=2", "rollout.stop=['.']",
        "rollout.min_p=0.05", "rollout.repetition_penalty=1.2", "tracking.wandb=true",
    )  # fmt: skip
    state = json.loads((out / "step-000002" / "trainer_state.json").read_text())
    assert state["data_position"] == 2
    history = state["extra"]["logger"]["history"]
    assert all(m["rewards/solution_char_recall/std"] > 0 for _, m in history)  # the column scored
    # The completions table shows the dataset's own answer column, not an empty `answer`.
    table = json.loads(
        next(out.glob("wandb/offline-run-*/files/media/table/completions_1_*")).read_text()
    )
    assert table["columns"][:3] == ["sample", "solution", "prompt"]
    assert "answer" not in table["columns"]
    solutions = {row[1] for row in table["data"]}
    assert solutions and solutions <= {s for _, s in SOLVED}


def test_trl_conversational_dataset_dict_resumes_like_an_uninterrupted_run(tmp_path):
    """Message prompts with `solution` in one split of a saved DatasetDict, shuffled: a run
    stopped after a step and resumed (across the end of the first pass over the two rows)
    equals the uninterrupted run bit for bit."""
    rows = [{"prompt": [{"role": "user", "content": p}], "solution": s} for p, s in SOLVED]
    splits = {"train": rows[:1], "test": rows[1:]}
    path = tmp_path / "trl_splits"
    datasets.DatasetDict(
        {k: datasets.Dataset.from_list(v) for k, v in splits.items()}
    ).save_to_disk(path)
    config = "configs/qwen36/tiny_grpo_cpu.yaml"
    common = [*TRL_DATA, f"data.path={path}", "data.split=test", "data.seed=1",
              "data.chat_template_kwargs={enable_thinking: false}", "train.save_every=1",
              "optim.scheduler=constant"]  # fmt: skip
    straight = train_in_process(
        "grpo_qwen36.py", config, tmp_path / "straight", "train.steps=3", *common
    )
    stopped = train_in_process(
        "grpo_qwen36.py", config, tmp_path / "stopped", "train.steps=1", *common
    )
    train_in_process(
        "grpo_qwen36.py", config, stopped, "train.steps=3", "train.resume_from=latest", *common
    )
    first, second = weights(straight / "step-000003"), weights(stopped / "step-000003")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    initial = weights(straight / "step-000001")
    assert any(not torch.equal(initial[n], first[n]) for n in first), "training changed nothing"


def test_resuming_with_another_length_says_the_schedule_changes(tmp_path):
    """A cosine schedule is built over train.steps: resuming with more steps moves the
    learning rate onto another curve, which the run says (a constant one changes nothing)."""
    out = tmp_path / "run"
    common = ["train.save_every=1", "optim.scheduler=cosine", "grpo.gradient=detached"]
    config = "configs/qwen36/tiny_grpo_cpu.yaml"
    run_recipe("grpo_qwen36.py", config, out, "train.steps=1", *common)
    longer = run_recipe(
        "grpo_qwen36.py", config, out, "train.steps=2", "train.resume_from=latest", *common
    )
    assert "was built for 1 steps" in longer.stderr and "set train.steps=1" in longer.stderr
    same = run_recipe(
        "grpo_qwen36.py", config, out, "train.steps=2", "train.resume_from=latest", *common
    )  # resumes step 2 of 2: nothing left to run, and the same length
    assert "learning-rate schedule" not in same.stderr


def _same_metrics(a: dict, b: dict) -> bool:
    """Histories equal except wall-clock timings."""

    def strip(history: dict) -> list:
        return [
            (step, {k: v for k, v in m.items() if "time" not in k and "seconds" not in k
                    and "per_second" not in k and "peak" not in k})
            for step, m in history["history"]
        ]  # fmt: skip

    return strip(a) == strip(b)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.stepz=3", "train.stepz"),
        ("rollout.num_generations=-2", "rollout.num_generations"),
        ("model.tiny=null", "model"),
        ("data.prompt_tokens=100000", "data.prompt_tokens"),
    ],
)
def test_bad_config_fails_fast_naming_the_key(tmp_path, override, key):
    result = run_recipe(
        "grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml", tmp_path / "bad", override,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert key in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


def test_a_step_the_budget_cannot_hold_is_refused_before_loading(tmp_path):
    """The memory planner runs before any weight is built and names what to change."""
    result = run_recipe(
        "grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml", tmp_path / "tight",
        "memory.gpu_mem=4MiB", check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "memory plan: predicted" in result.stderr, result.stderr[-2000:]
    assert "4.00 MiB" in result.stderr or "budget" in result.stderr
    assert "python -m longstraw_core.plan" in result.stderr
    assert not (tmp_path / "tight").exists()


@pytest.mark.slow
def test_tiny_learn_config_raises_the_reward(tmp_path):
    """GRPO alone moves a random toy: last 10 steps' mean reward >= first 10's + 0.3.

    The config's fixed seed gives about +0.55 (0.07 -> 0.63) in ~1 min on one core; one
    thread, because another thread count can change float sums and so the sampled curve.
    """
    import os

    command = [sys.executable, str(ROOT / "recipes/grpo_qwen36.py"), "--config",
               str(ROOT / "configs/qwen36/tiny_learn_cpu.yaml"), "tracking.wandb=false",
               f"train.output_dir={tmp_path / 'learn'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True, env=env)
    rewards = [
        float(r)
        for r in re.findall(r"step \d+/\d+\s+reward ([0-9.]+)", result.stdout + result.stderr)
    ]
    assert len(rewards) >= 20, result.stderr[-2000:]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    curve = [round(sum(rewards[i : i + 10]) / 10, 2) for i in range(0, len(rewards) - 9, 10)]
    assert last >= first + 0.3, f"first 10 steps {first:.3f}, last 10 {last:.3f}; {curve}"
