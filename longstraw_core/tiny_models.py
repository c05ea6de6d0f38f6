"""Tiny random-init models built from transformers config classes.

No weights can be downloaded in CI or the demos, so every test, demo and benchmark builds
its model here: the real transformers architectures at toy sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

# Small but not degenerate: GQA (4 query heads over 2 KV heads), two layers, RoPE.
_DENSE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(_DENSE_DEFAULTS),
    "llama": dict(_DENSE_DEFAULTS),
    "qwen2": dict(_DENSE_DEFAULTS),
}


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
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    settings = {**TINY_CONFIGS[model_type], "initializer_range": initializer_range, **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    return model.eval()
