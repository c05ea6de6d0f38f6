"""Tiny random-init models built from transformers config classes.

No weights can be downloaded in CI or the demos, so every test, demo and benchmark builds
its model here: the real transformers architectures at toy sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from longstraw_core.adapters import registry

# Decay rates of the tiny Gated DeltaNet layers: A in [0.02, 0.5] with dt_bias = 1 gives a
# per-token decay exp(g) of roughly 0.5..0.97. transformers' initialisation draws A up to 16
# (decay ~exp(-20)), which forgets the recurrent state within a token or two, so a test could
# not tell a correctly threaded state from a dropped one.
_TINY_DECAY_RANGE = (0.02, 0.5)


def slow_gated_deltanet_decay(model: PreTrainedModel, seed: int = 0) -> None:
    """Redraw every Gated DeltaNet layer's ``A_log`` so its state lasts many tokens."""
    generator = torch.Generator().manual_seed(seed)
    low, high = _TINY_DECAY_RANGE
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                rates = torch.rand(module.A_log.shape, generator=generator, dtype=torch.float64)
                module.A_log.copy_(torch.log(low + (high - low) * rates))


def tiny_model(
    model_type: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    initializer_range: float = 0.1,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """A random-init causal LM of ``model_type`` at toy size, in eval mode.

    ``initializer_range`` is larger than the usual 0.02 so attention is far from uniform
    and equivalence tests can tell a wrong position or mask from a right one.
    """
    if model_type not in registry.tiny_configs():
        raise ValueError(
            f"no tiny config for {model_type!r}; known: {sorted(registry.tiny_configs())}"
        )
    settings = {**registry.tiny_configs()[model_type], "initializer_range": initializer_range}
    if dtype == torch.float64:  # MoE grouped matmul has no float64 CPU kernel: eager experts
        settings["experts_implementation"] = "eager"
    settings |= overrides
    config = AutoConfig.for_model(model_type, **settings)
    attn_implementation = reference_attention(config, attn_implementation)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    slow_gated_deltanet_decay(model, seed)  # no-op for models without Gated DeltaNet layers
    return model.eval()


def reference_attention(config: Any, attn_implementation: str) -> str:
    """The ``attn_implementation`` transformers' own forward (the reference, ``generate``)
    runs for ``config``: the one asked for, but ``"eager"`` for ``"sdpa"`` where the causal LM
    class has no SDPA path (gpt-oss: its attention sinks). The adapters attend themselves."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        return "eager"
    return attn_implementation
