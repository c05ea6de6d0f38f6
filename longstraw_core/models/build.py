"""Building what a run trains from its config: the model (with LoRA), optimizer and schedule.

Recipes call these so they stay short; each function does one thing the config describes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from longstraw_core.config import LoraSection, ModelSection, OptimSection, hub, lora_targets
from longstraw_core.models.tiny import reference_attention, tiny_model
from longstraw_core.tensors.quantization import quantize_nf4

if TYPE_CHECKING:
    from peft import PeftModel

_SCHEDULES = {
    "constant": lambda opt, warmup, steps: get_constant_schedule_with_warmup(opt, warmup),
    "cosine": get_cosine_schedule_with_warmup,
    "linear": get_linear_schedule_with_warmup,
}


def build_model(model: ModelSection, seed: int) -> PreTrainedModel:
    """The policy's transformers model: a local checkpoint, or a random-init toy (``tiny``);
    with ``model.quantization=nf4`` its decoder linears in 4-bit (``quantization``)."""
    dtype = getattr(torch, model.dtype)
    if model.tiny is not None:
        built = tiny_model(
            model.tiny,
            dtype=dtype,
            seed=seed,
            attn_implementation=model.attn_implementation,
            **model.tiny_overrides,
        )
    else:
        hub.fetch_weights(model.path)  # a Hub id's snapshot: its weights, same commit
        config = AutoConfig.from_pretrained(
            model.path, trust_remote_code=model.trust_remote_code, local_files_only=True
        )
        built = AutoModelForCausalLM.from_pretrained(
            model.path,
            dtype=dtype,
            attn_implementation=reference_attention(config, model.attn_implementation),
            trust_remote_code=model.trust_remote_code,
            local_files_only=True,
        )
    if model.quantization == "nf4":
        quantize_nf4(built, compute_dtype=dtype)
    return built


def add_lora(model: PreTrainedModel, lora: LoraSection) -> PeftModel | PreTrainedModel:
    """Wrap ``model`` with PEFT LoRA adapters when ``lora.enabled`` (only they then train)."""
    if not lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(lora, model.config.model_type),
        target_parameters=list(lora.target_parameters) if lora.target_parameters else None,
    )
    with _targets_as_written(), _without_peft_deprecation():
        return get_peft_model(model, config)


def load_lora(model: PreTrainedModel, directory: str | Path) -> PeftModel:
    """``PeftModel.from_pretrained`` for adapters this package saved: the modules they were
    trained on get them back (see ``_targets_as_written``)."""
    from peft import PeftModel

    with _targets_as_written(), _without_peft_deprecation():
        return PeftModel.from_pretrained(model, directory)


@contextlib.contextmanager
def _without_peft_deprecation() -> Iterator[None]:
    """peft (to at least 0.21) reads transformers v5's deprecated ``is_gradient_checkpointing``
    when it wraps a model, a FutureWarning on every LoRA run that no user can act on; only
    that warning is silenced, only while peft wraps."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


@contextlib.contextmanager
def _targets_as_written() -> Iterator[None]:
    """While peft injects adapters, adapt exactly the modules ``target_modules`` names.

    NOTE: on transformers v5, peft (0.19 to at least 0.21) rewrites ``gate_proj``,
    ``up_proj`` and ``down_proj`` targets of MoE models (glm_moe_dsa, qwen3_next, ...) into
    the routed experts' fused 3-D parameters, so that adapters trained on transformers v4
    still load. That leaves the dense MLP layers and shared experts, which those names also
    match, without LoRA, and puts LoRA on every routed expert instead, whose per-expert
    delta weights peft materializes in each forward (huggingface/peft#3711). Our targets are
    written for the v5 modules, so the conversion is switched off while they are injected;
    it is a no-op for dense models either way.
    """
    try:  # peft before 0.19 has no such conversion, and nothing to switch off
        import peft.utils.transformers_weight_conversion as peft_conversion
    except ImportError:
        yield
        return
    convert = peft_conversion.convert_peft_config_for_transformers
    peft_conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        peft_conversion.convert_peft_config_for_transformers = convert


def build_optimizer(model: torch.nn.Module, optim: OptimSection) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only (LoRA: the adapters)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        parameters, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
    )


def schedule_change(optim: OptimSection, steps: int, saved_steps: int | None) -> str | None:
    """What changes when a run resumes with ``train.steps`` other than the checkpoint's:
    a schedule built over the run's length (cosine, linear) continues on the new curve, so
    the learning rate jumps. None when nothing changes (same length, constant schedule, or
    a checkpoint that did not record its length)."""
    if saved_steps is None or saved_steps == steps or optim.scheduler == "constant":
        return None
    return (
        f"train.steps={steps}, but the checkpoint's {optim.scheduler} learning-rate schedule "
        f"was built for {saved_steps} steps: the learning rate now follows a {steps}-step "
        f"schedule from the resumed step (set train.steps={saved_steps} to keep the old one)"
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimSection, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule after ``optim.warmup_steps`` of linear warmup."""
    return _SCHEDULES[optim.scheduler](optimizer, optim.warmup_steps, total_steps)
