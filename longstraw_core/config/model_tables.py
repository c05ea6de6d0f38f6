"""Model knowledge the config needs: default LoRA targets per model type, and the facts
(type, position limit, vocabulary) validation reads from a tiny config or ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longstraw_core.config.schema import ConfigError, LoraSection, ModelSection
from longstraw_core.tiny_models import TINY_CONFIGS

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


@dataclass(frozen=True)
class ModelFacts:
    """What validation can learn about the model without loading weights (None: unknown)."""

    model_type: str | None
    max_positions: int | None
    vocab_size: int | None


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
