"""Validation of a loaded config, and the checked objects it builds.

``validate`` runs the range and combination checks before anything is built and loads no
weights (a tiny model's config or a checkpoint's ``config.json`` at most), so a bad config
fails in the time it takes to import torch. Every failure is a ``ConfigError`` naming the full
key path and what is allowed. ``grpo_config`` and ``offload_policy`` build the run's
``GRPOConfig`` and ``OffloadPolicy``.

``check_paths=False`` skips the filesystem: existence of ``model.path``, ``tokenizer.path``
(or, when it is null, a tokenizer in ``model.path``), ``data.path`` and an explicit
``train.resume_from``, and reading ``model.path/config.json``
(so the position limit of a real checkpoint is not checked either). The shipped 8- and
32-GPU configs point at placeholder paths (``/models/...``) that a user edits; with path
checks on they fail with ``model.path: ... does not exist``, as they should.

What the check reads outside the config (paths, the reward functions' imports, the data's
columns) is in ``probes``. This module stays one (over 500 lines) on purpose: it is one job,
the rules over the config's own values, one function per section in the order ``validate``
runs them, sharing ``_check_choice`` and ``_check_range``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longstraw_core.adapters import registry
from longstraw_core.adapters.model_tables import ModelFacts, lora_targets, model_facts
from longstraw_core.config.probes import (
    check_exists,
    check_reward_columns,
    check_reward_resolves,
    check_source_paths,
    check_train_paths,
)
from longstraw_core.data.tasks import TASKS
from longstraw_core.data.tasks.haystack import longest_prompt
from longstraw_core.data.tokenizer import BUILTIN_TOKENIZER_SIZE, tokenizer_source
from longstraw_core.offload import PLACEMENTS, OffloadPolicy, placement_fields
from longstraw_core.schema.grpo import GRPOConfig, GRPOConfigError
from longstraw_core.schema.run_config import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    GRPO_FROM_ROLLOUT,
    MIXED_PRECISION,
    ROLLOUT_GATHER,
    SCHEDULERS,
    TRACKING_MODES,
    ConfigError,
    DataSection,
    MemorySection,
    OffloadSection,
    OptimSection,
    RolloutSection,
    RunConfig,
    TrainSection,
)
from longstraw_core.tensors.quantization import (
    COMPUTE_DTYPES,
    INSTALL_HINT,
    QUANTIZATIONS,
    require_bitsandbytes,
)
from longstraw_core.tools import check_config as check_tools


def validate(
    cfg: RunConfig,
    *,
    check_paths: bool = True,
    reward_dirs: Sequence[str | Path] = (),
    check_rewards: bool = True,
) -> None:
    """Range and combination checks; ``load_config`` calls it, call it again after editing
    a config in code. Raises ``ConfigError`` with the key path.

    ``reward_dirs``: where a reward module not on the import path is looked for, before the
    working directory (``load_config``: the config file's directory). ``check_rewards=False``
    leaves the reward functions unimported (``export`` never calls them)."""
    _check_sources(cfg, check_paths)
    facts = model_facts(cfg.model, check_paths=check_paths)
    _check_lora(cfg, facts)
    _check_quantization(cfg)
    _check_data(cfg, facts)
    _check_rollout(cfg.rollout)
    check_tools(cfg, reward_dirs, imports=check_rewards)
    grpo_config(cfg)
    if check_rewards:
        _check_rewards(cfg, check_paths, reward_dirs)
    _check_eval(cfg, facts, check_paths, check_rewards)
    _check_optim(cfg.optim, cfg.train)
    _check_train(cfg.train, check_paths)
    _check_iterations(cfg)
    _check_choice("tracking.mode", cfg.tracking.mode, TRACKING_MODES)
    _check_distributed(cfg)
    _check_memory(cfg.memory)
    _check_offload(cfg.offload)


def grpo_config(cfg: RunConfig) -> GRPOConfig:
    """The ``GRPOConfig`` of a run; a ``GRPOConfigError`` resurfaces as a ``ConfigError``
    on the config key of its ``field`` (``grpo.<field>``, or the ``rollout`` key it comes from)."""
    values = dataclasses.asdict(cfg.grpo)
    values["num_generations"] = cfg.rollout.num_generations
    values["max_completion_length"] = cfg.rollout.max_new_tokens
    values["temperature"] = cfg.rollout.temperature
    try:
        return GRPOConfig(**values)
    except GRPOConfigError as exc:
        key = GRPO_FROM_ROLLOUT.get(exc.field, f"grpo.{exc.field}")
        raise ConfigError(key, exc.reason) from None
    except ValueError as exc:  # not a field's check: name the section
        raise ConfigError("grpo", str(exc)) from None


def _check_choice(key: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"{value!r} is invalid; allowed: {', '.join(map(str, allowed))}")


def _check_range(key: str, value: object, ok: bool, allowed: str) -> None:
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(key, f"{value!r} is invalid; allowed: {allowed}")


def _check_sources(cfg: RunConfig, check_paths: bool) -> None:
    model = cfg.model
    if (model.path is None) == (model.tiny is None):
        raise ConfigError(
            "model.path" if model.path else "model",
            "set exactly one of model.path (a local checkpoint) or model.tiny (a model type of "
            f"{', '.join(sorted(registry.tiny_configs()))})",
        )
    if check_paths:
        check_source_paths(cfg)
    if model.tiny is not None:
        _check_choice("model.tiny", model.tiny, sorted(registry.tiny_configs()))
    elif model.tiny_overrides:
        raise ConfigError(
            "model.tiny_overrides",
            "only applies with model.tiny; clear it (model.tiny_overrides={}) for model.path",
        )
    _check_choice("model.dtype", model.dtype, DTYPES)
    _check_choice("model.attn_implementation", model.attn_implementation, ATTN_IMPLEMENTATIONS)


def _check_lora(cfg: RunConfig, facts: ModelFacts) -> None:
    lora = cfg.lora
    if not lora.enabled:
        return
    _check_range("lora.r", lora.r, lora.r >= 1, "an int >= 1")
    _check_range("lora.alpha", lora.alpha, lora.alpha > 0, "a float > 0 (often 2 x r)")
    _check_range("lora.dropout", lora.dropout, 0 <= lora.dropout < 1, "a float in [0, 1)")
    if lora.target_modules is not None and not lora.target_modules:
        raise ConfigError("lora.target_modules", "empty; list modules, or null for the default")
    if lora.target_parameters is not None and not lora.target_parameters:
        raise ConfigError("lora.target_parameters", "empty; list parameters, or null for none")
    if lora.target_parameters and lora.dropout > 0:
        raise ConfigError(
            "lora.dropout",
            f"{lora.dropout} with lora.target_parameters: peft's adapters on parameters "
            "(ParamWrapper) take no dropout; use 0.0",
        )
    targets = lora_targets(lora, facts.model_type) if facts.model_type else lora.target_modules
    if lora.dropout > 0 and cfg.grpo.gradient == "exact":
        raise ConfigError(
            "lora.dropout",
            f"{lora.dropout} with grpo.gradient='exact': the reverse sweep recomputes the "
            "prompt and must see the same dropout masks as the prefill; use 0.0",
        )
    if lora.dropout > 0 and targets and "kv_b_proj" in targets:
        raise ConfigError(
            "lora.dropout",
            f"{lora.dropout} with kv_b_proj in lora.target_modules: MLA absorbs kv_b_proj's "
            "weight into attention, which a dropout on its input would change; use 0.0",
        )


def _check_quantization(cfg: RunConfig) -> None:
    """``model.quantization=nf4`` (QLoRA): a frozen 4-bit base under trained adapters."""
    quantization = cfg.model.quantization
    if quantization is None:
        return
    _check_choice("model.quantization", quantization, (*QUANTIZATIONS, "null"))
    if not cfg.lora.enabled:
        raise ConfigError(
            "model.quantization",
            f"{quantization!r} freezes the base weights in 4 bits, so only LoRA adapters can "
            "train: set lora.enabled=true (or model.quantization=null for full fine-tuning)",
        )
    if cfg.model.dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            "model.dtype",
            f"{cfg.model.dtype!r} with model.quantization={quantization!r}: the 4-bit layers "
            f"compute in model.dtype, which bitsandbytes supports for {', '.join(COMPUTE_DTYPES)}",
        )
    if cfg.distributed.fsdp:
        raise ConfigError(
            "model.quantization",
            f"{quantization!r} with distributed.fsdp=true is not supported yet: FSDP2 would "
            "shard bitsandbytes' packed 4-bit weights apart from their quantization state; "
            "set distributed.fsdp=false (the 4-bit base is ~4x smaller than bf16)",
        )
    try:  # peft imports it anyway when it is installed: no time added to validation
        require_bitsandbytes()
    except ImportError:
        raise ConfigError(
            "model.quantization",
            f"{quantization!r} needs bitsandbytes, which is not installed: {INSTALL_HINT}",
        ) from None


def _check_data(cfg: RunConfig, facts: ModelFacts) -> None:
    _check_data_section(cfg.data, "data")
    builtin = tokenizer_source(cfg.tokenizer.path, cfg.model.path) is None
    if builtin and facts.vocab_size is not None and facts.vocab_size < BUILTIN_TOKENIZER_SIZE:
        raise ConfigError(
            "model.tiny_overrides.vocab_size" if cfg.model.tiny else "tokenizer.path",
            f"the model has {facts.vocab_size} embeddings but the built-in tokenizer "
            f"has {BUILTIN_TOKENIZER_SIZE} tokens",
        )
    _check_positions(cfg, facts, cfg.data, "data", cfg.rollout.max_new_tokens, "rollout")


def _check_data_section(data: DataSection, key: str) -> None:
    """One data source (``data``, or ``eval.data`` as it resolves); ``key`` prefixes errors."""
    if (data.task is None) == (data.path is None):
        raise ConfigError(
            f"{key}.task",
            f"set exactly one of {key}.task (one of {', '.join(sorted(TASKS))}) or {key}.path",
        )
    if data.task is not None:
        _check_choice(f"{key}.task", data.task, sorted(TASKS))
        _check_task_kwargs(data.task, data.task_kwargs, key)
    elif data.task_kwargs:
        raise ConfigError(f"{key}.task_kwargs", f"only applies with {key}.task, not {key}.path")
    else:
        from longstraw_core.data.files import path_problem  # no `datasets` import here

        problem = path_problem(data.path)
        if problem:
            raise ConfigError(f"{key}.path", problem)
    if not data.split:
        raise ConfigError(f"{key}.split", 'empty; name a split ("train", as TRL scripts do)')
    from longstraw_core.data.samples import ON_OVERLONG  # the values data.scan_samples accepts

    _check_choice(f"{key}.on_overlong", data.on_overlong, ON_OVERLONG)
    if data.task is not None and data.on_overlong != "error":
        raise ConfigError(
            f"{key}.on_overlong",
            f"{data.on_overlong!r} only applies with {key}.path: a task generates every prompt "
            f"to {key}.prompt_tokens",
        )
    _check_range(f"{key}.prompt_tokens", data.prompt_tokens, data.prompt_tokens >= 1, "an int >= 1")
    if data.depth is not None:
        _check_range(f"{key}.depth", data.depth, 0 <= data.depth <= 1, "null or a float in [0, 1]")


def _check_task_kwargs(task: str, kwargs: dict[str, Any], section: str = "data") -> None:
    reserved = {"tokenizer", "prompt_tokens", "depth", "seed", "id", "chat_template_kwargs"}
    parameters = inspect.signature(TASKS[task]).parameters
    for key in kwargs:
        if key in reserved or key not in parameters:
            allowed = sorted(set(parameters) - reserved)
            raise ConfigError(
                f"{section}.task_kwargs.{key}",
                f"not an argument of task {task!r}; allowed: {', '.join(allowed)}",
            )


def _check_positions(
    cfg: RunConfig, facts: ModelFacts, data: DataSection, key: str, new: int, new_key: str
) -> None:
    """The longest prompt plus the longest response must fit the model's positions (``key``:
    the data section's name, ``new_key`` the section of ``new``, its max_new_tokens)."""
    if facts.max_positions is None:
        return
    longest = data.prompt_tokens
    if data.task:  # a generated prompt may run over by the task's tolerance
        longest = longest_prompt(data.prompt_tokens, float(data.task_kwargs.get("tolerance", 0.01)))
    if longest + new <= facts.max_positions:
        return
    if cfg.model.tiny:
        source = (
            f"model.tiny={cfg.model.tiny!r} (raise model.tiny_overrides.max_position_embeddings)"
        )
    else:
        source = f"{cfg.model.path}/config.json"
    slack = (
        f" (up to {longest} with the task's length tolerance)"
        if longest > data.prompt_tokens
        else ""
    )
    raise ConfigError(
        f"{key}.prompt_tokens",
        f"{data.prompt_tokens}{slack} + {new_key}.max_new_tokens {new} = {longest + new} "
        f"exceeds the model's {facts.max_positions} positions, from {source}",
    )


def _check_rollout(rollout: RolloutSection) -> None:
    # num_generations and temperature are checked by GRPOConfig (GRPO's group size, and the
    # temperature of the loss's log-probs, too).
    r = rollout
    _check_range("rollout.max_new_tokens", r.max_new_tokens, r.max_new_tokens >= 1, "an int >= 1")
    _check_range("rollout.top_p", r.top_p, 0 < r.top_p <= 1, "a float in (0, 1] (1: off)")
    _check_range("rollout.top_k", r.top_k, r.top_k >= 0, "an int >= 0 (0: off)")
    _check_range("rollout.min_p", r.min_p, 0 <= r.min_p <= 1, "a float in [0, 1] (0: off)")
    _check_range(
        "rollout.repetition_penalty",
        r.repetition_penalty,
        r.repetition_penalty > 0,
        "a float > 0 (1: off; > 1 discourages repeats)",
    )
    _check_range(
        "rollout.stop_check_every",
        r.stop_check_every,
        isinstance(r.stop_check_every, int) and r.stop_check_every >= 1,
        "an int >= 1 (decode steps between two stop checks; 1: every step)",
    )
    for i, stop in enumerate(r.stop):
        if not stop:
            raise ConfigError(f"rollout.stop[{i}]", "an empty string would stop every response")


def _check_rewards(cfg: RunConfig, check_paths: bool, reward_dirs: Sequence[str | Path]) -> None:
    """Each reward resolves (imported, a factory called with its arguments), and TRL's
    keyword call can bind it with the data's columns (``rewards.signature_problem``): a
    function never runs with arguments it cannot take."""
    if not cfg.rewards and cfg.rollout.environment is None:
        raise ConfigError("rewards", "empty; list at least one {name, weight}")
    for i, spec in enumerate(cfg.rewards):
        size = spec.batch_size
        _check_range(
            f"rewards[{i}].batch_size", size, size is None or size >= 1, "an int >= 1, or null"
        )
        check_reward_resolves(i, spec, reward_dirs, cfg.data.chat_template_kwargs)
        _check_range(f"rewards[{i}].weight", spec.weight, True, "a finite float")
        timeout = spec.timeout_seconds
        _check_range(
            f"rewards[{i}].timeout_seconds", timeout, timeout is None or timeout > 0,
            "seconds > 0, or null for no limit",
        )  # fmt: skip
    check_reward_columns(cfg, cfg.data, "data", check_paths)


def eval_data(cfg: RunConfig) -> DataSection:
    """The data section ``eval.data`` resolves to: ``data`` with the fields ``eval.data``
    sets (``path`` replacing an inherited ``task`` and its ``task_kwargs``, ``task`` an
    inherited ``path`` and its ``on_overlong``)."""
    own = {k: v for k, v in dataclasses.asdict(cfg.eval.data).items() if v is not None}
    if "path" in own:
        own.setdefault("task", None)
        own.setdefault("task_kwargs", {})
    if "task" in own and own["task"] is not None:
        own.setdefault("path", None)
        own.setdefault("on_overlong", "error")  # a task generates every prompt to length
        if own["task"] != cfg.data.task:
            own.setdefault("task_kwargs", {})
    return dataclasses.replace(cfg.data, **own)


def eval_generations(cfg: RunConfig) -> int:
    """k, the completions sampled per eval prompt (0: greedy only)."""
    k = cfg.eval.num_generations
    return cfg.rollout.num_generations if k is None else k


def eval_max_new_tokens(cfg: RunConfig) -> int:
    new = cfg.eval.max_new_tokens
    return cfg.rollout.max_new_tokens if new is None else new


def _check_eval(cfg: RunConfig, facts: ModelFacts, check_paths: bool, check_rewards: bool) -> None:
    """``eval``: its ranges always, its data (as ``eval_data`` resolves it) when it runs."""
    ev = cfg.eval
    _check_range("eval.every", ev.every, ev.every >= 0, "an int >= 0 (0: never)")
    if ev.samples is not None:
        _check_range("eval.samples", ev.samples, ev.samples >= 1, "null (all) or an int >= 1")
    if ev.num_generations is not None:
        _check_range(
            "eval.num_generations", ev.num_generations, ev.num_generations >= 0,
            "null (rollout.num_generations) or an int >= 0 (0: greedy only)",
        )  # fmt: skip
    if ev.max_new_tokens is not None:
        _check_range(
            "eval.max_new_tokens", ev.max_new_tokens, ev.max_new_tokens >= 1,
            "null (rollout.max_new_tokens) or an int >= 1",
        )  # fmt: skip
    _check_range("eval.correct_reward", ev.correct_reward, True, "a finite float")
    if ev.on_start and not ev.every:
        raise ConfigError(
            "eval.on_start", "true needs eval.every > 0 (and eval.data): set both, or false"
        )
    if not ev.every:
        return
    if all(v is None for v in dataclasses.asdict(ev.data).values()):
        raise ConfigError(
            "eval.data",
            "not set: eval.every > 0 would evaluate on the training prompts themselves; set "
            "eval.data.split (e.g. test), eval.data.path, or for a task eval.data.seed (other "
            "prompts) or eval.data.task",
        )
    data = eval_data(cfg)
    if check_paths and cfg.eval.data.path is not None:
        check_exists("eval.data.path", data.path, directory=False)
    _check_data_section(data, "eval.data")
    if data.task is not None and ev.samples is None:
        raise ConfigError(
            "eval.samples",
            f"null (the whole dataset) with the task {data.task!r}, which generates prompts "
            "without end: set how many prompts each eval takes",
        )
    new = eval_max_new_tokens(cfg)
    _check_positions(cfg, facts, data, "eval.data", new, "eval" if ev.max_new_tokens else "rollout")
    _check_eval_within_plan(cfg, data, new)
    if check_rewards:
        check_reward_columns(cfg, data, "eval.data", check_paths)


def _check_eval_within_plan(cfg: RunConfig, data: DataSection, new: int) -> None:
    """With a memory budget (``memory.gpu_mem``), eval must not need more than the training
    step the planner checked: no longer prompts or responses, no more samples at once."""
    if cfg.memory.gpu_mem is None or not cfg.memory.check:
        return
    larger = [
        ("eval.data.prompt_tokens", data.prompt_tokens, "data.prompt_tokens", cfg.data.prompt_tokens),
        ("eval.max_new_tokens", new, "rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("eval.num_generations", eval_generations(cfg), "rollout.num_generations",
         cfg.rollout.num_generations),
    ]  # fmt: skip
    for key, value, train_key, train_value in larger:
        if value > train_value:
            raise ConfigError(
                key,
                f"{value} is more than {train_key}={train_value}: the memory plan "
                f"(memory.gpu_mem={cfg.memory.gpu_mem}) checks the training step, so eval may "
                f"not need more; lower it to at most {train_value} (or set memory.check=false)",
            )


def _check_optim(optim: OptimSection, train: TrainSection) -> None:
    _check_range("optim.lr", optim.lr, optim.lr > 0, "a float > 0")
    _check_range("optim.weight_decay", optim.weight_decay, optim.weight_decay >= 0, "a float >= 0")
    betas_ok = len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas)
    _check_range("optim.betas", optim.betas, betas_ok, "two floats in [0, 1)")
    if optim.max_grad_norm is not None:
        _check_range(
            "optim.max_grad_norm", optim.max_grad_norm, optim.max_grad_norm > 0, "null or > 0"
        )
    _check_choice("optim.scheduler", optim.scheduler, SCHEDULERS)
    _check_range(
        "optim.warmup_steps",
        optim.warmup_steps,
        0 <= optim.warmup_steps <= train.steps,
        f"an int in [0, train.steps={train.steps}]",
    )


def _check_train(train: TrainSection, check_paths: bool) -> None:
    _check_range("train.steps", train.steps, train.steps >= 1, "an int >= 1")
    chunk = train.chunk_size
    _check_range(
        "train.chunk_size", chunk, chunk is None or chunk >= 1, "null (auto) or an int >= 1"
    )
    _check_range("train.log_every", train.log_every, train.log_every >= 1, "an int >= 1")
    every = train.progress_every_seconds
    _check_range(
        "train.progress_every_seconds", every, every is None or every >= 0, "null or a number >= 0"
    )
    for name in ("completions_every", "save_every"):
        value = getattr(train, name)
        _check_range(f"train.{name}", value, value >= 0, "an int >= 0 (0: never)")
    _check_range("train.keep_last", train.keep_last, train.keep_last >= 0, "an int >= 0 (0: all)")
    skips = train.max_skipped_steps
    _check_range("train.max_skipped_steps", skips, skips >= 0, "an int >= 0 (0: stop at the first)")
    if not train.output_dir:
        raise ConfigError("train.output_dir", "empty; a directory for checkpoints and logs")
    if check_paths:
        check_train_paths(train)


def _check_iterations(cfg: RunConfig) -> None:
    """A checkpoint falls between two rollouts: each rollout's grpo.num_iterations updates
    are steps of one step range, so train.steps and train.save_every count whole rollouts."""
    per_step = cfg.train.prompts_per_step
    if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
        raise ConfigError("train.prompts_per_step", f"must be an int >= 1, got {per_step!r}")
    mu = cfg.grpo.num_iterations
    if not isinstance(mu, int) or mu <= 1:
        return  # grpo_config reports a bad value
    for key in ("steps", "save_every"):
        value = getattr(cfg.train, key)
        if value % mu:
            raise ConfigError(
                f"train.{key}",
                f"{value} is not a multiple of grpo.num_iterations={mu}: each rollout is "
                f"trained on for {mu} optimizer steps, and checkpoints fall between rollouts; "
                f"use {value - value % mu or mu}",
            )


def _check_distributed(cfg: RunConfig) -> None:
    dist = cfg.distributed
    _check_choice("distributed.mixed_precision", dist.mixed_precision, MIXED_PRECISION)
    _check_choice("distributed.rollout_gather", dist.rollout_gather, ROLLOUT_GATHER)
    stages = dist.pipeline_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(
            "distributed.pipeline_stages",
            f"must be a positive integer (1: no stages), got {stages!r}",
        )
    minutes = dist.timeout_minutes
    if (
        isinstance(minutes, bool)
        or not isinstance(minutes, int | float)
        or not 0 < minutes < math.inf
    ):
        raise ConfigError(
            "distributed.timeout_minutes",
            f"must be a positive number of minutes, got {minutes!r}",
        )
    pieces = dist.replay_pieces
    if pieces is not None and (
        isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1
    ):
        raise ConfigError(
            "distributed.replay_pieces",
            f"must be a positive integer (pieces per replayed branch on pipeline stages) or "
            f"null (the schedule's choice), got {pieces!r}",
        )
    starts = dist.stage_starts
    if starts is not None and (len(starts) != stages or list(starts)[:1] != [0]):
        raise ConfigError(
            "distributed.stage_starts",
            f"{list(starts)} must list each of the {stages} stages' first layer, starting at 0 "
            "(null: boundaries balanced by the planner)",
        )
    if dist.mixed_precision == "bf16" and not dist.fsdp:
        _check_working_weights(cfg)


def _check_working_weights(cfg: RunConfig) -> None:
    """``distributed.mixed_precision=bf16`` without FSDP: bf16 working weights over float32
    master weights in one process (``longstraw_core.models.mixed_precision``)."""
    key = "distributed.mixed_precision"
    if cfg.model.quantization is not None:
        raise ConfigError(
            key,
            f"'bf16' with model.quantization={cfg.model.quantization!r}: the 4-bit layers "
            "compute in model.dtype, fixed when they are quantized; set model.dtype=bfloat16 "
            "and distributed.mixed_precision=fp32 (the adapters stay float32)",
        )
    if cfg.model.dtype != "float32":
        raise ConfigError(
            "model.dtype",
            f"{cfg.model.dtype!r} with distributed.mixed_precision='bf16': bf16 compute keeps "
            "float32 master weights, so model.dtype must be float32 (or keep "
            f"model.dtype={cfg.model.dtype!r} and set distributed.mixed_precision=fp32: the "
            "model then computes in its own dtype)",
        )
    if cfg.distributed.pipeline_stages > 1:
        raise ConfigError(
            key,
            "'bf16' on pipeline stages without FSDP is not built yet (one process only); "
            "set distributed.fsdp=true (FSDP2's bf16 policy per stage), or model.dtype=bfloat16 "
            "and distributed.mixed_precision=fp32",
        )


def _check_memory(memory: MemorySection) -> None:
    from longstraw_core.tensors.memory import parse_bytes

    if memory.gpu_mem is not None:
        try:
            parse_bytes(memory.gpu_mem)
        except ValueError as exc:
            raise ConfigError("memory.gpu_mem", f"{exc}; or null for no check") from None
    if memory.gpus is not None:
        _check_range("memory.gpus", memory.gpus, memory.gpus >= 1, "null or an int >= 1")
    headroom = memory.headroom
    _check_range("memory.headroom", headroom, 0 <= headroom < 1, "a float in [0, 1)")


def _check_offload(offload: OffloadSection) -> None:
    for name in placement_fields():
        _check_choice(f"offload.{name}", getattr(offload, name), PLACEMENTS)
    count = offload.resident_layers
    _check_range("offload.resident_layers", count, count >= 1, "an int >= 1")


def offload_policy(cfg: RunConfig) -> OffloadPolicy | None:
    """The run's ``OffloadPolicy``, or None when every layer type stays on the device."""
    policy = OffloadPolicy.parse(dataclasses.asdict(cfg.offload))
    return policy if policy.active else None
