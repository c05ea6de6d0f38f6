"""Where a plan's model and workload come from: presets, checkpoints' config.json, run configs."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longstraw_core.adapters import registry
from longstraw_core.offload import OffloadPolicy
from longstraw_core.plan.chunking import ChunkChoice, auto_chunk, resolve_chunk
from longstraw_core.plan.model import ModelSpec, Workload

# The LoRA target modules of the shipped paper-scale configs, per preset.
PRESET_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "Qwen3.6-27B": (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    "GLM-5.2": (
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    # gpt-oss: the attention projections (the family's default targets); its experts are
    # fused 3-D parameters that ``target_modules`` cannot reach.
    "gpt-oss-20b": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gpt-oss-120b": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@dataclass(frozen=True)
class Scenario:
    """One paper-scale setting: a preset, a prompt length, GPUs, LoRA or full, and the
    pipeline stages each group's prompt is spread over (``gpus = stages x replicas``)."""

    preset: str
    prompt_tokens: int
    gpus: int
    gpu_mem: str
    lora_rank: int
    lora_targets: tuple[str, ...]
    stages: int = 1


def scenario_workload(scenario: Scenario, group: int, gradient: str) -> Workload:
    """The shipped 8-/32-GPU configs' settings for a scenario (the ``--preset`` defaults)."""
    from longstraw_core.tensors.memory import parse_bytes

    lora = scenario.lora_rank > 0
    return Workload(
        prompt_tokens=scenario.prompt_tokens,
        group=group,
        response_tokens=2048,
        chunk_size=8192,
        gradient=gradient,
        checkpoints="device",
        gpus=scenario.gpus,
        fsdp=True,
        param_dtype=torch.bfloat16 if lora else torch.float32,
        compute_dtype=torch.bfloat16,
        lora_rank=scenario.lora_rank,
        lora_targets=scenario.lora_targets,
        device="cuda",
        budget=parse_bytes(scenario.gpu_mem),
        headroom=0.05,
        activation_checkpointing=True,  # as the shipped GPU configs set it
        stages=scenario.stages,
    )


def preset_config(name: str) -> Any:
    """The transformers config of a named preset (``registry.presets()``)."""
    from transformers import AutoConfig

    if name not in registry.presets():
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(registry.presets())}")
    preset = registry.presets()[name]
    return AutoConfig.for_model(preset.model_type, **preset.config)


def spec_for_preset(name: str, compute_dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    return ModelSpec.from_config(preset_config(name), name, compute_dtype)


def spec_for_config(cfg: Any, compute_dtype: torch.dtype) -> ModelSpec:
    """The model of a ``RunConfig``: its tiny config, or ``model.path/config.json`` (read
    through ``AutoConfig``: no weights), built on ``meta``."""
    from transformers import AutoConfig

    model = cfg.model
    if model.tiny is not None:
        config = AutoConfig.for_model(
            model.tiny, **{**registry.tiny_configs()[model.tiny], **model.tiny_overrides}
        )
        return ModelSpec.from_config(config, f"tiny {model.tiny}", compute_dtype)
    if model.path in registry.presets():
        return spec_for_preset(model.path, compute_dtype)
    config = AutoConfig.from_pretrained(
        model.path, trust_remote_code=model.trust_remote_code, local_files_only=True
    )
    return ModelSpec.from_config(config, Path(model.path).name, compute_dtype)


def plan_for_config(
    cfg: Any,
    prompt_tokens: int | None = None,
    **overrides: Any,
) -> tuple[ModelSpec, Workload]:
    """The model and the step of a ``RunConfig`` (``overrides``: ``workload_from_config``'s);
    LoRA without target modules targets the config's defaults for the model;
    ``train.chunk_size: null``: the chunk ``chunking.auto_chunk`` chooses."""
    spec, work = _spec_and_workload(cfg, prompt_tokens, **overrides)
    return spec, resolve_chunk(spec, work)


def chunk_for_config(
    cfg: Any, prompt_tokens: int | None = None, **overrides: Any
) -> ChunkChoice | None:
    """The chunk ``chunking.auto_chunk`` chooses for a ``RunConfig`` whose
    ``train.chunk_size`` is null, with its reasons (None: the config sets the chunk)."""
    if cfg.train.chunk_size is not None:
        return None
    return auto_chunk(*_spec_and_workload(cfg, prompt_tokens, **overrides))


def _spec_and_workload(
    cfg: Any, prompt_tokens: int | None, **overrides: Any
) -> tuple[ModelSpec, Workload]:
    """``plan_for_config``'s model and workload, the chunk not chosen yet."""
    model_type = None
    if cfg.model.tiny is not None:
        model_type = cfg.model.tiny
    work = workload_from_config(cfg, prompt_tokens, model_type=model_type, **overrides)
    spec = spec_for_config(cfg, work.compute_dtype)
    if work.lora_rank and not work.lora_targets:
        work = dataclasses.replace(work, lora_targets=tuple(_default_targets(cfg, spec)))
    return spec, work


def _default_targets(cfg: Any, spec: ModelSpec) -> list[str]:
    from longstraw_core.config import lora_targets

    return lora_targets(cfg.lora, spec.model_type)


def workload_from_config(
    cfg: Any,
    prompt_tokens: int | None = None,
    *,
    group: int | None = None,
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    offload: OffloadPolicy | str | dict | None = None,
    device: str | None = None,
    model_type: str | None = None,
    stages: int | None = None,
    stage_starts: tuple[int, ...] | None = None,
    replay_pieces: int | None = None,
) -> Workload:
    """The step a ``RunConfig`` runs, with the CLI's overrides (``None``: from the config).

    The budget is ``gpu_mem`` or ``memory.gpu_mem``; ``gpus`` (or ``memory.gpus``) ranks
    shard the parameters when ``distributed.fsdp`` is on. Kernels are CUDA's when a budget
    is known, the CPU's otherwise (``device`` overrides). Without ``gpus`` or
    ``memory.gpus``, a launched run counts its ranks (``WORLD_SIZE``). Pipeline stages:
    ``stages`` or ``distributed.pipeline_stages`` (1 when the key is absent), boundaries
    ``stage_starts`` or ``distributed.stage_starts`` (None: balanced), pieces a replayed
    branch ``replay_pieces`` or ``distributed.replay_pieces`` (None: the schedule's choice).
    ``train.chunk_size: null`` leaves ``chunk_size`` None for ``chunking.resolve_chunk``
    (``plan_for_config`` resolves it: the choice needs the model).
    """
    from longstraw_core.config import lora_targets
    from longstraw_core.tensors.memory import parse_bytes

    memory = getattr(cfg, "memory", None)
    gpu_mem = gpu_mem if gpu_mem is not None else getattr(memory, "gpu_mem", None)
    # torchrun and accelerate launch export WORLD_SIZE: a launched recipe shards over it.
    gpus = gpus or getattr(memory, "gpus", None) or int(os.environ.get("WORLD_SIZE", "1"))
    budget = None if gpu_mem is None else parse_bytes(gpu_mem)
    param_dtype = getattr(torch, cfg.model.dtype)
    # bf16: FSDP2's policy with fsdp, bf16 working weights without (models/mixed_precision.py)
    bf16 = cfg.distributed.mixed_precision == "bf16"
    lora = cfg.lora
    targets: tuple[str, ...] = ()
    if lora.enabled:
        targets = tuple(lora_targets(lora, model_type or _model_type(cfg)))
    return Workload(
        prompt_tokens=prompt_tokens or cfg.data.prompt_tokens,
        group=group or cfg.rollout.num_generations,
        response_tokens=cfg.rollout.max_new_tokens,
        stop_check_every=cfg.rollout.stop_check_every,
        chunk_size=cfg.train.chunk_size,
        chunk_auto=cfg.train.chunk_size is None,
        gradient=cfg.grpo.gradient,
        checkpoints=cfg.grpo.recurrent_checkpoints,
        keep_attention_outputs=cfg.grpo.keep_attention_outputs,
        gpus=gpus,
        fsdp=cfg.distributed.fsdp,
        reshard_after_forward=cfg.distributed.reshard_after_forward,
        rollout_gather=getattr(cfg.distributed, "rollout_gather", "auto"),
        reference_model=float(getattr(cfg.grpo, "beta", 0.0)) != 0.0 and not lora.enabled,
        param_dtype=param_dtype,
        compute_dtype=torch.bfloat16 if bf16 else param_dtype,
        lora_rank=lora.r if lora.enabled else 0,
        lora_targets=targets,
        offload=_offload_of(cfg, offload),
        device=device or ("cuda" if budget is not None else "cpu"),
        budget=budget,
        headroom=getattr(memory, "headroom", 0.0) if budget is not None else 0.0,
        activation_checkpointing=_activation_checkpointing(cfg),
        stages=stages or int(getattr(cfg.distributed, "pipeline_stages", None) or 1),
        stage_starts=_stage_starts(cfg, stage_starts),
        replay_pieces=replay_pieces or getattr(cfg.distributed, "replay_pieces", None),
        quantization=getattr(cfg.model, "quantization", None),
    )


def _stage_starts(cfg: Any, override: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The CLI's stage starts, else the config's ``distributed.stage_starts`` (if any)."""
    starts = override if override is not None else getattr(cfg.distributed, "stage_starts", None)
    return None if starts is None else tuple(int(start) for start in starts)


def _activation_checkpointing(cfg: Any) -> bool:
    """The config's ``train.activation_checkpointing`` (False when the key is absent)."""
    return bool(getattr(getattr(cfg, "train", None), "activation_checkpointing", False))


def _model_type(cfg: Any) -> str | None:
    if cfg.model.tiny is not None:
        return cfg.model.tiny
    if cfg.model.path in registry.presets():
        return registry.presets()[cfg.model.path].model_type
    from longstraw_core.config import model_facts

    return model_facts(cfg.model, check_paths=True).model_type


def _offload_of(cfg: Any, override: OffloadPolicy | str | dict | None) -> OffloadPolicy | None:
    """The offload policy: the CLI's, else the config's ``offload`` section."""
    from longstraw_core.config import offload_policy

    return OffloadPolicy.parse(override) if override is not None else offload_policy(cfg)
