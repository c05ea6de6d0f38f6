"""What the fault-injection tests share: the smallest recipe run that trains, the
environment its processes need, and bit-exact comparisons of checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from longstraw_core.process.failpoints import ENV as FAILPOINTS

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_qwen36.py"
CONFIG = ROOT / "configs" / "qwen36" / "tiny_learn_cpu.yaml"
# The smallest run that still trains: a reward that varies in every group, and weight decay
# that moves every weight at every update, so an update that should not happen (or one lost
# to a kill) shows in every tensor.
SMALL = [
    "optim.weight_decay=0.01",
    "data.prompt_tokens=400",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=4",
    "train.chunk_size=128",
    "grpo.gradient=detached",
    "tracking.wandb=false",
    "train.completions_every=0",
    "optim.scheduler=constant",
    "rewards=[{name: 'varied_reward:even_characters'}]",
    "optim.lr=1e-3",
]


def run_env(**extra: str) -> dict[str, str]:
    """This environment without failpoints, unbuffered, with the test reward importable."""
    env = {k: v for k, v in os.environ.items() if k != FAILPOINTS}
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")])
    )
    return env | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path} | extra


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted((step_dir / "model").rglob("*.safetensors"))
    assert files, f"no weights under {step_dir}"
    return {k: v for f in files for k, v in load_file(f).items()}


def optimizer_state(step_dir: Path) -> dict:
    return torch.load(step_dir / "optimizer.pt", weights_only=True)


def assert_same_state(a: Path, b: Path) -> None:
    """Weights and optimizer state of two checkpoints are bit-identical."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    oa, ob = optimizer_state(a), optimizer_state(b)
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for index, state in oa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, ob["state"][index][key]), (index, key)


def all_finite(step_dir: Path) -> bool:
    tensors = list(weights(step_dir).values())
    for state in optimizer_state(step_dir)["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
