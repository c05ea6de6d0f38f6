"""The run configuration: a typed schema, YAML loading with inheritance, overrides, validation.

Every setting a recipe reads is declared here, with its type and default, so a recipe never
calls ``cfg.get(key, default)`` and a typo cannot silently fall back to a default::

    cfg = load_config("configs/qwen36/tiny_grpo_cpu.yaml", ["rollout.num_generations=8"])
    cfg.rollout.num_generations        # 8, an int
    grpo = grpo_config(cfg)            # a validated longstraw_core.GRPOConfig

A YAML file may start with ``defaults: base.yaml`` (or a list of files), paths relative to the
file itself: the bases merge first, in order, then the file's own keys, so a derived config
is a small diff. Lists are replaced whole, never merged item by item (OmegaConf's rule).

Overrides are ``key=value`` with the value parsed as YAML (``train.steps=3``,
``lora.target_modules=[q_proj,v_proj]``, ``train.resume_from=null``, ``rewards[0].weight=2``).
A bare field name that exists in exactly one section is accepted too (``resume_from=latest``).

Validation runs before anything is built and loads no weights (a tiny model's config or a
checkpoint's ``config.json`` at most), so a bad config fails in the time it takes to import
torch. Every failure is a ``ConfigError`` that names the full key path and what is allowed.

``check_paths=False`` skips the filesystem: existence of ``model.path``, ``tokenizer.path``,
``data.path`` and an explicit ``train.resume_from``, and reading ``model.path/config.json``
(so the position limit of a real checkpoint is not checked either). The shipped 8- and
32-GPU configs point at placeholder paths (``/models/...``) that a user edits; with path
checks on they fail with ``model.path: ... does not exist``, as they should.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longstraw_core.grpo_config import GRPOConfig, GRPOConfigError
from longstraw_core.offload import PLACEMENTS, OffloadPolicy
from longstraw_core.rewards import resolve_reward
from longstraw_core.tasks import TASKS
from longstraw_core.tiny_models import TINY_CONFIGS
from longstraw_core.tokenizer import BUILTIN_SPECIAL_TOKENS

DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
SCHEDULERS = ("constant", "cosine", "linear")
TRACKING_MODES = ("online", "offline", "disabled")
MIXED_PRECISION = ("bf16", "fp32")
BUILTIN_TOKENIZER_SIZE = 256 + len(BUILTIN_SPECIAL_TOKENS)

# LoRA targets when ``lora.target_modules`` is null, by ``config.model_type``. Attention and
# MLP projections everywhere (what "all-linear" LoRA means in practice), with these choices:
# - Gated DeltaNet: the q/k/v and output-gate projections and ``out_proj``; not ``in_proj_a``
#   / ``in_proj_b`` (per-head decay and write-strength inputs: a handful of outputs each, and
#   adapting them changes how long the recurrent state remembers).
# - MLA (GLM-5.x, DeepSeek-V3.2): both low-rank halves of q and kv and ``o_proj``; never the
#   DSA indexer (``wq_b``, ``wk``, ``weights_proj``: frozen during RL, as transformers runs it
#   under no_grad). Routed experts are fused 3-D parameters, not ``nn.Linear``, so LoRA reaches
#   only the dense MLP layers and the shared experts through ``gate/up/down_proj`` (plain peft
#   would move those names onto the routed experts: ``models.add_lora`` keeps them as written).
_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]
_DELTANET = ["in_proj_qkv", "in_proj_z", "out_proj"]
_MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
DEFAULT_LORA_TARGETS: dict[str, list[str]] = {
    "qwen3": _ATTENTION + _MLP,
    "qwen2": _ATTENTION + _MLP,
    "llama": _ATTENTION + _MLP,
    "qwen3_5": _ATTENTION + _DELTANET + _MLP,
    "qwen3_5_text": _ATTENTION + _DELTANET + _MLP,
    "qwen3_5_moe": _ATTENTION + _DELTANET + _MLP,
    "qwen3_5_moe_text": _ATTENTION + _DELTANET + _MLP,
    "qwen3_next": [*_ATTENTION, "in_proj_qkvz", "out_proj", *_MLP],
    "glm_moe_dsa": _MLA + _MLP,
    "deepseek_v32": _MLA + _MLP,
}


class ConfigError(ValueError):
    """A configuration problem; ``key`` is the full dotted path of the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


# --------------------------------------------------------------------------- schema


@dataclass
class ModelSection:
    """Which model: a local checkpoint (``path``) or a random-init toy (``tiny``)."""

    path: str | None = None  # a local directory with config.json and weights
    tiny: str | None = None  # a model type of longstraw_core.tiny_models.TINY_CONFIGS
    tiny_overrides: dict[str, Any] = field(default_factory=dict)  # transformers config fields
    dtype: str = "float32"  # one of DTYPES; the dtype of the parameters (and master weights)
    attn_implementation: str = "sdpa"  # used by the reference forward; adapters attend themselves
    trust_remote_code: bool = False  # only for checkpoints whose code is not in transformers


@dataclass
class LoraSection:
    """PEFT LoRA on the policy; the KL reference is then the same weights, adapters off."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # must be 0 with grpo.gradient=exact or on kv_b_proj (see validate)
    target_modules: list[str] | None = None  # null: DEFAULT_LORA_TARGETS[model_type]


@dataclass
class TokenizerSection:
    path: str | None = None  # null: the built-in byte-level tokenizer (ChatML template)


@dataclass
class DataSection:
    """Prompts: a synthetic long-context task generated on the fly, or a local dataset.

    ``prompt_tokens`` is the length a task generates (within its 1% tolerance); with ``path``
    it is the longest prompt accepted, so the position-limit check below covers both. The
    whole of ``path`` is scanned and measured before the model loads (``data.sample_source``).
    """

    task: str | None = None  # a name of longstraw_core.tasks.TASKS
    path: str | None = None  # a JSONL file or a `datasets` directory saved to disk
    prompt_tokens: int = 16384
    # With path: prompts longer than prompt_tokens are "error" (refuse the data before the
    # model loads, naming them) or "skip" (leave them out of the run, counted and reported).
    on_overlong: str = "error"
    depth: float | None = None  # needle depth in [0, 1]; null: uniform random per sample
    seed: int = 0
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # extra task arguments (hops=4)


@dataclass
class RolloutSection:
    """Sampling of the group; ``num_generations`` and ``max_new_tokens`` are also GRPO's
    ``num_generations`` and ``max_completion_length`` (one setting, not two that must agree)."""

    num_generations: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


def _grpo_section() -> type:
    """``GRPOConfig``'s fields and defaults as a plain schema dataclass.

    Built from the dataclass itself so the two cannot drift; its ``__post_init__`` checks
    are not copied but run by ``grpo_config``. ``num_generations`` and
    ``max_completion_length`` live in ``rollout``. ``scale_rewards`` is typed ``Any`` because
    TRL also accepts True/False there (OmegaConf would turn a bool into the string "True").
    """
    spec = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name in _GRPO_FROM_ROLLOUT:
            continue
        kind = Any if f.name == "scale_rewards" else f.type
        spec.append((f.name, kind, field(default=f.default)))
    return dataclasses.make_dataclass("GRPOSection", spec)


_GRPO_FROM_ROLLOUT = {
    "num_generations": "rollout.num_generations",
    "max_completion_length": "rollout.max_new_tokens",
}
GRPOSection = _grpo_section()


@dataclass
class RewardSpec:
    name: str = MISSING  # a built-in name or a dotted path 'package.module:function'
    weight: float = 1.0


@dataclass
class OptimSection:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float | None = 1.0  # null: no clipping
    scheduler: str = "constant"  # one of SCHEDULERS, after the warmup
    warmup_steps: int = 0


@dataclass
class TrainSection:
    steps: int = 100
    chunk_size: int = 4096  # prefill chunk; also the exact sweep's recompute unit
    activation_checkpointing: bool = (
        False  # recompute layers in backward: less memory, ~1 more forward
    )
    seed: int = 0
    log_every: int = 1  # print a summary line every N steps (metrics go to W&B every step)
    completions_every: int = 10  # log a table of sample completions every N steps; 0: never
    save_every: int = 0  # checkpoint every N steps and at the last step; 0: never
    output_dir: str = "outputs/longstraw"
    resume_from: str | None = None  # null, "latest" (newest in output_dir if any) or a path
    keep_last: int = 0  # keep the newest N complete checkpoints; 0: keep every one
    max_skipped_steps: int = 3  # stop after N steps in a row skipped for inf/NaN (guard.py)
    raise_reward_errors: bool = False  # a failing reward function stops the run (else NaN)


@dataclass
class TrackingSection:
    wandb: bool = True
    project: str = "longstraw"
    run_name: str | None = None
    mode: str = "offline"  # one of TRACKING_MODES


@dataclass
class DistributedSection:
    fsdp: bool = False  # fully_shard per decoder layer (FSDP2)
    mixed_precision: str = "fp32"  # bf16: FSDP2 computes in bf16 over fp32 sharded params
    reshard_after_forward: bool = True  # False keeps gathered params: faster, more memory


@dataclass
class OffloadSection:
    """Where the prefix state lives, per layer type (``longstraw_core.offload.OffloadPolicy``).

    ``cpu`` keeps that layer type's state (and exact mode's gradient buffer for it) in host
    memory and streams it to the GPU layer by layer: less GPU memory, more host-device traffic.
    """

    attention: str = "device"  # full-attention K/V: the state that grows with the prompt
    recurrent: str = "device"  # Gated DeltaNet conv + recurrent states (constant per layer)
    latent: str = "device"  # MLA latent + index keys (GLM-5.2)
    resident_layers: int = 2  # offloaded layers on the GPU at once: 2 overlaps copy and compute
    pin_memory: bool = True  # pinned host memory on CUDA: asynchronous copies


@dataclass
class MemorySection:
    """The per-GPU memory budget ``longstraw_core.plan.check_fits`` checks a run against
    before any weight is loaded (``python -m longstraw_core.plan`` prints the plan)."""

    gpu_mem: str | None = None  # memory per GPU: "96GiB", "80GB"; null: no check (CPU runs)
    gpus: int | None = None  # ranks the step runs on (FSDP shards over them); null: 1
    headroom: float = 0.05  # fraction of gpu_mem kept free: CUDA context, NCCL, fragmentation
    check: bool = True  # false: print the plan but start even when it predicts no fit


@dataclass
class RunConfig:
    """Everything one GRPO run reads. Build it with ``load_config``."""

    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)  # type: ignore[valid-type]
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="exact_match")])
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    memory: MemorySection = field(default_factory=MemorySection)
    offload: OffloadSection = field(default_factory=OffloadSection)


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    check_paths: bool = True,
) -> RunConfig:
    """The validated config of ``path`` (with its ``defaults:`` bases) plus ``overrides``.

    ``path=None`` starts from the schema defaults alone (recipes pass their tiny CPU config
    as the default instead). Raises ``ConfigError`` naming the key on any problem.
    """
    merged = OmegaConf.structured(RunConfig)
    _open_free_dicts(merged)
    if path is not None:
        for source, body in _yaml_chain(Path(path), ()):
            _check_keys(body, RunConfig, "", f"in {source}")
            merged = _merge(merged, body, f"in {source}")
    for item in overrides:
        _apply_override(merged, item)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _translate(exc, "") from None
    validate(cfg, check_paths=check_paths)
    return cfg


def _open_free_dicts(cfg: DictConfig) -> None:
    """``dict[str, Any]`` settings take any key: lift OmegaConf's struct flag there only."""
    for section in dataclasses.fields(RunConfig):
        schema = _hint_of(RunConfig, section.name)
        if not dataclasses.is_dataclass(schema):
            continue
        for f in dataclasses.fields(schema):
            if typing.get_origin(_hint_of(schema, f.name)) is dict:
                OmegaConf.set_struct(cfg[section.name][f.name], False)


def _yaml_chain(path: Path, seen: tuple[Path, ...]) -> list[tuple[Path, dict[str, Any]]]:
    """``path`` and its ``defaults:`` bases, bases first, each as a plain dict."""
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError("defaults", f"inheritance cycle: {chain}")
    if not resolved.is_file():
        where = f" (a default of {seen[-1]})" if seen else ""
        raise ConfigError("defaults" if seen else "config", f"no such file {str(path)!r}{where}")
    try:
        body = OmegaConf.to_container(OmegaConf.load(resolved), resolve=False)
    except Exception as exc:  # yaml.YAMLError and OmegaConf errors: all mean "bad file"
        raise ConfigError("config", f"cannot parse {str(path)!r}: {exc}") from None
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError("config", f"{str(path)!r} must hold a mapping of sections")
    bases = body.pop("defaults", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError("defaults", f"in {path}: a file name or a list of file names")
    chain: list[tuple[Path, dict[str, Any]]] = []
    for base in bases:
        chain += _yaml_chain(resolved.parent / base, (*seen, resolved))
    return [*chain, (path, body)]


def _merge(merged: DictConfig, body: dict[str, Any], source: str) -> DictConfig:
    try:
        return OmegaConf.merge(merged, body)
    except OmegaConfBaseException as exc:
        raise _translate(exc, source) from None


def _apply_override(merged: DictConfig, item: str) -> None:
    source = f"in override {item!r}"
    key, sep, text = item.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(item, "an override is key=value, e.g. train.steps=10")
    key = _qualify(re.sub(r"\[(\d+)\]", r".\1", key), source)
    # OmegaConf's own YAML loader, so 1e-5 is a float (plain YAML 1.1 reads it as a string).
    value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    hint = _hint_at(key.split("."), source)
    _check_value(value, hint, key, source)
    # A section merges (model={dtype: bfloat16} keeps model.tiny); a dict or list value
    # replaces, so model.tiny_overrides={} clears it.
    merge = dataclasses.is_dataclass(_strip_optional(hint))
    value = _structured_items(value, _strip_optional(hint))
    try:
        OmegaConf.update(merged, key, value, merge=merge)
    except OmegaConfBaseException as exc:
        raise _translate(exc, source, key) from None
    except IndexError as exc:
        raise ConfigError(key, f"{exc} ({source})") from None


def _structured_items(value: Any, hint: Any) -> Any:
    """A list of dicts for a ``list[Dataclass]`` field as typed nodes (``rewards=[{...}]``):
    OmegaConf refuses plain dicts in a typed list."""
    if typing.get_origin(hint) is not list or not isinstance(value, list):
        return value
    (item,) = typing.get_args(hint) or (Any,)
    if not dataclasses.is_dataclass(item):
        return value
    return [
        OmegaConf.merge(OmegaConf.structured(item), v) if isinstance(v, dict) else v for v in value
    ]


def _qualify(key: str, source: str) -> str:
    """``resume_from`` -> ``train.resume_from`` when exactly one section has that field."""
    first = key.split(".")[0]
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    if first in sections:
        return key
    owners = [
        s
        for s in sections
        if dataclasses.is_dataclass(_hint_of(RunConfig, s))
        and first in {f.name for f in dataclasses.fields(_hint_of(RunConfig, s))}
    ]
    if len(owners) == 1:
        return f"{owners[0]}.{key}"
    if owners:
        candidates = ", ".join(f"{s}.{first}" for s in owners)
        raise ConfigError(key, f"ambiguous ({source}); write one of {candidates}")
    raise _unknown_key("", first, sections, source)


# --------------------------------------------------------------------------- key checks


def _hint_of(schema: type, name: str) -> Any:
    return typing.get_type_hints(schema)[name]


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else hint
    return hint


def _check_keys(value: Any, schema: type, path: str, source: str) -> None:
    """Unknown keys anywhere in a plain container ``value`` against dataclass ``schema``.

    OmegaConf reports these too, but loses the path inside lists and names no alternatives.
    Types are left to OmegaConf.
    """
    if not isinstance(value, dict):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key, sub in value.items():
        if key not in names:
            raise _unknown_key(path, str(key), names, source)
        _check_value(sub, _hint_of(schema, key), f"{path}.{key}" if path else str(key), source)


def _check_value(value: Any, hint: Any, path: str, source: str) -> None:
    hint = _strip_optional(hint)
    if dataclasses.is_dataclass(hint):
        _check_keys(value, hint, path, source)
    elif typing.get_origin(hint) is list and isinstance(value, list):
        (item_hint,) = typing.get_args(hint) or (Any,)
        for i, item in enumerate(value):
            _check_value(item, item_hint, f"{path}[{i}]", source)


def _hint_at(parts: list[str], source: str) -> Any:
    """The schema type at a dotted path, checking each step (unknown keys fail here)."""
    hint: Any = RunConfig
    for depth, part in enumerate(parts):
        hint = _strip_optional(hint)
        where = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", ".".join(parts[:depth]))
        if dataclasses.is_dataclass(hint):
            names = [f.name for f in dataclasses.fields(hint)]
            if part not in names:
                raise _unknown_key(where, part, names, source)
            hint = _hint_of(hint, part)
        elif typing.get_origin(hint) is list:
            if not part.isdigit():
                raise ConfigError(f"{where}.{part}", f"{where} is a list; index it as {where}[0]")
            hint = typing.get_args(hint)[0]
        else:  # dict[str, Any] or a leaf: anything below is free-form
            return Any
    return hint


def _unknown_key(section: str, key: str, valid: list[str], source: str) -> ConfigError:
    full = f"{section}.{key}" if section else key
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {(f'{section}.' if section else '') + close[0]!r}?)" if close else ""
    where = f"of {section!r}" if section else "(sections)"
    return ConfigError(full, f"unknown key {source}{hint}; valid keys {where}: {', '.join(valid)}")


def _translate(exc: OmegaConfBaseException, source: str, key: str | None = None) -> ConfigError:
    """An OmegaConf error as a ConfigError with the full key and the expected type."""
    full_key = getattr(exc, "full_key", None) or key or "config"
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    expected = ""
    try:
        hint = _hint_at(re.sub(r"\[(\d+)\]", r".\1", full_key).split("."), source)
        if hint is not Any:
            expected = f"; expected {_type_name(hint)}"
    except ConfigError:
        pass
    where = f" ({source})" if source else ""
    return ConfigError(full_key, f"{first_line}{expected}{where}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class ModelFacts:
    """What validation can learn about the model without loading weights (None: unknown)."""

    model_type: str | None
    max_positions: int | None
    vocab_size: int | None


def validate(cfg: RunConfig, *, check_paths: bool = True) -> None:
    """Range and combination checks; ``load_config`` calls it, call it again after editing
    a config in code. Raises ``ConfigError`` with the key path."""
    _check_sources(cfg, check_paths)
    facts = model_facts(cfg.model, check_paths=check_paths)
    _check_lora(cfg, facts)
    _check_data(cfg, facts)
    _check_rollout(cfg.rollout)
    grpo_config(cfg)
    _check_rewards(cfg.rewards)
    _check_optim(cfg.optim, cfg.train)
    _check_train(cfg.train, check_paths)
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
    try:
        return GRPOConfig(**values)
    except GRPOConfigError as exc:
        key = _GRPO_FROM_ROLLOUT.get(exc.field, f"grpo.{exc.field}")
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
            f"{', '.join(sorted(TINY_CONFIGS))})",
        )
    if check_paths:
        _check_exists("model.path", model.path, directory=True)
        _check_exists("tokenizer.path", cfg.tokenizer.path, directory=True)
        _check_exists("data.path", cfg.data.path, directory=False)
    if model.tiny is not None:
        _check_choice("model.tiny", model.tiny, sorted(TINY_CONFIGS))
    elif model.tiny_overrides:
        raise ConfigError(
            "model.tiny_overrides",
            "only applies with model.tiny; clear it (model.tiny_overrides={}) for model.path",
        )
    _check_choice("model.dtype", model.dtype, DTYPES)
    _check_choice("model.attn_implementation", model.attn_implementation, ATTN_IMPLEMENTATIONS)


def _check_exists(key: str, path: str | None, *, directory: bool) -> None:
    if path is None:
        return
    target = Path(path).expanduser()
    if not target.exists():
        raise ConfigError(key, f"{path!r} does not exist (edit the placeholder path?)")
    if directory and not target.is_dir():
        raise ConfigError(key, f"{path!r} is not a directory")


def model_facts(model: ModelSection, *, check_paths: bool = True) -> ModelFacts:
    """Model type, position limit and vocabulary size from the tiny config or ``config.json``.

    A tiny config is built as a transformers config object (milliseconds, no weights), which
    also rejects a mistyped or ill-typed ``tiny_overrides`` entry.
    """
    if model.tiny is not None:
        return _tiny_facts(model.tiny, model.tiny_overrides)
    if not check_paths or model.path is None:
        return ModelFacts(None, None, None)
    config_file = Path(model.path).expanduser() / "config.json"
    if not config_file.is_file():
        raise ConfigError("model.path", f"{model.path!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model.path", f"cannot read {config_file}: {exc}") from None
    text = raw.get("text_config") or {}  # multimodal checkpoints (qwen3_5) nest the LM's config
    positions = raw.get("max_position_embeddings") or text.get("max_position_embeddings")
    vocab = raw.get("vocab_size") or text.get("vocab_size")
    return ModelFacts(raw.get("model_type"), positions, vocab)


def _tiny_facts(model_type: str, overrides: dict[str, Any]) -> ModelFacts:
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    for key in overrides:
        if not (hasattr(default, key) or hasattr(default, f"_{key}")):
            raise ConfigError(
                f"model.tiny_overrides.{key}",
                f"not a field of the {type(default).__name__} of model.tiny={model_type!r}",
            )
    try:
        config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})
    except Exception as exc:  # huggingface_hub strict-dataclass errors and plain ValueErrors
        bad = next((k for k in overrides if repr(k) in str(exc) or k in str(exc)), None)
        key = f"model.tiny_overrides.{bad}" if bad else "model.tiny_overrides"
        raise ConfigError(key, str(exc).strip()) from None
    return ModelFacts(model_type, config.max_position_embeddings, config.vocab_size)


def lora_targets(lora: LoraSection, model_type: str | None) -> list[str]:
    """``lora.target_modules``, or the default for ``model_type`` (``config.model_type``)."""
    if lora.target_modules is not None:
        return list(lora.target_modules)
    if model_type not in DEFAULT_LORA_TARGETS:
        raise ConfigError(
            "lora.target_modules",
            f"no default for model_type {model_type!r} (defaults exist for "
            f"{', '.join(sorted(DEFAULT_LORA_TARGETS))}); list the modules to adapt",
        )
    return list(DEFAULT_LORA_TARGETS[model_type])


def _check_lora(cfg: RunConfig, facts: ModelFacts) -> None:
    lora = cfg.lora
    if not lora.enabled:
        return
    _check_range("lora.r", lora.r, lora.r >= 1, "an int >= 1")
    _check_range("lora.alpha", lora.alpha, lora.alpha > 0, "a float > 0 (often 2 x r)")
    _check_range("lora.dropout", lora.dropout, 0 <= lora.dropout < 1, "a float in [0, 1)")
    if lora.target_modules is not None and not lora.target_modules:
        raise ConfigError("lora.target_modules", "empty; list modules, or null for the default")
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


def _check_data(cfg: RunConfig, facts: ModelFacts) -> None:
    data = cfg.data
    if (data.task is None) == (data.path is None):
        raise ConfigError(
            "data.task",
            f"set exactly one of data.task (one of {', '.join(sorted(TASKS))}) or data.path",
        )
    if data.task is not None:
        _check_choice("data.task", data.task, sorted(TASKS))
        _check_task_kwargs(data.task, data.task_kwargs)
    elif data.task_kwargs:
        raise ConfigError("data.task_kwargs", "only applies with data.task, not data.path")
    from longstraw_core.data import ON_OVERLONG  # the values data.scan_samples accepts

    _check_choice("data.on_overlong", data.on_overlong, ON_OVERLONG)
    if data.task is not None and data.on_overlong != "error":
        raise ConfigError(
            "data.on_overlong",
            f"{data.on_overlong!r} only applies with data.path: a task generates every prompt "
            "to data.prompt_tokens",
        )
    _check_range("data.prompt_tokens", data.prompt_tokens, data.prompt_tokens >= 1, "an int >= 1")
    if data.depth is not None:
        _check_range("data.depth", data.depth, 0 <= data.depth <= 1, "null or a float in [0, 1]")
    builtin = cfg.tokenizer.path is None
    if builtin and facts.vocab_size is not None and facts.vocab_size < BUILTIN_TOKENIZER_SIZE:
        raise ConfigError(
            "model.tiny_overrides.vocab_size" if cfg.model.tiny else "tokenizer.path",
            f"the model has {facts.vocab_size} embeddings but the built-in tokenizer "
            f"has {BUILTIN_TOKENIZER_SIZE} tokens",
        )
    _check_positions(cfg, facts)


def _check_task_kwargs(task: str, kwargs: dict[str, Any]) -> None:
    reserved = {"tokenizer", "prompt_tokens", "depth", "seed", "id"}
    parameters = inspect.signature(TASKS[task]).parameters
    for key in kwargs:
        if key in reserved or key not in parameters:
            allowed = sorted(set(parameters) - reserved)
            raise ConfigError(
                f"data.task_kwargs.{key}",
                f"not an argument of task {task!r}; allowed: {', '.join(allowed)}",
            )


def _check_positions(cfg: RunConfig, facts: ModelFacts) -> None:
    """The longest prompt plus the longest response must fit the model's positions."""
    if facts.max_positions is None:
        return
    data, new = cfg.data, cfg.rollout.max_new_tokens
    tolerance = float(data.task_kwargs.get("tolerance", 0.01)) if data.task else 0.0
    longest = math.ceil(data.prompt_tokens * (1 + tolerance))
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
        "data.prompt_tokens",
        f"{data.prompt_tokens}{slack} + rollout.max_new_tokens {new} = {longest + new} "
        f"exceeds the model's {facts.max_positions} positions, from {source}",
    )


def _check_rollout(rollout: RolloutSection) -> None:
    # num_generations is checked by GRPOConfig (it is GRPO's group size too).
    r = rollout
    _check_range("rollout.max_new_tokens", r.max_new_tokens, r.max_new_tokens >= 1, "an int >= 1")
    _check_range(
        "rollout.temperature", r.temperature, r.temperature >= 0, "a float >= 0 (0: greedy)"
    )
    _check_range("rollout.top_p", r.top_p, 0 < r.top_p <= 1, "a float in (0, 1] (1: off)")
    _check_range("rollout.top_k", r.top_k, r.top_k >= 0, "an int >= 0 (0: off)")


def _check_rewards(rewards: list[RewardSpec]) -> None:
    if not rewards:
        raise ConfigError("rewards", "empty; list at least one {name, weight}")
    for i, spec in enumerate(rewards):
        try:
            resolve_reward(spec.name)
        except ValueError as exc:
            raise ConfigError(f"rewards[{i}].name", str(exc)) from None
        _check_range(f"rewards[{i}].weight", spec.weight, True, "a finite float")


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
    _check_range("train.chunk_size", train.chunk_size, train.chunk_size >= 1, "an int >= 1")
    _check_range("train.log_every", train.log_every, train.log_every >= 1, "an int >= 1")
    for name in ("completions_every", "save_every"):
        value = getattr(train, name)
        _check_range(f"train.{name}", value, value >= 0, "an int >= 0 (0: never)")
    _check_range("train.keep_last", train.keep_last, train.keep_last >= 0, "an int >= 0 (0: all)")
    skips = train.max_skipped_steps
    _check_range("train.max_skipped_steps", skips, skips >= 0, "an int >= 0 (0: stop at the first)")
    if not train.output_dir:
        raise ConfigError("train.output_dir", "empty; a directory for checkpoints and logs")
    if check_paths and Path(train.output_dir).exists() and not Path(train.output_dir).is_dir():
        raise ConfigError(
            "train.output_dir",
            f"{train.output_dir!r} is a file, not a directory; name a directory for "
            "checkpoints and logs",
        )
    if check_paths and train.resume_from not in (None, "latest"):
        _check_exists("train.resume_from", train.resume_from, directory=True)


def _check_distributed(cfg: RunConfig) -> None:
    dist = cfg.distributed
    _check_choice("distributed.mixed_precision", dist.mixed_precision, MIXED_PRECISION)
    if dist.mixed_precision == "bf16" and not dist.fsdp:
        raise ConfigError(
            "distributed.mixed_precision",
            "'bf16' is FSDP2's MixedPrecisionPolicy and needs distributed.fsdp=true; "
            "for bf16 parameters without FSDP set model.dtype=bfloat16",
        )


def _check_memory(memory: MemorySection) -> None:
    from longstraw_core.memory import parse_bytes

    if memory.gpu_mem is not None:
        try:
            parse_bytes(memory.gpu_mem)
        except ValueError as exc:
            raise ConfigError("memory.gpu_mem", f"{exc}; or null for no check") from None
    if memory.gpus is not None:
        _check_range("memory.gpus", memory.gpus, memory.gpus >= 1, "null or an int >= 1")
    headroom = memory.headroom
    _check_range("memory.headroom", headroom, 0 <= headroom < 1, "a float in [0, 1)")


# --------------------------------------------------------------------------- output


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts (W&B's run config)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML, for the log and the output directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check_offload(offload: OffloadSection) -> None:
    for name in ("attention", "recurrent", "latent"):
        _check_choice(f"offload.{name}", getattr(offload, name), PLACEMENTS)
    count = offload.resident_layers
    _check_range("offload.resident_layers", count, count >= 1, "an int >= 1")


def offload_policy(cfg: RunConfig) -> OffloadPolicy | None:
    """The run's ``OffloadPolicy``, or None when every layer type stays on the device."""
    policy = OffloadPolicy.parse(dataclasses.asdict(cfg.offload))
    return policy if policy.active else None
