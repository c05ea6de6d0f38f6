"""A tiny policy trained for real, step by step, for the checkpoint tests: the model, its
optimizer and schedule, one update on data drawn from the global RNGs (so restoring them
matters), seeding every RNG, and comparing parameters."""

from __future__ import annotations

import random

import numpy as np
import torch

from longstraw_core.models.tiny import tiny_model


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    return tiny_model("qwen3", seed=seed).train()


def optimizer_and_schedule(
    model: torch.nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return optimizer, scheduler


def train_step(model: torch.nn.Module, optimizer, scheduler) -> float:
    """One real update on data drawn from the global RNGs, so RNG restore matters."""
    ids = torch.randint(0, 512, (1, 12))
    loss = model(input_ids=ids, labels=ids).loss * (1 + random.random() + float(np.random.rand()))
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(loss.detach())


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
