"""Model knowledge the config needs: default LoRA targets per model type (declared by each
model family, ``longstraw_core.adapters.family``), and the facts (type, position limit, vocabulary)
validation reads from a tiny config or ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longstraw_core.adapters import registry
from longstraw_core.schema.run_config import ConfigError, LoraSection, ModelSection


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
        config = AutoConfig.for_model(
            model_type, **{**registry.tiny_configs()[model_type], **overrides}
        )
    except Exception as exc:  # huggingface_hub strict-dataclass errors and plain ValueErrors
        bad = next((k for k in overrides if repr(k) in str(exc) or k in str(exc)), None)
        key = f"model.tiny_overrides.{bad}" if bad else "model.tiny_overrides"
        raise ConfigError(key, str(exc).strip()) from None
    return ModelFacts(model_type, config.max_position_embeddings, config.vocab_size)


def lora_targets(lora: LoraSection, model_type: str | None) -> list[str]:
    """``lora.target_modules``, or the default for ``model_type`` (``config.model_type``)."""
    if lora.target_modules is not None:
        return list(lora.target_modules)
    if model_type not in registry.default_lora_targets():
        raise ConfigError(
            "lora.target_modules",
            f"no default for model_type {model_type!r} (defaults exist for "
            f"{', '.join(sorted(registry.default_lora_targets()))}); list the modules to adapt",
        )
    return list(registry.default_lora_targets()[model_type])
