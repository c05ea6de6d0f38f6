"""What the config check reads outside the config: the model, tokenizer, data and output
paths, the reward functions (imported, a factory called) and the data's columns (a first
sample read or generated). ``validation`` runs these where ``check_paths`` (and
``check_rewards``) allow; the rules over the config's own values stay there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longstraw_core.data.tokenizer import has_tokenizer_files, is_builtin, model_without_tokenizer
from longstraw_core.rewards import (
    TRL_ARGUMENTS,
    RewardNameError,
    sample_columns,
    signature_problem,
)
from longstraw_core.rewards.resolution import resolve_entry
from longstraw_core.schema.run_config import (
    ConfigError,
    DataSection,
    RewardSpec,
    RunConfig,
    TrainSection,
)

# Where a relative path is taken from (config.relative_paths), said where one is not found.
RELATIVE_RULE = (
    "a relative path written in a config file is taken from the file's directory, one on the "
    "command line from the working directory"
)


def check_source_paths(cfg: RunConfig) -> None:
    """``model.path``, the tokenizer (``tokenizer.path``, or the model's own) and
    ``data.path`` exist."""
    check_exists("model.path", cfg.model.path, directory=True)
    check_tokenizer(cfg.tokenizer.path, cfg.model.path)
    check_exists("data.path", cfg.data.path, directory=False)


def check_tokenizer(path: str | None, model_path: str | None) -> None:
    """``tokenizer.path``: a directory, ``builtin:bytes``, or null for the model's own, which
    ``model.path`` must then hold (byte ids would silently not be the model's token ids)."""
    if is_builtin(path):
        return
    check_exists("tokenizer.path", path, directory=True)
    if path is None and model_path is not None and not has_tokenizer_files(model_path):
        raise ConfigError("tokenizer.path", model_without_tokenizer(model_path))


def check_exists(key: str, path: str | None, *, directory: bool) -> None:
    if path is None:
        return
    target = Path(path).expanduser()
    if not target.exists():
        raise ConfigError(
            key, f"{path!r} does not exist (looked for {target.absolute()}; {RELATIVE_RULE})"
        )
    if directory and not target.is_dir():
        raise ConfigError(key, f"{path!r} is not a directory ({target.absolute()})")
    if not (target.is_dir() or target.is_file()):  # a FIFO or a device: reading would block
        raise ConfigError(key, f"{path!r} is not a regular file or a directory; name a data file")


def check_train_paths(train: TrainSection) -> None:
    """``train.output_dir`` is not a file; an explicit ``train.resume_from`` exists."""
    if Path(train.output_dir).exists() and not Path(train.output_dir).is_dir():
        raise ConfigError(
            "train.output_dir",
            f"{train.output_dir!r} is a file, not a directory; name a directory for "
            "checkpoints and logs",
        )
    if train.resume_from not in (None, "latest"):
        check_exists("train.resume_from", train.resume_from, directory=True)


def check_reward_resolves(
    index: int,
    spec: RewardSpec,
    reward_dirs: Sequence[str | Path],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> None:
    """``rewards[index]`` resolves: its module imports, its factory takes its arguments, a
    reward model's config and tokenizer load (its weights load at setup)."""
    try:
        resolve_entry(spec, search_dirs=reward_dirs, chat_template_kwargs=chat_template_kwargs)
    except RewardNameError as exc:
        raise ConfigError(f"rewards[{index}].{exc.field}", str(exc)) from None


def check_reward_columns(cfg: RunConfig, data: DataSection, key: str, check_paths: bool) -> None:
    """TRL's keyword call binds every reward function with the columns of ``data``'s records
    (``key``: its config section, named in the error)."""
    columns = data_columns(data, check_paths)
    taken = [c for c in columns or () if c in TRL_ARGUMENTS]
    if taken:
        raise ConfigError(
            f"{key}.path",
            f"the records have the field(s) {', '.join(taken)}, which TRL passes reward "
            "functions itself: rename them",
        )
    if columns is not None and cfg.rollout.environment is not None:
        columns = (*columns, "environments")  # TRL passes an agent run's environments
    for i, spec in enumerate(cfg.rewards):
        name, fn = resolve_entry(spec, chat_template_kwargs=cfg.data.chat_template_kwargs)
        problem = signature_problem(fn, columns)
        if problem:
            attr = spec.name.replace(":", ".").rpartition(".")[2]
            shown = spec.name if name == attr else f"{spec.name} (function {name})"
            where = "" if key == "data" else f" on the {key} records"
            raise ConfigError(f"rewards[{i}].name", f"{shown} {problem}{where}")


# A task's columns do not depend on its length: a short sample tells them, quickly.
COLUMN_PROBE_TOKENS = 4096


def data_columns(data: DataSection, check_paths: bool) -> tuple[str, ...] | None:
    """The dataset columns the reward functions will get: those of the run's first sample
    (``rewards.sample_columns``). None when they cannot be known yet: ``check_paths=False``
    with ``data.path``, or data the scan will refuse anyway (it names the record then)."""
    from longstraw_core.data.samples import (  # lazily, as validation's data checks
        DataError,
        first_sample,
    )
    from longstraw_core.data.tasks import sample_at
    from longstraw_core.data.tokenizer import load_tokenizer

    try:
        if data.task is not None:
            sample = sample_at(
                data.task, load_tokenizer(None), min(data.prompt_tokens, COLUMN_PROBE_TOKENS),
                data.seed, 0, depth=data.depth, **data.task_kwargs,
            )  # fmt: skip
        elif check_paths:
            sample = first_sample(data.path, split=data.split)
        else:
            return None
    except (DataError, ValueError, OSError):
        return None
    return tuple(sample_columns(sample))
