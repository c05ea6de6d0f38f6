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

# Hybrid Gated DeltaNet + gated full attention (Qwen3.6 = transformers ``qwen3_5``): 4 layers,
# one full-attention layer in 4 (``full_attention_interval`` overrides), GQA, partial RoPE with
# multi-axis sections, 4 value heads over 2 key heads, and d_k != d_v so a transposed state
# cannot pass the equivalence tests.
_HYBRID_DEFAULTS: dict[str, Any] = {
    **_DENSE_DEFAULTS,
    "num_hidden_layers": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_HYBRID_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

# MLA + DSA + MoE (GLM-5.x, DeepSeek-V3.2): a dense-MLP layer then MoE layers; the latent
# (32 + 8 per position) is smaller than the expanded per-head K/V (4 x (24 + 16)). 16 indexer
# heads keep exact ties out of the index scores (their ReLU makes ties common with few heads).
_MLA_DSA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(_DENSE_DEFAULTS),
    "llama": dict(_DENSE_DEFAULTS),
    "qwen2": dict(_DENSE_DEFAULTS),
    # GLM-5.x: layers 0 and 2 run their own DSA indexer, 1 and 3 reuse the previous selection.
    "glm_moe_dsa": {**_MLA_DSA_DEFAULTS, "indexer_types": ["full", "shared", "full", "shared"]},
    "deepseek_v32": dict(_MLA_DSA_DEFAULTS),
    "qwen3_5_text": dict(_HYBRID_DEFAULTS),
    "qwen3_5_moe_text": {**_HYBRID_DEFAULTS, **_HYBRID_MOE},
    # Qwen3-Next: MoE on every other layer (decoder_sparse_step=2), dense MLP on the rest.
    "qwen3_next": {
        **_HYBRID_DEFAULTS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        **_HYBRID_MOE,
        "decoder_sparse_step": 2,
    },
}

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
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    settings = {**TINY_CONFIGS[model_type], "initializer_range": initializer_range}
    if dtype == torch.float64:  # MoE grouped matmul has no float64 CPU kernel: eager experts
        settings["experts_implementation"] = "eager"
    settings |= overrides
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    slow_gated_deltanet_decay(model, seed)  # no-op for models without Gated DeltaNet layers
    return model.eval()
