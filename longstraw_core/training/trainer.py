"""A Python API for TRL users: reward functions as objects (lambdas, closures) and datasets
as ``datasets.Dataset``, run by the recipe itself.

    from datasets import Dataset
    from longstraw_core.training.trainer import train

    run = train(
        "configs/qwen36/tiny_grpo_cpu.yaml",
        reward_funcs=[lambda completions, solution, **kwargs: [...]],
        train_dataset=Dataset.from_list(rows),
        overrides={"train.steps": 2, "data.prompt_tokens": 1024},
    )
    run.model  # the trained policy (the recipe's ``Recipe``)

Why over the recipe: ``train`` calls the recipe's ``main`` with a config path and overrides,
exactly as the command line does (config checks and launch settings, the memory plan, setup,
training, checkpoints, signals, the one-line errors and exit codes), so the API cannot drift
from the reference. It only turns objects into what a run config can name:

- a callable is registered in this process (``rewards.register_callable``) and named
  ``callable:<name>`` in ``rewards``; ``<name>`` is TRL's name for it (``__name__``: a
  lambda's is ``<lambda>``), with ``_2``, ``_3``... for repeats, and its metrics are
  ``rewards/<name>/mean``. A string is a reward name as in a config (a built-in,
  ``module:function``), a mapping a whole entry (``{"name": ..., "kwargs": {...}}``).
- a ``Dataset`` is written once with ``save_to_disk`` under ``datasets``' cache
  (``<HF_DATASETS_CACHE>/longstraw/<fingerprint>``), and ``data.path`` (``eval.data.path``)
  names that directory: the run scans, orders and resumes it as any saved dataset, and a
  resume through the API with the same dataset finds the same directory. A string is a
  path as in a config.

Errors a person must fix (config, data, memory plan, checkpoint, a diverged run, a failing
reward function) raise ``RunError`` (``longstraw_core.process.exits``), whose message is the one
line the command line prints and exits 1 with; arguments ``train`` itself cannot use raise
``ValueError`` / ``TypeError``. A stop signal still ends the process as the command line
does (saved, exit status 128 + the signal), and under ``torchrun`` / ``accelerate launch``
every rank calls ``train``; a distributed run that finished ends every rank with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from longstraw_core.process.exits import RunError, raising
from longstraw_core.rewards import callable_name, register_callable

if TYPE_CHECKING:
    import datasets

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = RECIPES / "grpo_qwen36.py"  # the recipes' code is the same for every model

RewardFunc = str | Callable[..., Any] | Mapping[str, Any]

__all__ = ["RunError", "dataset_directory", "load_recipe", "reward_entries", "train"]


def train(
    config: str | os.PathLike[str] | None = None,
    *,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
    reward_weights: Sequence[float] | None = None,
    train_dataset: datasets.Dataset | str | os.PathLike[str] | None = None,
    eval_dataset: datasets.Dataset | str | os.PathLike[str] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    recipe: str | os.PathLike[str] | None = None,
) -> Any:
    """Train as ``python <recipe> --config <config> <overrides>`` would, with these reward
    functions and datasets (TRL's ``GRPOTrainer(reward_funcs=..., train_dataset=...,
    eval_dataset=...)``); returns the recipe's finished ``Recipe``.

    ``config``: a run config YAML (None: the recipe's default). ``reward_weights``: one per
    function (TRL's ``reward_weights``; default 1.0 each). ``overrides``: ``key=value``
    strings or a ``{key: value}`` mapping. ``eval_dataset`` is evaluated every ``eval.every``
    steps (set it in the config or the overrides). ``recipe``: the recipe file to run (your
    copy of ``recipes/grpo_qwen36.py``; default: this checkout's). Raises ``RunError`` with
    the command line's one-line message where the command line would exit 1."""
    module = load_recipe(recipe)
    argv = ["--config", str(config)] if config is not None else []
    argv += _as_overrides(overrides)
    if reward_funcs is not None:
        entries = reward_entries(reward_funcs, reward_weights)
        argv.append(f"rewards={json.dumps(entries)}")
    elif reward_weights is not None:
        raise ValueError("reward_weights without reward_funcs: set the config's rewards[i].weight")
    if train_dataset is not None:
        path = dataset_directory(train_dataset, "train_dataset")
        argv += ["data.task=null", f"data.path={json.dumps(str(path))}"]
        if not isinstance(train_dataset, str | os.PathLike):
            argv.append("data.split=train")  # one Dataset saved: its rows are the "train" split
    if eval_dataset is not None:
        path = dataset_directory(eval_dataset, "eval_dataset")
        argv += ["eval.data.task=null", f"eval.data.path={json.dumps(str(path))}"]
        if not isinstance(eval_dataset, str | os.PathLike):
            argv.append("eval.data.split=train")
    with raising():
        return module.main(argv)


def load_recipe(recipe: str | os.PathLike[str] | None = None) -> ModuleType:
    """The recipe file as a module (its ``main`` and ``Recipe``)."""
    path = Path(recipe) if recipe is not None else DEFAULT_RECIPE
    if not path.is_file():
        raise FileNotFoundError(
            f"no recipe at {path}: pass recipe= the path of your copy of "
            "recipes/grpo_qwen36.py (a longstraw installed from a wheel has no recipes/)"
        )
    spec = importlib.util.spec_from_file_location(f"longstraw_recipe_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the recipe {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reward_entries(
    funcs: RewardFunc | Sequence[RewardFunc], weights: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """The run config's ``rewards`` for TRL's ``reward_funcs`` / ``reward_weights``, each
    callable registered in this process under a unique name."""
    if isinstance(funcs, str | Mapping) or callable(funcs):
        funcs = [funcs]
    funcs = list(funcs)
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(
            f"Number of reward weights ({len(weights)}) must match number of reward "
            f"functions ({len(funcs)})"
        )
    taken: set[str] = set()
    entries = []
    for fn, weight in zip(funcs, weights, strict=True):
        if isinstance(fn, Mapping):
            entries.append({"weight": float(weight), **fn})
        elif isinstance(fn, str):
            entries.append({"name": fn, "weight": float(weight)})
        elif callable(fn):
            base = name = callable_name(fn)
            count = 1
            while name in taken:
                count += 1
                name = f"{base}_{count}"
            taken.add(name)
            entries.append({"name": register_callable(fn, name), "weight": float(weight)})
        else:
            raise TypeError(
                f"a reward function must be a callable, a reward name or an entry mapping; "
                f"got {type(fn).__name__}"
            )
    return entries


def dataset_directory(dataset: Any, argument: str) -> Path:
    """Where the run reads ``dataset``: a path as given, or a ``Dataset`` saved once under
    ``datasets``' cache (by its fingerprint: the same rows, the same directory)."""
    import datasets

    if isinstance(dataset, str | os.PathLike):
        return Path(dataset)
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(f"{argument} is a DatasetDict: pass one split, e.g. dataset['train']")
    if isinstance(dataset, datasets.IterableDataset):
        raise TypeError(
            f"{argument} is an IterableDataset: LongStraw scans every prompt before the model "
            "loads, so it needs a Dataset (e.g. Dataset.from_generator, or "
            "Dataset.from_list(list(dataset.take(n))))"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"{argument} must be a datasets.Dataset or a path, got {type(dataset)}")
    # NOTE: the fingerprint hashes an in-memory dataset's rows, a file-backed one's files:
    # every rank, and a later resume, computes the same name for the same rows.
    target = Path(datasets.config.HF_DATASETS_CACHE) / "longstraw" / dataset._fingerprint
    if (target / "state.json").is_file():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    dataset.save_to_disk(str(staging))
    try:
        os.rename(staging, target)  # atomic: a reader sees the whole dataset or none
    except OSError:  # another rank wrote the same rows first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "state.json").is_file():
            raise
    return target


def _as_overrides(overrides: Sequence[str] | Mapping[str, Any]) -> list[str]:
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)
