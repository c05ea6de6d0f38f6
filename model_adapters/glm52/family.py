"""The GLM-5.x / DeepSeek-V3.2 family's declaration (``FAMILY``: LoRA targets, tiny configs,
the GLM-5.2 preset) and the scratch budget per block of its DSA and sparse attention, which
the planner reads through ``FAMILY.kernel_budgets``."""

from __future__ import annotations

from typing import Any

import torch

from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.adapters.probe import GPU_CHECK, TEST_CAPABILITIES, FamilyProbe, GpuShapes
from longstraw_core.kinds.latent import LatentKV
from longstraw_core.tensors import gpu_emulation
from model_adapters.dense import MLP_TARGETS

# --- the family: what config, tiny models, planner and offload know of it -------------------

# LoRA targets when ``lora.target_modules`` is null: of MLA, both low-rank halves of q and kv
# and ``o_proj``; never the DSA indexer (``wq_b``, ``wk``, ``weights_proj``: frozen during RL,
# as transformers runs it under no_grad). Routed experts are fused 3-D parameters, not
# ``nn.Linear``, so LoRA reaches only the dense MLP layers and the shared experts through
# ``gate/up/down_proj`` (plain peft would move those names onto the routed experts:
# ``longstraw_core.models.build.add_lora`` keeps them as written).
_MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]

# MLA + DSA + MoE (GLM-5.x, DeepSeek-V3.2): a dense-MLP layer then MoE layers; the latent
# (32 + 8 per position) is smaller than the expanded per-head K/V (4 x (24 + 16)). 16 indexer
# heads keep exact ties out of the index scores (their ReLU makes ties common with few heads).
_TINY_MLA_DSA: dict[str, Any] = {
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

# GLM-5.2 is assumed to keep GLM-5's architecture (``glm_moe_dsa``, zai-org/GLM-5): 78
# layers (3 dense-MLP, 75 MoE with 256 routed experts, top-8, 1 shared), hidden 6144, MLA
# with q_lora 2048 / kv_lora 512 / rope 64 / 64 heads, a DSA indexer (32 heads of 128,
# top-2048) on every layer, vocabulary 154880: transformers' GlmMoeDsaConfig defaults,
# which document that checkpoint. Not modelled: the MTP layer.
_GLM52 = Preset(
    "glm_moe_dsa",
    {},
    "transformers GlmMoeDsaConfig defaults (zai-org/GLM-5; GLM-5.2 assumed identical)",
)

# What the cross-cutting tests and benchmarks build of it: GLM-5.x (glm_moe_dsa), on every
# CPU test and the GPU check's recipe; not in the prefill or prefix-memory benchmarks. Its
# runs record no attention call of their own: the sparse latent attention does not go
# through ``segmented_attention`` once the context exceeds its top-k. Its MoE router
# computes in float32 whatever the model's dtype.
PROBE = FamilyProbe(
    model_type="glm_moe_dsa",
    capabilities=TEST_CAPABILITIES | {GPU_CHECK},
    gpu=GpuShapes(
        recipe=("recipes/grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml"),
        recipe_dims={
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "index_head_dim": 64,
        },
    ),
    expected_kernels=(),
    float32_inside=True,
)

FAMILY = ModelFamily(
    name="glm52",
    model_types=("glm_moe_dsa", "deepseek_v32"),
    layer_kinds=(LatentKV.kind,),
    lora_targets={
        "glm_moe_dsa": _MLA_TARGETS + MLP_TARGETS,
        "deepseek_v32": _MLA_TARGETS + MLP_TARGETS,
    },
    tiny_configs={
        # GLM-5.x: layers 0 and 2 run their own DSA indexer, 1 and 3 reuse the previous
        # selection.
        "glm_moe_dsa": {**_TINY_MLA_DSA, "indexer_types": ["full", "shared", "full", "shared"]},
        "deepseek_v32": dict(_TINY_MLA_DSA),
    },
    presets={"GLM-5.2": _GLM52},
    kernel_budgets=lambda device_type: {"sparse_work_elements": work_elements(device_type)},
    probe=PROBE,
)


# Elements of scratch per block (indexer scores, gathered latent rows). On a CPU ~16 MB in
# fp32 keeps blocks in cache. On a GPU each block is a few kernel launches, and at GLM-5.2's
# widths 2^22 elements is ONE query per sparse-attention block and 2,048 keys per top-k
# block: millions of launches per layer for a million-token prompt (found by the dry run at
# real dimensions, ``longstraw_core.scale_check``). 2^28 (1 GiB in fp32) gives 68 queries
# and 65,536 keys per block.
_WORK_ELEMENTS = 1 << 22
_GPU_WORK_ELEMENTS = 1 << 28


def work_elements(device_type: str = "cpu") -> int:
    """The block budget on a ``device_type`` device as it is now (read when called: tests
    patch it), for the planner."""
    return _GPU_WORK_ELEMENTS if device_type == "cuda" else _WORK_ELEMENTS


def work_elements_like(like: torch.Tensor) -> int:
    """The block budget for work on ``like``'s device (a dry run's stand-in for a GPU's
    tensor gets the GPU's)."""
    return work_elements("cuda" if gpu_emulation.takes_gpu_path(like) else "cpu")
