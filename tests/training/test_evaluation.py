"""Evaluation during training (``longstraw_core.training.evaluation``, config section ``eval``).

A tiny recipe run evaluates after its last step: its greedy completions are transformers'
``generate(do_sample=False)`` on the trained model, its samples ``ls.rollout`` with the
documented seeds, and every ``eval/...`` metric W&B recorded equals a direct computation from
those completions and the reward function called on them. A run with eval trains exactly as
one without (weights, data position, training metrics), even when the reward function draws
from the global random streams. TRL's reward and completion statistics are checked against
TRL's own formulas; bad eval settings fail at config load (or, for the data, before the model
loads) naming the key. Eval on pipeline stages and FSDP replicas: tests/training/test_recipes_pipeline.py
and tests/training/test_recipes_distributed.py.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import datasets
import pytest
import torch
from recipe_runs import ROOT, recipe_in_process, weights
from trl.trainer.utils import nanstd
from varied_reward import even_characters
from wandb_records import wandb_history, wandb_records

import longstraw_core as ls
from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.samples import DataError
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer
from longstraw_core.metrics import names
from longstraw_core.parallel.topology import RunTopology
from longstraw_core.rewards import RewardResult, reward_metrics
from longstraw_core.training import evaluation

QWEN = "configs/qwen36/tiny_grpo_cpu.yaml"
K, NEW, THRESHOLD = 4, 8, 0.5
EVAL = [
    "eval.data.seed=1",  # the task's other prompts
    "eval.samples=3",
    f"eval.num_generations={K}",
    f"eval.max_new_tokens={NEW}",
    f"eval.correct_reward={THRESHOLD}",
]


def test_eval_metrics_are_those_of_its_completions_and_rewards(tmp_path):
    out = tmp_path / "run"
    run = recipe_in_process(
        "grpo_qwen36.py", QWEN, out, "train.steps=2", "eval.every=2", *EVAL,
        "grpo.gradient=detached", "rewards=[{name: 'varied_reward:even_characters'}]",
        "train.completions_every=0",
    )  # fmt: skip
    report = run.evaluation.last
    assert report.step == 2 and [p.index for p in report.prompts] == [0, 1, 2]
    tokenizer, eos = run.tokenizer, run.tokenizer.eos_token_id
    model = run.model.eval()
    rewards = []
    for p in report.prompts:
        sample = run.evaluation.source(p.index)
        assert sample.id == p.sample_id
        ids = torch.tensor(encode_prompt(tokenizer, sample.prompt, {}))
        # The greedy completion is transformers' own greedy decoding of the trained model.
        with torch.no_grad():
            greedy = model.generate(
                ids[None], max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                pad_token_id=eos,
            )[0, len(ids) :]  # fmt: skip
        assert tokenizer.decode(greedy, skip_special_tokens=True) == p.greedy
        # The samples: the rollout's settings, seeded by the prompt's position.
        state = run.adapter.prefill(ids, chunk_size=256)
        sampled = ls.rollout(
            run.adapter, state, K, NEW, temperature=run.cfg.rollout.temperature,
            eos_token_ids=[eos], seed=evaluation.eval_seed(run.cfg.train.seed, p.index),
        )  # fmt: skip
        assert tokenizer.batch_decode(sampled.responses, skip_special_tokens=True) == p.samples
        assert p.lengths == [len(r) for r in sampled.responses]
        assert p.truncated == sampled.truncated
        rewards.append(even_characters([p.greedy, *p.samples]))  # the reward, called directly
    greedy_rewards = [r[0] for r in rewards]
    hits = [[r >= THRESHOLD for r in row[1:]] for row in rewards]
    sampled_rewards = [r for row in rewards for r in row[1:]]
    lengths = [n for p in report.prompts for n in p.lengths]
    expected = {
        "eval/greedy_accuracy": sum(r >= THRESHOLD for r in greedy_rewards) / 3,
        "eval/greedy_reward": sum(greedy_rewards) / 3,
        f"eval/pass@{K}": sum(any(h) for h in hits) / 3,
        "eval/pass@1": sum(sum(h) / K for h in hits) / 3,
        "eval/reward": sum(sampled_rewards) / len(sampled_rewards),
        "eval/reward_std": statistics.stdev(sampled_rewards),  # TRL's nanstd: Bessel-corrected
        "eval/rewards/even_characters/mean": sum(sampled_rewards) / len(sampled_rewards),
        "eval/completions/mean_length": sum(lengths) / len(lengths),
        "eval/completions/max_length": max(lengths),
    }
    # Both correct and incorrect completions, so the threshold is exercised.
    assert 0 < sum(map(sum, hits)) < 3 * K, rewards
    logged = wandb_history(wandb_records(next(out.glob("wandb/offline-run-*/run-*.wandb"))))
    assert not any(key.startswith("eval/") for key in logged[1]), "eval only at steps 2, 4, ..."
    for key, value in expected.items():
        assert logged[2][key] == pytest.approx(value, rel=1e-12), key
    assert report.metrics.keys() <= logged[2].keys()


def test_training_with_eval_equals_training_without(tmp_path):
    """LoRA dropout draws from torch's global generator in every replay; the reward draws from
    every global stream, in training and in eval. Eval before the first step (``on_start``,
    logged at step 0) and after each leaves the training's draws, weights, data position and
    metrics exactly as without it."""
    common = [
        "train.steps=2", "train.save_every=2", "grpo.gradient=detached", "lora.dropout=0.1",
        "rewards=[{name: 'varied_reward:even_characters_drawing'}]", "tracking.wandb=false",
    ]  # fmt: skip
    config = "configs/qwen36/tiny_lora_grpo_cpu.yaml"
    plain = recipe_in_process("grpo_qwen36.py", config, tmp_path / "plain", *common)
    evaluated = recipe_in_process(
        "grpo_qwen36.py",
        config,
        tmp_path / "eval",
        *common,
        "eval.every=1",
        *EVAL,
        "eval.on_start=true",
    )
    first, second = (
        weights(run / "step-000002") for run in (tmp_path / "plain", tmp_path / "eval")
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    initial = plain.model  # moved at all: the LoRA B matrices start at zero
    assert any(float(v.abs().max()) > 0 for n, v in initial.named_parameters() if "lora_B" in n)
    assert plain.data_position == evaluated.data_position == 2
    assert [s for s, _ in evaluated.logger.history] == [0, 1, 2]
    at_start = evaluated.logger.history[0][1]
    assert names.EVAL_GREEDY_ACCURACY in at_start and names.REWARD not in at_start
    for (_, without), (_, with_eval) in zip(
        plain.logger.history, evaluated.logger.history[1:], strict=True
    ):
        assert any(key.startswith("eval/") for key in with_eval)
        kept = {k: v for k, v in with_eval.items() if not k.startswith("eval/")}
        assert _training(kept) == _training(without)


def test_a_resumed_run_keeps_the_eval_schedule(tmp_path):
    """Eval every 2 steps of 3 (steps 2 and 3, the last): a run told to stop after step 2
    (its last, and an eval step) and resumed to 3 evaluates where the uninterrupted one does,
    with the same results: the restored history holds step 2's, step 3 evaluates again."""
    common = ["train.save_every=1", "grpo.gradient=detached", "tracking.wandb=false",
              "eval.every=2", *EVAL, "rewards=[{name: 'varied_reward:even_characters'}]"]  # fmt: skip
    straight = recipe_in_process(
        "grpo_qwen36.py", QWEN, tmp_path / "straight", "train.steps=3", *common
    )
    recipe_in_process("grpo_qwen36.py", QWEN, tmp_path / "stopped", "train.steps=2", *common)
    resumed = recipe_in_process(
        "grpo_qwen36.py", QWEN, tmp_path / "stopped", "train.steps=3", "train.resume_from=latest",
        *common,
    )  # fmt: skip

    def evals(run) -> dict[int, dict[str, float]]:
        return {
            step: {k: v for k, v in m.items() if k.startswith("eval/")}
            for step, m in run.logger.history
        }

    assert {s for s, m in evals(straight).items() if m} == {2, 3}
    assert evals(resumed) == evals(straight)


def _training(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics that do not measure time or memory (NaN as a string: NaN != NaN)."""
    timing = ("time/", "seconds", "per_second", "peak")
    return {
        k: "nan" if math.isnan(v) else v
        for k, v in metrics.items()
        if not any(t in k for t in timing)
    }


def test_reward_metrics_of_several_groups_are_trls():
    """TRL's formulas over a batch of groups (GRPOTrainer._generate_and_score_completions):
    nanmean / nanstd over every completion, zero-std share per group, unscorable rows out."""
    nan = math.nan
    groups = [[[1.0, 0.0], [0.5, nan]], [[0.2, 1.0], [0.2, 1.0]], [[nan, nan], [0.0, 2.0]]]
    weights_ = torch.tensor([1.0, 0.5], dtype=torch.float64)
    results = []
    for rows in groups:
        per_func = torch.tensor(rows, dtype=torch.float64)
        summed = (per_func * weights_).nansum(1)
        summed[torch.isnan(per_func).all(1)] = nan
        results.append(RewardResult(["a", "b"], summed.tolist(), rows))
    per_func = torch.tensor([row for rows in groups for row in rows], dtype=torch.float64)
    rewards = torch.tensor([r for res in results for r in res.rewards], dtype=torch.float64)
    std = nanstd(rewards.view(-1, 2), dim=1).repeat_interleave(2)
    got = reward_metrics(results)
    assert got["reward"] == pytest.approx(float(torch.nanmean(rewards)))
    assert got["reward_std"] == pytest.approx(float(nanstd(rewards)))
    assert got["rewards/b/mean"] == pytest.approx(float(torch.nanmean(per_func[:, 1])))
    assert got["rewards/a/std"] == pytest.approx(float(nanstd(per_func[:, 0])))
    zero = torch.isclose(std, torch.zeros_like(std)).double().mean()
    assert got["frac_reward_zero_std"] == pytest.approx(float(zero)) and 0 < float(zero) < 1


def test_completion_metrics_are_trls():
    """GRPOTrainer's completions/* from lengths and truncation flags, and its edge case."""
    lengths = torch.tensor([3, 8, 5, 8])
    truncated = torch.tensor([False, True, False, True])
    got = names.completion_metrics(lengths.tolist(), truncated.tolist())
    ended = lengths[~truncated].float()
    assert got == {
        "completions/mean_length": lengths.float().mean().item(),
        "completions/min_length": lengths.float().min().item(),
        "completions/max_length": lengths.float().max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": ended.mean().item(),
        "completions/min_terminated_length": ended.min().item(),
        "completions/max_terminated_length": ended.max().item(),
    }
    none_ended = names.completion_metrics([4, 4], [True, True])
    assert none_ended["completions/mean_terminated_length"] == 0.0  # TRL's zeros(1)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_json(path)
    return path


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["eval.every=-1"], "eval.every"),
        (["eval.every=1", "eval.data.seed=null"], "eval.data"),  # the training prompts
        (["eval.every=1", "eval.samples=null"], "eval.samples"),  # a task has no end
        (["eval.samples=0"], "eval.samples"),
        (["eval.num_generations=-1"], "eval.num_generations"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens"),
        (["eval.correct_reward=.nan"], "eval.correct_reward"),
        (["eval.every=1", "eval.samples=1", "eval.data.task=nope"], "eval.data.task"),
        (["eval.every=1", "eval.samples=1", "eval.data.path=/nowhere/eval.jsonl"],
         "eval.data.path"),
        (["eval.every=1", "eval.samples=1", "eval.data.seed=1", "eval.data.prompt_tokens=40000"],
         "eval.data.prompt_tokens"),  # prompt + response past the model's positions
        (["eval.every=1", "eval.samples=1", "eval.data.seed=1", "eval.max_new_tokens=64",
          "memory.gpu_mem=80GiB"], "eval.max_new_tokens"),  # beyond the planned step
        (["eval.every=1", "eval.samples=1", "eval.data.task_kwargs={hops: 3}"],
         "eval.data.task_kwargs.hops"),
        (["eval.data.sead=1"], "eval.data.sead"),
        (["eval.on_start=true"], "eval.on_start"),  # with eval.every=0: nothing evaluates
    ],
)  # fmt: skip
def test_bad_eval_settings_fail_at_load_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / QWEN, overrides)
    assert error.value.key == key, str(error.value)


def test_eval_data_without_a_column_a_reward_needs_is_refused(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Count.", "solution": "1 2"}])
    test = _write_jsonl(tmp_path / "test.jsonl", [{"prompt": "Count again."}])
    common = ["data.task=null", f"data.path={train}", "data.prompt_tokens=256",
              "rewards=[{name: 'trl_rewards:solution_char_recall'}]"]  # fmt: skip
    load_config(ROOT / QWEN, common)
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / QWEN, [*common, "eval.every=1", f"eval.data.path={test}"])
    assert error.value.key == "rewards[0].name" and "eval.data" in str(error.value)


def test_eval_data_is_scanned_before_the_model_loads(tmp_path):
    """``Evaluation.from_config`` (what the recipes call before loading weights) refuses a bad
    eval row naming its line, and more eval samples than the eval data holds."""
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Count.", "answer": "1"}])
    rows = [{"prompt": "One.", "answer": "1"}, {"prompt": "Two.", "answer": "2"}]
    test = _write_jsonl(tmp_path / "test.jsonl", rows)
    common = ["data.task=null", f"data.path={train}", "data.prompt_tokens=256",
              "rewards=[{name: exact_match}]", "eval.every=1", f"eval.data.path={test}",
              "eval.samples=null"]  # fmt: skip
    topology = RunTopology(replicas=1, replica=0)
    tokenizer = load_tokenizer(None)
    cfg = load_config(ROOT / QWEN, common)
    assert evaluation.Evaluation.from_config(cfg, tokenizer, topology).count == 2  # null: all
    cfg = load_config(ROOT / QWEN, [*common, "eval.samples=3"])
    with pytest.raises(DataError, match=r"eval.samples=3 .* at most 2"):
        evaluation.Evaluation.from_config(cfg, tokenizer, topology)
    test.write_text('{"prompt": "One.", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    cfg = load_config(ROOT / QWEN, common)
    with pytest.raises(DataError, match=r"^eval.data: .*test.jsonl:2"):
        evaluation.Evaluation.from_config(cfg, tokenizer, topology)


def test_eval_data_inherits_the_training_data_settings():
    from longstraw_core.config import eval_data

    cfg = load_config(ROOT / QWEN, ["eval.data.seed=1", "data.task_kwargs={digits: 3}"])
    resolved = eval_data(cfg)
    assert (resolved.task, resolved.seed, resolved.task_kwargs) == (cfg.data.task, 1, {"digits": 3})
    assert resolved.prompt_tokens == cfg.data.prompt_tokens
    cfg = load_config(ROOT / QWEN, ["eval.data.task=uuid_retrieval"])
    assert eval_data(cfg).task_kwargs == {}  # another task: its own arguments
    train = ["data.task=null", "data.path=/tmp/x.jsonl", "data.on_overlong=skip"]
    cfg = load_config(ROOT / QWEN, [*train, "eval.data.task=passkey_retrieval"], check_paths=False)
    assert (eval_data(cfg).path, eval_data(cfg).on_overlong) == (None, "error")
