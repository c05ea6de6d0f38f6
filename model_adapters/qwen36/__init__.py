"""Qwen3.6 (transformers ``qwen3_5``) and its kin: Gated DeltaNet layers + gated full attention.

Three layers in four are Gated DeltaNet (linear attention); the rest are full attention with
a sigmoid output gate. What each layer keeps of the prompt
(``docs/design.md``, "Prefix state per layer kind"):

- full attention: keys (after ``k_norm`` and RoPE) and values, in an ``AttentionKV`` read by
  ``segmented_attention``, exactly like the dense adapter; it grows with the prompt;
- Gated DeltaNet: the causal conv's last ``kernel - 1`` inputs and the recurrent state
  ``[v_heads, d_k, d_v]`` in float32, in a ``RecurrentState``; a fixed size at any length.

Prefill threads both DeltaNet states across chunk boundaries: a chunk's conv runs over the
stored inputs followed by the chunk, and its delta rule starts from the stored recurrent
state. A branch starts from the same stored states and drops the states it ends with, so
branches are independent and the record is never written by scoring. Decoding runs ``B``
branches at once, each from its own copy of the states (``BranchRecurrent``, a fixed size)
that every step replaces; single-token steps use a recurrent delta rule, as transformers' own
cached decoding does (the model's ``torch_recurrent_gated_delta_rule``, or on CUDA fla's
``fused_recurrent_gated_delta_rule``), and the full-attention layers append to per-branch
keys/values like the dense adapter.

Every computation is the model's own: its projections (so LoRA on them keeps working), norms
(the gated RMSNorm included), decay parameters, RoPE module and ``apply_rotary_pos_emb``, MLP
(dense or MoE), and the conv / delta-rule functions of its transformers module. Kernels: on
CUDA in half precision, flash-linear-attention's ``chunk_gated_delta_rule`` and the
``causal_conv1d`` package when installed; otherwise transformers' pure-torch functions
(``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``), which differentiate with respect to
the initial states too.

Registered for ``qwen3_5`` (``Qwen3_5ForConditionalGeneration`` text-only, or
``Qwen3_5ForCausalLM``), ``qwen3_5_text``, the MoE variants ``qwen3_5_moe`` /
``qwen3_5_moe_text`` (same layers, MoE MLP) and ``qwen3_next`` (same layers; the DeltaNet
projections are packed per key head, which the model's ``fix_query_key_value_ordering``
unpacks, and RoPE is single-axis).

NOTE: what has been run. The pure-torch path is tested on CPU against the transformers
models' own forward and their cache. The flash-linear-attention and causal-conv1d calls were
written from those packages' sources without a GPU (the argument handling is tested on CPU
with stand-ins); ``tests/families/test_qwen36_adapter.py`` compares them with the torch path when CUDA
and the packages are present.

The family lives in this package, one job per module: ``family`` (its declaration: LoRA
targets, tiny configs, the Qwen3.6-27B preset), ``kernels`` (finding the conv and delta-rule
kernels: fla, causal-conv1d, or transformers' pure-torch functions), ``layers`` (the gated
attention and Gated DeltaNet blocks) and ``adapter`` (the layer, registered with
``@register_adapter``).
"""

from model_adapters.qwen36.adapter import FULL_ATTENTION, LINEAR_ATTENTION, Qwen36Adapter
from model_adapters.qwen36.family import FAMILY
from model_adapters.qwen36.kernels import DeltaNetKernels, deltanet_kernels
from model_adapters.qwen36.layers import (
    deltanet_projections,
    run_gated_attention,
    run_gated_deltanet,
)

__all__ = [
    "FAMILY",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "DeltaNetKernels",
    "Qwen36Adapter",
    "deltanet_kernels",
    "deltanet_projections",
    "run_gated_attention",
    "run_gated_deltanet",
]
