"""The Qwen3.6 family's declaration (``FAMILY``): LoRA targets, tiny configs of the hybrid,
MoE and Qwen3-Next variants, and the Qwen3.6-27B preset."""

from __future__ import annotations

from typing import Any

from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.adapters.probe import (
    BENCHMARK_CAPABILITIES,
    TEST_CAPABILITIES,
    FamilyProbe,
    GpuShapes,
)
from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.recurrent import RecurrentState
from model_adapters.dense import ATTENTION_TARGETS, BENCH_WIDE, MLP_TARGETS, TINY_DENSE

# --- the family: what config, tiny models, planner and offload know of it -------------------

# LoRA targets when ``lora.target_modules`` is null: attention and MLP projections, and of
# Gated DeltaNet the q/k/v and output-gate projections and ``out_proj``; not ``in_proj_a`` /
# ``in_proj_b`` (per-head decay and write-strength inputs: a handful of outputs each, and
# adapting them changes how long the recurrent state remembers).
_DELTANET_TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj"]
_HYBRID_TARGETS = ATTENTION_TARGETS + _DELTANET_TARGETS + MLP_TARGETS

# Hybrid Gated DeltaNet + gated full attention (Qwen3.6 = transformers ``qwen3_5``): 4 layers,
# one full-attention layer in 4 (``full_attention_interval`` overrides), GQA, partial RoPE with
# multi-axis sections, 4 value heads over 2 key heads, and d_k != d_v so a transposed state
# cannot pass the equivalence tests.
_TINY_HYBRID: dict[str, Any] = {
    **TINY_DENSE,
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
_TINY_HYBRID_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

# Qwen3.6-27B is the text decoder of the ``qwen3_5`` checkpoint (Qwen/Qwen3.6-27B): the
# numbers are the published model card's (hidden 5120, 64 layers as 16 x (3 Gated DeltaNet +
# 1 gated attention), DeltaNet 48 value / 16 key heads of 128, attention 24 q / 4 kv heads of
# 256 with 64 rotary dims, MLP 17408, vocabulary 248320, untied head). Not modelled: the
# vision encoder (~0.4B parameters, unused by text-only GRPO) and the MTP layer. The planner
# does not check positions (the card says 262144 native, ~1M with YaRN): memory does not
# depend on the RoPE limit.
_QWEN36_27B = Preset(
    "qwen3_5_text",
    {
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "full_attention_interval": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    },
    "Qwen/Qwen3.6-27B model card (text decoder; vision encoder and MTP layer left out)",
)

# What the cross-cutting tests and benchmarks build of it: the text decoder (qwen3_5_text),
# on every test and benchmark. On a GPU fla's Gated DeltaNet kernels want head dims of 64 and
# up; the Gated DeltaNet rule computes in float32 whatever the model's dtype.
PROBE = FamilyProbe(
    model_type="qwen3_5_text",
    capabilities=TEST_CAPABILITIES | BENCHMARK_CAPABILITIES,
    gpu=GpuShapes(
        recipe=("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
        recipe_dims={"head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
        bench_dims={
            **BENCH_WIDE,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
        },
    ),
    expected_kernels=("attention", "deltanet"),
    float32_inside=True,
)

FAMILY = ModelFamily(
    name="qwen36",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
    layer_kinds=(RecurrentState.kind, AttentionKV.kind),
    lora_targets={
        "qwen3_5": _HYBRID_TARGETS,
        "qwen3_5_text": _HYBRID_TARGETS,
        "qwen3_5_moe": _HYBRID_TARGETS,
        "qwen3_5_moe_text": _HYBRID_TARGETS,
        # Qwen3-Next fuses q/k/v and the output gate into one projection.
        "qwen3_next": [*ATTENTION_TARGETS, "in_proj_qkvz", "out_proj", *MLP_TARGETS],
    },
    tiny_configs={
        "qwen3_5_text": dict(_TINY_HYBRID),
        "qwen3_5_moe_text": {**_TINY_HYBRID, **_TINY_HYBRID_MOE},
        # Qwen3-Next: MoE on every other layer (decoder_sparse_step=2), dense MLP on the rest.
        "qwen3_next": {
            **_TINY_HYBRID,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            **_TINY_HYBRID_MOE,
            "decoder_sparse_step": 2,
        },
    },
    presets={"Qwen3.6-27B": _QWEN36_27B},
    probe=PROBE,
)
