"""An agent run end to end (issue 27): the recipe trains a model that calls tools.

The tiny qwen3 of ``tests/tools/test_tool_rollout.py`` (overfit to call ``lookup``, read the code
and answer) is saved as a checkpoint, and ``recipes/grpo_qwen36.py`` trains it with
``rollout.environment`` naming ``CountingVault`` (``Vault`` whose ``get_reward`` counts the
branch's lookups), a module beside the config as a user writes one, on the two scripted
rows (``found``: one call; ``missing``: two calls, one failing). At a low temperature the
branches follow the scripts, so the run's numbers are known in advance:

- TRL's ``tools/call_frequency`` = 6 calls / 4 completions, ``tools/failure_frequency`` =
  2 / 6, the environment's reward logged under its class name (``rewards/CountingVault``:
  1 and 2 lookups) and the reward functions given each branch's messages and environment;
- ``completions/mean_length`` counts the policy's tokens only (the scripts' assistant turns);
- the completions table shows each turn: the call, the tool's result, the answer;
- eval runs the same tool loop (greedy and 2 samples): ``eval/greedy_reward`` = the mean of
  1 + lookups, ``eval/tools/*`` as in training;
- on two pipeline stages (the last stage runs the tools and sends the outcome, environments
  included) and on two FSDP replicas (each its own row; counts summed over the replicas)
  the run logs one process's numbers.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from recipe_runs import launch_recipe
from test_tool_rollout import ENV_ROWS, SCRIPTS, agent, byte_tok, training_sequence  # noqa: F401
from wandb_records import wandb_history, wandb_records

ENVIRONMENT = '''
from typing import Any


class CountingVault:
    """The test's Vault (tests/tools/test_tool_rollout.py), counting its branch's lookups."""

    def reset(self, vault: dict | None = None, mark: str = "", **kwargs: Any) -> str:
        self.vault, self.calls = dict(vault or {}), 0
        return mark

    def lookup(self, key: str) -> str:
        """Read the code stored under a key.

        Args:
            key: The record's key.
        """
        self.calls += 1
        if key not in self.vault:
            raise KeyError(f"the vault has no record under the key {key!r}")
        return self.vault[key]

    def get_reward(self) -> float:
        return float(self.calls)


class LockedVault(CountingVault):
    """An environment that cannot travel between stages: it holds a lock."""

    def reset(self, **row: Any) -> str:
        import threading

        self.lock = threading.Lock()
        return super().reset(**row)


def answered(completions, environments, **kwargs):
    """1.0 for a branch whose last turn answers; TRL's arguments checked on the way."""
    assert len(environments) == len(completions)
    assert all(type(e).__name__ == "CountingVault" for e in environments)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    return [float("<answer>" in c[-1]["content"]) for c in completions]
'''


@pytest.fixture(scope="module")
def agent_run(agent, tmp_path_factory):  # noqa: F811
    """The overfit model as a checkpoint, the two rows as data, and a config beside the
    environment module."""
    root = tmp_path_factory.mktemp("agent_run")
    agent.save_pretrained(root / "model")
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ENV_ROWS))
    (root / "agent_env.py").write_text(ENVIRONMENT)
    config = f"""
        model: {{path: {root / "model"}, dtype: float32}}
        tokenizer: {{path: "builtin:bytes"}}
        data: {{path: {root / "rows.jsonl"}, prompt_tokens: 1024}}
        rollout:
          num_generations: 2
          max_new_tokens: 384
          temperature: 0.05  # the overfit scripts' margins of >= 1 logit become >= 20
          environment: agent_env:CountingVault
        rewards: [{{name: "agent_env:answered", weight: 1.0}}]
        grpo: {{loss_type: dapo, beta: 0.0, gradient: exact}}
        optim: {{lr: 1.0e-4, scheduler: constant}}
        train: {{steps: 1, prompts_per_step: 2, chunk_size: 256, completions_every: 1,
                 save_every: 1, seed: 0}}
        eval: {{every: 1, data: {{path: {root / "rows.jsonl"}}}, num_generations: 2}}
        tracking: {{wandb: true, mode: offline}}
    """
    (root / "agent.yaml").write_text(textwrap.dedent(config))
    return root


def run_metrics(root: Path, name: str, *overrides: str, ranks: int = 1) -> tuple[dict, Path]:
    """Run the recipe on the agent config; the step-1 metrics it logged and its W&B dir."""
    out = root / name
    args = ["--config", str(root / "agent.yaml"), f"train.output_dir={out}", *overrides]
    returncode, log = launch_recipe("grpo_qwen36.py", *args, ranks=ranks)
    assert returncode == 0, f"run failed ({returncode}):\n{log[-5000:]}"
    state = json.loads((out / "step-000001" / "trainer_state.json").read_text())
    history = dict((step, metrics) for step, metrics in state["extra"]["logger"]["history"])
    return history[1], out


def policy_tokens(name: str) -> int:
    """The scripted conversation's assistant tokens (its loss mask's ones)."""
    from longstraw_core.data.tokenizer import load_tokenizer

    return sum(training_sequence(load_tokenizer(None), name)[1])


@pytest.fixture(scope="module")
def one_process(agent_run) -> tuple[dict, Path]:
    return run_metrics(agent_run, "one")


def test_recipe_trains_an_agent_with_trls_tool_metrics(one_process):
    metrics, out = one_process
    assert metrics["tools/call_frequency"] == pytest.approx(6 / 4)
    assert metrics["tools/failure_frequency"] == pytest.approx(2 / 6)
    assert metrics["rewards/answered/mean"] == 1.0
    assert metrics["rewards/CountingVault/mean"] == pytest.approx(1.5)  # 1 and 2 lookups
    assert metrics["reward"] == pytest.approx(2.5)
    lengths = {name: policy_tokens(name) for name in SCRIPTS}
    assert metrics["completions/mean_length"] == pytest.approx(sum(lengths.values()) / 2)
    assert metrics["completions/max_length"] == max(lengths.values())
    assert metrics["eval/greedy_reward"] == pytest.approx(2.5)  # the same tool loop, greedy
    assert metrics["eval/tools/call_frequency"] == pytest.approx(6 / 4)  # and sampled
    assert metrics["eval/tools/failure_frequency"] == pytest.approx(2 / 6)
    (run_file,) = out.glob("**/run-*.wandb")
    assert wandb_history(wandb_records(run_file))[1]["train/tools/call_frequency"] == 1.5
    (table,) = out.glob("**/files/media/table/completions_*.table.json")
    cells = json.loads(table.read_text())
    completions = [row[cells["columns"].index("completion")] for row in cells["data"]]
    assert len(completions) == 4
    found = next(c for c in completions if "red-fox" not in c)
    assert found.splitlines() == [
        "assistant: ",
        '  -> lookup({"key": "teal-otter"})',
        "tool (lookup): 4411",
        "assistant: <answer>4411</answer>",
    ]
    assert any("tool (lookup): {'error'" in c for c in completions)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [(2, ["distributed.pipeline_stages=2", "distributed.replay_pieces=1"]),
     (2, ["distributed.fsdp=true", "train.prompts_per_step=1"]),
     # more stages than branches (G=2 < S=3): the ring's messages wait on every stage pair
     (3, ["distributed.pipeline_stages=3", "distributed.replay_pieces=1"])],
    ids=["stages", "fsdp-replicas", "three-stages"],
)  # fmt: skip
def test_agent_run_on_several_ranks_logs_one_process_numbers(agent_run, one_process, layout):
    ranks, overrides = layout
    one, _ = one_process
    name = f"{ranks}-{overrides[0].split('.')[1]}"
    two, _ = run_metrics(agent_run, name, *overrides, ranks=ranks)
    for key in ("tools/call_frequency", "tools/failure_frequency", "reward",
                "rewards/CountingVault/mean", "completions/mean_length", "eval/greedy_reward", "eval/tools/call_frequency"):  # fmt: skip
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.multiprocess
def test_unpicklable_environment_on_stages_stops_every_rank_with_the_fix(agent_run):
    args = ["--config", str(agent_run / "agent.yaml"), f"train.output_dir={agent_run / 'locked'}",
            "rollout.environment=agent_env:LockedVault", "distributed.pipeline_stages=2"]  # fmt: skip
    returncode, log = launch_recipe("grpo_qwen36.py", *args, ranks=2)
    assert returncode != 0
    assert "training stopped: rollout.environment" in log and "cannot be pickled" in log
    assert "lock" in log  # pickle's own reason, named


def test_data_scan_counts_the_tools_schemas_in_the_prompt(agent_run):
    """The prompts render with the tools' system prompt (~350 tokens here): a limit the bare
    question fits is refused at the scan, before the model loads, naming the key."""
    args = ["--config", str(agent_run / "agent.yaml"), f"train.output_dir={agent_run / 'scan'}",
            "data.prompt_tokens=200", "eval.every=0"]  # fmt: skip
    returncode, log = launch_recipe("grpo_qwen36.py", *args, ranks=1)
    assert returncode != 0
    assert "all 2 prompts are longer than data.prompt_tokens=200" in log
    shortest = int(re.search(r"at least (\d+) to keep any", log).group(1))
    assert shortest > 300  # the bare questions are ~30 tokens; the schema makes the rest


@pytest.mark.multiprocess
def test_the_shipped_agent_config_runs_a_step(tmp_path):
    """configs/qwen36/tiny_agent_cpu.yaml end to end (shorter): the agent task, its
    environment and rewards, the tools' metrics logged (a random toy calls no tool)."""
    config = Path(__file__).resolve().parents[2] / "configs/qwen36/tiny_agent_cpu.yaml"
    args = ["--config", str(config), f"train.output_dir={tmp_path}", "train.steps=1",
            "train.save_every=1", "data.prompt_tokens=2048", "rollout.max_new_tokens=48",
            "rollout.num_generations=2", "tracking.wandb=false"]  # fmt: skip
    returncode, log = launch_recipe("grpo_qwen36.py", *args, ranks=1)
    assert returncode == 0, log[-3000:]
    state = json.loads((tmp_path / "step-000001" / "trainer_state.json").read_text())
    (_, metrics), *_ = state["extra"]["logger"]["history"]
    assert metrics["tools/call_frequency"] == 0.0 and "rewards/VaultEnvironment/mean" in metrics
