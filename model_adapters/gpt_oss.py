"""gpt-oss (transformers' ``gpt_oss``): the dense adapter's layers with attention sinks and a
mixture of experts.

A gpt-oss decoder layer is a dense one (pre-norm RMSNorm, GQA attention with biases, RoPE,
the model's own YaRN ``rotary_emb``) but for three things:

- ``config.layer_types`` alternates ``sliding_attention`` and ``full_attention``: the dense
  adapter's windows (``kinds.window`` for the sliding layers, ``kinds.attention`` for the
  full ones) serve them as they stand.
- Every attention layer has learned sinks (``self_attn.sinks``, one logit per query head):
  transformers' ``eager_attention_forward`` appends them as one more softmax column and drops
  it after the softmax. ``segmented_attention(sink=)`` does the same on every backend (the
  fused ones fold the sink in after their kernels; not yet run on a GPU), and the sinks get
  their gradients there, through the prompt's chunks in exact mode too.
- The MLP is ``GptOssMLP`` (top-k router, ``GptOssExperts`` with its clamped gated
  activation), which returns ``(hidden, router_scores)``: the layer keeps the first, as the
  model does. The experts run the model's own module, routing per token, so a branch and
  the prompt are routed exactly as the full sequence is.

No prefix state is new: nothing is stored per layer beyond the dense layers' keys and
values (the sinks are parameters, not state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.adapters.model_functions import model_function
from longstraw_core.adapters.probe import TEST_CAPABILITIES, FamilyProbe
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.window import WindowKV
from model_adapters.dense import ATTENTION_TARGETS, TINY_DENSE, DenseAdapter

# LoRA targets when ``lora.target_modules`` is null: the attention projections. The experts
# are fused 3-D parameters (``GptOssExperts.gate_up_proj`` / ``down_proj``), not
# ``nn.Linear``: ``target_modules`` cannot reach them; peft's ``target_parameters`` does
# (``lora.target_parameters: EXPERT_PARAMETERS``, rank r per expert, no dropout). The router
# stays frozen, as the other MoE family leaves it.
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# The tiny model: the dense one's widths, four layers (sliding, full, sliding, full), four
# experts of which each token takes two, a window far shorter than the tests' prompts, a
# swiglu clamp the tiny activations reach (transformers' 7.0 would never clamp here), and
# gpt-oss' own YaRN RoPE (transformers' default rope_parameters).
TINY_GPT_OSS: dict[str, Any] = {
    **TINY_DENSE,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "swiglu_limit": 1.0,
    "max_position_embeddings": 131072,  # gpt-oss' own: YaRN's factor 32 x its original 4096
}

# gpt-oss-20b and gpt-oss-120b (openai/gpt-oss-20b, openai/gpt-oss-120b config.json): the
# same layer, 2880 wide (64 query / 8 key-value heads of 64, attention biases and sinks),
# experts of 2880 (top-4), vocabulary 201088, untied head, sliding/full layers in turn with a
# 128-token window, YaRN RoPE (factor 32 over 4096: 131072 positions). They differ in depth
# and experts: 24 layers of 32 experts, 36 of 128. Everything not written is transformers'
# GptOssConfig default, which is the 120b's config. The MXFP4 checkpoints' expert weights
# load dequantized (transformers does without a GPU kernel): the planner counts them in the
# model's dtype, as they train.
_GPT_OSS_LAYER: dict[str, Any] = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
_GPT_OSS_20B = Preset(
    "gpt_oss",
    {**_GPT_OSS_LAYER, "num_hidden_layers": 24, "num_local_experts": 32},
    "openai/gpt-oss-20b config.json (transformers GptOssConfig with 24 layers, 32 experts)",
)
_GPT_OSS_120B = Preset(
    "gpt_oss",
    {**_GPT_OSS_LAYER, "num_hidden_layers": 36, "num_local_experts": 128},
    "openai/gpt-oss-120b config.json (transformers GptOssConfig defaults: 36 layers, 128 experts)",
)

# Every CPU test of the family matrix (offload, QLoRA, loading, mixed precision, pipeline,
# TRL's losses, the demo): checked with -k gpt_oss. No GPU benchmark yet: the fused backends
# take its sinks (folded in after their kernels) but have not run them on a GPU.
PROBE = FamilyProbe(
    model_type="gpt_oss",
    capabilities=TEST_CAPABILITIES,
    expected_kernels=("attention",),
)

FAMILY = ModelFamily(
    name="gpt_oss",
    model_types=("gpt_oss",),
    layer_kinds=(AttentionKV.kind, WindowKV.kind),
    lora_targets={"gpt_oss": list(ATTENTION_TARGETS)},
    tiny_configs={"gpt_oss": TINY_GPT_OSS},
    presets={"gpt-oss-20b": _GPT_OSS_20B, "gpt-oss-120b": _GPT_OSS_120B},
    probe=PROBE,
)


@register_adapter
class GptOssAdapter(DenseAdapter):
    """gpt-oss: the dense adapter's layers (full and sliding-window attention) with attention
    sinks and the model's mixture-of-experts MLP."""

    family = FAMILY
    llama_norm = False  # GptOssRMSNorm casts after the weight

    def check_model(self) -> None:
        super().check_model()
        # The pure-torch RoPE (not the hub kernel transformers may swap in): exact on CPU.
        attention = self.decoder.layers[0].self_attn
        self.apply_rotary = model_function(type(attention), "apply_rotary_pos_emb", pure=True)
        if not all(isinstance(getattr(layer.self_attn, "sinks", None), nn.Parameter)
                   for layer in self.decoder.layers):  # fmt: skip
            raise ValueError("a gpt-oss attention layer has no sinks parameter")

    def attention_sink(self, layer: nn.Module) -> torch.Tensor:
        return layer.self_attn.sinks

    def run_mlp(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return layer.mlp(hidden)[0]  # GptOssMLP returns (hidden, router_scores)
