"""Two launchers on one machine as two nodes: stages and replicas across a node boundary.

Each "node" is its own launcher process, started together and meeting at a rendezvous on
127.0.0.1, as on a cluster (``launch.launch_nodes``; every rank under the NCCL-rules harness):

- ``torchrun --nnodes 2 --node_rank 0|1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT``
  with one process a node and ``distributed.pipeline_stages=2``: stage 0 on one node, stage 1
  on the other, so every hidden state of prefill, rollout, replay and the exact sweep crosses
  the boundary; this one pipeline takes both of the step's prompts (``prompts_per_step=2``).
- The same torchrun with two processes a node: 2 replicas x 2 stages. Rank ``d * S + s`` is
  stage ``s`` of replica ``d`` (``parallel/mesh.py``) and torchrun numbers a node's ranks
  together, so each node holds one whole pipeline and the replicas' gradient average is what
  crosses the boundary; each replica takes one prompt.
- ``accelerate launch --machine_rank 0|1`` with the shipped two-node config
  (``configs/accelerate/16xgpu_2nodes.yaml``, its static rendezvous) given 4 processes: the
  same 2 x 2 layout.

Every run trains one step on the same two prompts as one process with ``prompts_per_step=2``
and must equal it: the same rewards and loss, the same gradients (AdamW's first moment), and
weights that are the same initial weights less each run's own AdamW step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import launch
import pytest
import torch
from recipe_runs import QWEN, ROOT, SMALL, run_on_ranks, tensors

from longstraw_core.config import load_config
from longstraw_core.models import build as models

pytestmark = pytest.mark.multiprocess

RECIPE = ROOT / "recipes" / "grpo_qwen36.py"
ACCELERATE_CONFIG = ROOT / "configs" / "accelerate" / "16xgpu_2nodes.yaml"
# One exact step, saved; one replay piece a branch: one process's replay arithmetic
# (tests/training/test_recipes_pipeline.py says why).
STEP = ["train.steps=1", "train.save_every=1", "grpo.gradient=exact", "distributed.replay_pieces=1"]
TWO_PROMPTS = "train.prompts_per_step=2"
CASES = {  # name: (launcher, processes a node, overrides); two nodes each, S=2
    "torchrun-stages-across-nodes": ("torchrun", 1, [TWO_PROMPTS]),
    "torchrun-2-replicas-x-2-stages": ("torchrun", 2, []),
    "accelerate-2-replicas-x-2-stages": ("accelerate", 2, []),
}
# AdamW's moments: the gradients in another order of summation (stages, replicas' all-reduce)
# agree to float32 rounding, within 1e-5 of the largest entry, as in test_recipes_pipeline.
MOMENT_RTOL = 1e-5
# The initial weights recovered from a run (its weights plus its own AdamW step): float32
# rounding of weight and step, a few ulps (1.2e-7) of the largest trained weight.
WEIGHT_RTOL = 1e-6


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process training the step's two prompts (samples 0 and 1) on the whole model."""
    out = tmp_path_factory.mktemp("one") / "run"
    run_on_ranks("grpo_qwen36.py", QWEN, out, *STEP, TWO_PROMPTS, ranks=1)
    return out


def node_commands(launcher: str, per_node: int, args: list[str]) -> list[list[str]]:
    """Node 0's and node 1's launcher commands for ``recipe args``, on a fresh port."""
    port = launch.free_port()
    if launcher == "torchrun":
        return [
            launch.torchrun_node_command(
                RECIPE, *args, node=node, nodes=2, ranks_per_node=per_node, port=port
            )
            for node in (0, 1)
        ]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    accelerate += ["--config_file", str(ACCELERATE_CONFIG), "--num_processes", str(2 * per_node)]
    accelerate += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    script = launch.under_nccl_rules(RECIPE)  # accelerate starts the harness, given the recipe
    return [[*accelerate, "--machine_rank", str(node), *script, *args] for node in (0, 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_nodes_train_like_one_process(tmp_path, one_process, case):
    launcher, per_node, overrides = CASES[case]
    out = tmp_path / "run"
    args = ["--config", str(ROOT / QWEN), *SMALL, f"train.output_dir={out}", *STEP, *overrides]
    args.append("distributed.pipeline_stages=2")
    # accelerate's own variables of this process (if any) would override the config file.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    logs = launch.launch_nodes(node_commands(launcher, per_node, args), timeout=300, env=env)
    for node, (returncode, log) in enumerate(logs):
        assert returncode == 0, f"node {node} failed ({returncode}):\n{log[-5000:]}"
    assert sum(log.count("step 1/1  ") for _, log in logs) == 1, "only rank 0 prints the step"

    got, want = first_step(out), first_step(one_process)
    assert got["data_position"] == want["data_position"] == 2  # the same two prompts
    assert got["reward"] == want["reward"]  # the same completions: the same rewards
    # The loss: float32 sums of the same terms in another order, scaled by the same normaliser.
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-9)
    assert_same_adamw_step(out / "step-000001", one_process / "step-000001")


def first_step(run: Path) -> dict[str, float]:
    """Step 1's logged metrics (rank 0's reduced line) and the data position after it."""
    state = json.loads((run / "step-000001" / "trainer_state.json").read_text())
    ((step, metrics),) = state["extra"]["logger"]["history"]
    assert step == 1
    return {**metrics, "data_position": state["data_position"]}


def assert_same_adamw_step(got: Path, want: Path) -> None:
    """``got``'s first AdamW step equals ``want``'s: the moments (the clipped gradient and its
    square) within ``MOMENT_RTOL``, and each run's weights less its own step are the toy's
    initial weights within ``WEIGHT_RTOL``.

    Why not the weights alone: AdamW's first step is lr * g / (|g| + eps), so where a gradient
    entry is within rounding of zero, float32's rounding of g moves that entry by up to lr
    (measured: 1.2e-5 of the largest weight in a few entries of 8192, replicas against one
    process). Adding back each run's own step takes that amplification out, exactly.
    """
    initial = toy_parameters()  # in the optimizer's order (models.build_optimizer)
    states = [torch.load(run / "optimizer.pt", weights_only=True) for run in (got, want)]
    weights = [tensors(run / "model") for run in (got, want)]
    group = states[1]["param_groups"][0]
    assert {k: v for k, v in states[0]["param_groups"][0].items() if k != "params"} == {
        k: v for k, v in group.items() if k != "params"
    }
    assert states[0]["state"].keys() == states[1]["state"].keys() == set(range(len(initial)))
    assert weights[0].keys() == weights[1].keys() == initial.keys()
    for index, (name, before) in enumerate(initial.items()):
        first, second = (state["state"][index] for state in states)
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(second[key].abs().max())
            assert float((first[key] - second[key]).abs().max()) <= MOMENT_RTOL * scale, (name, key)
        scale = float(weights[1][name].abs().max())  # not the initial: zero-init norms
        for run, state in zip(weights, states, strict=True):
            recovered = before_step(run[name], state["state"][index], group)
            assert float((recovered - before).abs().max()) <= WEIGHT_RTOL * scale, name
    assert any(float(state["exp_avg"].abs().max()) > 0 for state in states[1]["state"].values())


def before_step(weight: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """``weight`` before the AdamW step that ``state`` records (torch's single-tensor update:
    ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, decay 0)."""
    assert group["weight_decay"] == 0 and not group["amsgrad"]
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    denominator = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
    return weight + group["lr"] / (1 - beta1**step) * state["exp_avg"] / denominator


def toy_parameters() -> dict[str, torch.Tensor]:
    """The toy's trainable parameters before training, built as the runs build it (seed 0),
    in ``parameters()`` order: the optimizer's entries' (``models.build_optimizer``)."""
    cfg = load_config(ROOT / QWEN, SMALL)
    model = models.build_model(cfg.model, seed=cfg.train.seed)
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


# A rank of each node: writes its pid and node; node 1's exit with an error once every rank
# is up, node 0's wait forever, as ranks whose peers died wait in a collective.
FAILING_NODE = """
import os, sys, time
from pathlib import Path
pids = Path(sys.argv[1])
(pids / os.environ["RANK"]).write_text(f"{os.getpid()} {os.environ['GROUP_RANK']}")
if os.environ["GROUP_RANK"] == "1":
    while len(list(pids.iterdir())) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.1)
    sys.exit(1)
time.sleep(600)
"""


def test_a_failed_node_takes_the_other_nodes_ranks_down(tmp_path):
    """One node's rank fails while the other node's ranks wait: ``launch_nodes`` kills the
    waiting launcher and its ranks (each in its own session) after the grace, leaking none.
    On the way, the placement that docs/pipeline.md's "Several machines" relies on: torchrun
    numbers a node's ranks together, so the S=2 pipelines (ranks 0-1, 2-3) are one node each."""
    script, pids = tmp_path / "node.py", tmp_path / "pids"
    script.write_text(FAILING_NODE)
    pids.mkdir()
    port = launch.free_port()
    commands = [
        launch.torchrun_node_command(
            script, str(pids), node=n, nodes=2, ranks_per_node=2, port=port
        )
        for n in (0, 1)
    ]
    results = launch.launch_nodes(commands, timeout=120, grace=2)
    codes = sorted(code for code, _ in results)
    assert codes == [-9, 1], results  # one failed by itself, the other killed after the grace
    assert "launch_nodes: killed" in next(log for code, log in results if code == -9)
    ranks = {int(path.name): path.read_text().split() for path in pids.iterdir()}
    assert sorted(ranks) == [0, 1, 2, 3]
    node = {rank: group for rank, (_, group) in ranks.items()}
    assert node[0] == node[1] != node[2] == node[3], node
    for pid in (int(pid) for pid, _ in ranks.values()):
        assert not launch.alive(pid), f"rank process {pid} outlived its launcher"
