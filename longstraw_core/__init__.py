"""LongStraw core: prefix state, segmented attention, prefill, branch scoring, GRPO replay.

import longstraw_core as ls
adapter = ls.adapt(model)
state = adapter.prefill(prompt_ids, chunk_size=4096)
out = ls.rollout(adapter, state, num_generations=8, max_new_tokens=256, eos_token_ids=[eos])
logps = adapter.score(state, response_ids)
result = ls.grpo_step(adapter, prompt_ids, out.responses, rewards, state=state,
                      config=ls.GRPOConfig())
result.loss, result.advantages, result.metrics()  # typed fields; the scalars to log
"""

# First: quiets a bitsandbytes import-time notice before peft imports it (see quantization).
from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.adapters.lookup import adapt
from longstraw_core.adapters.registry import supported_model_types
from longstraw_core.attention import segmented_attention
from longstraw_core.grpo.generation import GenerationBatch
from longstraw_core.grpo.losses import group_advantages
from longstraw_core.grpo.reference_policy import lora_reference
from longstraw_core.grpo.replay import GRPOStepResult, grpo_step
from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.offload import OffloadPolicy
from longstraw_core.rollout.decode import RolloutOutput, rollout
from longstraw_core.schema.grpo import GRPOConfig
from longstraw_core.state.prefix import PrefixState, format_bytes
from longstraw_core.tensors import quantization as _quantization  # noqa: F401

__all__ = [
    "AttentionKV",
    "GRPOConfig",
    "GRPOStepResult",
    "GenerationBatch",
    "ModelAdapter",
    "OffloadPolicy",
    "PrefixState",
    "RolloutOutput",
    "adapt",
    "format_bytes",
    "group_advantages",
    "grpo_step",
    "lora_reference",
    "rollout",
    "segmented_attention",
    "supported_model_types",
]
