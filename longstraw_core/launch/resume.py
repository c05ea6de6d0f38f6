"""Resume that tells the truth: what a checkpoint overrides is applied from the config or refused.

Loading a checkpoint restores the optimizer's param groups (learning rate, betas, weight
decay) and the scheduler's base learning rates, silently undoing an ``optim.lr=...`` given on
the resume command while W&B records the new value. Here every setting that differs from the
checkpoint's run config is either

- **applied**: the optimizer and scheduler take the new ``optim`` values
  (``apply_optimizer_settings``), and everything the recipe reads each step (grpo, rollout,
  rewards, data, train...) applies by itself; the changes are printed and recorded in the
  W&B config under ``resume``;
- **refused** before any tensor is read (``RESUME_FIXED``): the model and its adapters
  must be the ones the checkpoint was trained as.

The data too: a checkpoint records ``data.path``'s size and sha256 (``data.fingerprint``),
and a resume over other bytes (the file replaced or edited since) is refused with
``DataError``: the saved data position would pick other samples, silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longstraw_core import checkpoint
from longstraw_core.config import ConfigError, OptimSection, RunConfig, to_dict
from longstraw_core.data import samples as data

# Settings a checkpoint fixes: other values would load other weights (or fail to load them).
# ``model.path`` and ``tokenizer.path`` may move; the weight check catches another model.
RESUME_FIXED = ("model.", "lora.", "tokenizer.")
RESUME_MOVABLE = ("model.path", "tokenizer.path")
# Settings that name the run rather than describe it: never reported as changes.
RESUME_IGNORED = ("train.resume_from",)


@dataclass(frozen=True)
class Change:
    """One setting whose value differs from the checkpoint's run config."""

    key: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r}"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[Change]:
    """Every setting whose value differs between two run configs (nested dicts)."""
    old, new = flatten(saved), flatten(now)
    keys = [k for k in dict.fromkeys([*old, *new]) if not k.startswith(RESUME_IGNORED)]
    return [Change(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def check_resumable(changes: list[Change], checkpoint: str) -> None:
    """Refuse changes to what the checkpoint fixes, naming every key, before loading."""
    fixed = [c for c in changes if c.key.startswith(RESUME_FIXED) and c.key not in RESUME_MOVABLE]
    if fixed:
        listed = "; ".join(map(str, fixed))
        raise ConfigError(
            fixed[0].key,
            f"differs from the run that wrote {checkpoint} ({listed}). A checkpoint resumes "
            "only the model it trained: restore these values, or start a new run in another "
            "train.output_dir",
        )


def apply_optimizer_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    optim: OptimSection,
) -> list[Change]:
    """Give a restored optimizer (and scheduler) the config's lr, betas and weight decay.

    The learning rate is rescaled, not replaced: a scheduler's current factor (warmup,
    cosine) is kept and applied to the new base rate. Returns what changed.
    """
    changes: list[Change] = []
    bases = list(scheduler.base_lrs) if scheduler is not None else None
    for index, group in enumerate(optimizer.param_groups):
        old_base = bases[index] if bases is not None else group["lr"]
        if old_base != optim.lr:
            factor = group["lr"] / old_base if old_base else 1.0
            group["lr"] = optim.lr * factor
            if "initial_lr" in group:
                group["initial_lr"] = optim.lr
            if bases is not None:
                bases[index] = optim.lr
            if index == 0:
                changes.append(Change("optim.lr", old_base, optim.lr))
        betas = tuple(optim.betas)
        if tuple(group["betas"]) != betas:
            if index == 0:
                changes.append(Change("optim.betas", list(group["betas"]), list(betas)))
            group["betas"] = betas
        if group["weight_decay"] != optim.weight_decay:
            if index == 0:
                changes.append(
                    Change("optim.weight_decay", group["weight_decay"], optim.weight_decay)
                )
            group["weight_decay"] = optim.weight_decay
    if scheduler is not None and bases is not None:
        scheduler.base_lrs = bases
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # get_last_lr()
    return changes


def saved_config(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The run config a checkpoint's run recorded (None for checkpoints from before that)."""
    return _saved_extra(checkpoint_dir, "config")


def _saved_extra(checkpoint_dir: Path, key: str) -> dict[str, Any] | None:
    """An entry of a checkpoint's ``extra`` (None: unreadable, absent or not a dict)."""
    try:
        state = json.loads((checkpoint_dir / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # load_checkpoint reports an unreadable checkpoint properly
    value = state.get("extra", {}).get(key)
    return value if isinstance(value, dict) else None


def check_same_data(cfg: RunConfig, checkpoint_dir: Path) -> None:
    """Refuse to resume over data whose bytes differ from what the checkpoint's run read
    (``DataError`` naming the file, both sizes and hashes, and the fixes)."""
    saved = _saved_extra(checkpoint_dir, "data")
    now = data.fingerprint(cfg.data)
    if saved is None or now is None:
        return  # saved before runs recorded it, or a task (its settings are compared)
    if (saved.get("bytes"), saved.get("sha256")) == (now["bytes"], now["sha256"]):
        return

    def described(mark: dict[str, Any]) -> str:
        return f"{mark.get('bytes')} bytes, sha256 {str(mark.get('sha256'))[:12]}"

    raise data.DataError(
        f"{now['path']} is not the data {checkpoint_dir} was trained on ({described(saved)} "
        f"then, {described(now)} now): the run would go on at its saved position in other "
        "samples. Restore that file, or start a new run (another train.output_dir, without "
        "train.resume_from)"
    )


def checkpoint_to_resume(cfg: RunConfig) -> tuple[Path | None, list[Change]]:
    """The checkpoint ``train.resume_from`` names and the settings that changed since.

    Runs before the model is built: a change the checkpoint cannot honour is refused here
    (``ConfigError`` naming the key). ``(None, [])`` when there is nothing to resume
    (``resume_from`` unset, or ``"latest"`` before the first checkpoint).
    """
    if cfg.train.resume_from is None:
        return None, []
    try:
        path = checkpoint.resolve_checkpoint(cfg.train.resume_from, cfg.train.output_dir)
    except FileNotFoundError as error:
        raise ConfigError("train.resume_from", str(error)) from None
    if path is None:
        return None, []
    saved = saved_config(path)
    changes = config_changes(saved, to_dict(cfg)) if saved is not None else []
    check_resumable(changes, str(path))
    check_rollout_boundary(saved_step(path), cfg.grpo.num_iterations, str(path))
    check_same_data(cfg, path)
    return path, changes


def saved_step(checkpoint_dir: Path) -> int | None:
    """The step a checkpoint was saved at (None when its trainer state is unreadable:
    ``load_checkpoint`` reports that properly)."""
    try:
        state = json.loads((checkpoint_dir / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = state.get("step")
    return step if isinstance(step, int) else None


def check_rollout_boundary(step: int | None, num_iterations: int, checkpoint: str) -> None:
    """A run continues with a fresh rollout: the checkpoint's step must end one, i.e. be a
    multiple of ``grpo.num_iterations`` (a run only saves there; a resume that changes it may
    not fit)."""
    if step is not None and num_iterations > 1 and step % num_iterations:
        raise ConfigError(
            "grpo.num_iterations",
            f"{num_iterations}: {checkpoint} was saved at step {step}, not a multiple of it, "
            "so the resumed run's rollouts would not end where its checkpoints must; resume "
            "with the num_iterations that checkpoint's run used, or one dividing its step",
        )


def describe(changes: list[Change], checkpoint_dir: Path) -> str | None:
    """One line listing the settings a resumed run applies, or None when nothing changed."""
    if not changes:
        return None
    listed = "; ".join(map(str, changes))
    return f"resuming {checkpoint_dir} with settings that differ from its run (applied): {listed}"


def merge_changes(*lists: list[Change]) -> list[Change]:
    """The changes of several sources, one per key (the first source's wins)."""
    merged: dict[str, Change] = {}
    for changes in lists:
        for change in changes:
            merged.setdefault(change.key, change)
    return list(merged.values())
