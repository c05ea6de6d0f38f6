"""Per-architecture adapters: how each model family keeps and reads its prefix state."""

from model_adapters import dense, glm52, qwen36
from model_adapters.base import ModelAdapter, Span
from model_adapters.registry import adapt, register_adapter, supported_model_types

__all__ = [
    "ModelAdapter",
    "Span",
    "adapt",
    "dense",
    "glm52",
    "qwen36",
    "register_adapter",
    "supported_model_types",
]
