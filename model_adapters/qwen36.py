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
with stand-ins); ``tests/test_qwen36_adapter.py`` compares them with the torch path when CUDA
and the packages are present.

This module is the family's one home (its declaration, the DeltaNet conv and delta rule with
their kernels, the gated attention, the layer): longer than most, because splitting it would
scatter one family over several rooms, which ``docs/design.md`` ("Adding a model family")
rules out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_core import gpu_emulation
from longstraw_core.adapters.base import ModelAdapter, Span, as_token_ids
from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.adapters.model_functions import RotaryFn, model_function, model_rotary_function
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.kinds.attention import AttentionKV, BranchKV
from longstraw_core.kinds.recurrent import BranchRecurrent, RecurrentState
from longstraw_core.offload import OffloadPolicy, home_options
from longstraw_core.state import PrefixState
from model_adapters.dense import ATTENTION_TARGETS, MLP_TARGETS, TINY_DENSE, attend_with_state

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

FAMILY = ModelFamily(
    name="qwen36",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
    layer_kinds={RecurrentState.kind: "recurrent", AttentionKV.kind: "attention"},
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
)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# RoPE variants whose frequencies depend on the length of each forward call: a chunked prefill
# cannot reproduce the full-sequence forward with them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Token ids that stand for images/videos in the multimodal config: they need pixel inputs and
# 3-D positions, which a text-only adapter does not have.
_VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id")
_FLA_DTYPES = (torch.float16, torch.bfloat16)  # fla's chunk kernel refuses float32
_CAUSAL_CONV1D_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CAUSAL_CONV1D_ACTIVATIONS = (None, "silu", "swish")


# --- kernels ----------------------------------------------------------------------------------

ConvFn = Callable[..., torch.Tensor]
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class DeltaNetKernels:
    """The two sequence kernels of a Gated DeltaNet layer, with transformers' signatures.

    ``conv(x [B, D, T], weight [D, K], bias, activation=...) -> [B, D, T]`` (causal, zero
    left padding); ``delta_rule(q, k, v, g=, beta=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=) -> (out [B, T, HV, DV], final_state [B, HV, DK, DV] | None)``.
    ``step``: the same contract, for single-token decoding steps (``None``: ``delta_rule``).
    """

    conv: ConvFn
    delta_rule: DeltaRuleFn
    names: tuple[str, str]
    step: DeltaRuleFn | None = None

    def rule_for(self, length: int) -> DeltaRuleFn:
        """The delta-rule kernel for a span of ``length`` positions."""
        return self.step if length == 1 and self.step is not None else self.delta_rule


@functools.cache
def _fla_chunk_gated_delta_rule() -> DeltaRuleFn | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # ImportError, or triton failing to load without a GPU
        return None
    return chunk_gated_delta_rule


@functools.cache
def _fla_fused_recurrent_gated_delta_rule() -> DeltaRuleFn | None:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:
        return None
    return fused_recurrent_gated_delta_rule


@functools.cache
def _causal_conv1d_package() -> ConvFn | None:
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception:
        return None
    return causal_conv1d_fn


def _fla_delta_rule(chunk_gated_delta_rule: DeltaRuleFn) -> DeltaRuleFn:
    """A flash-linear-attention delta-rule kernel (the chunked or the fused recurrent one:
    they share the keywords used here) behind transformers' signature.

    Older fla releases need as many key heads as value heads, so grouped keys/queries are
    repeated first (exact: the L2 norm is per head vector). The initial state goes in as a
    contiguous float32 tensor, as fla keeps its states.
    """

    def delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        use_qk_l2norm_in_kernel: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        groups = value.shape[2] // key.shape[2]
        if groups > 1:
            query = query.repeat_interleave(groups, dim=2)
            key = key.repeat_interleave(groups, dim=2)
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        return chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )

    return delta_rule


def _fla_decode_step(fused: DeltaRuleFn, chunked: DeltaRuleFn) -> DeltaRuleFn:
    """Single-token steps through fla's fused recurrent kernel, as transformers' cached
    decoding does: the chunked kernel pads one token to a whole chunk of 64.

    The fused kernel has no backward (fla raises in it), so a step that autograd records
    (some input requires grad, grad mode on) goes through the chunked kernel instead.
    """

    def step(*tensors: torch.Tensor, **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs = [*tensors, *(v for v in options.values() if isinstance(v, torch.Tensor))]
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return chunked(*tensors, **options)
        return fused(*tensors, **options)

    return step


def deltanet_kernels(
    deltanet: nn.Module, device: torch.device, dtype: torch.dtype, *, emulated: bool = False
) -> DeltaNetKernels:
    """The fastest available kernels for tensors on ``device`` in ``dtype``.

    flash-linear-attention on CUDA for float16/bfloat16, causal-conv1d on CUDA for the
    dtypes and activations it implements; transformers' pure-torch functions elsewhere. The
    pure-torch path steps single tokens with the model's recurrent function (the chunked
    one would pad each token to a whole chunk); with fla they go through its fused
    recurrent kernel when it is there (``_fla_decode_step``), else its chunked one.
    ``emulated``: fake tensors standing in for CUDA ones (``gpu_emulation``) get fla's
    shape-only stand-ins, as a CUDA run with fla installed would run fla.
    """
    conv, conv_name = model_function(type(deltanet), "causal_conv1d_fn", pure=True), "torch"
    rule = model_function(type(deltanet), "torch_chunk_gated_delta_rule", pure=True)
    step = model_function(type(deltanet), "torch_recurrent_gated_delta_rule", pure=True)
    rule_name = "torch"
    if device.type == "cuda" and not emulated:
        package_conv = _causal_conv1d_package()
        if (
            package_conv is not None
            and dtype in _CAUSAL_CONV1D_DTYPES
            and deltanet.activation in _CAUSAL_CONV1D_ACTIVATIONS
        ):
            conv, conv_name = package_conv, "causal_conv1d"
    if device.type == "cuda" or emulated:
        fla_rule, fused = _fla_chunk_gated_delta_rule(), _fla_fused_recurrent_gated_delta_rule()
        if emulated:
            fla_rule = gpu_emulation.chunk_gated_delta_rule
            fused = gpu_emulation.fused_recurrent_gated_delta_rule
        if fla_rule is not None and dtype in _FLA_DTYPES:
            rule, rule_name, step = _fla_delta_rule(fla_rule), "fla", None
            if fused is not None:
                step = _fla_decode_step(_fla_delta_rule(fused), rule)
    return DeltaNetKernels(conv, rule, (conv_name, rule_name), step)


# --- layers -----------------------------------------------------------------------------------


def run_gated_attention(
    attention: nn.Module,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    record: AttentionKV,
    span: Span,
    apply_rotary: RotaryFn,
    branch: BranchKV | None = None,
    state_only: bool = False,
) -> torch.Tensor | None:
    """One gated full-attention block over ``hidden`` ``[B, T, hidden]``, reading/writing ``record``.

    The sibling of ``dense.run_full_attention``: ``q_proj`` yields each head's query and its
    output gate side by side, and the attention output is multiplied by ``sigmoid(gate)``
    before ``o_proj``, as the model does. ``branch``: decoded branches' own keys/values.
    ``state_only``: write the keys/values and return None (see ``writes_only``).
    """
    batch, length, _ = hidden.shape
    head_dim = attention.head_dim
    shape = (batch, length, -1, head_dim)
    queries, gate = torch.chunk(
        attention.q_proj(hidden).view(batch, length, -1, head_dim * 2), 2, dim=-1
    )
    gate = gate.reshape(batch, length, -1)
    queries = attention.q_norm(queries.view(shape))
    keys = attention.k_norm(attention.k_proj(hidden).view(shape))
    values = attention.v_proj(hidden).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    queries, keys = apply_rotary(queries.transpose(1, 2), keys.transpose(1, 2), cos, sin)

    output = attend_with_state(
        queries, keys, values, record, span, attention.scaling, branch, state_only
    )
    if output is None:
        return None
    output = output.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate)
    return attention.o_proj(output)


def deltanet_projections(
    deltanet: nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mixed_qkv [B, conv_dim, T], z [B, T, v_heads, d_v], b, a [B, T, v_heads])``.

    Qwen3.5 has one projection per output; Qwen3-Next packs them per key head into
    ``in_proj_qkvz`` / ``in_proj_ba``, unpacked by the model's own method.
    """
    batch, length, _ = hidden.shape
    if hasattr(deltanet, "in_proj_qkvz"):
        query, key, value, z, b, a = deltanet.fix_query_key_value_ordering(
            deltanet.in_proj_qkvz(hidden), deltanet.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
    else:
        mixed = deltanet.in_proj_qkv(hidden)
        z = deltanet.in_proj_z(hidden).reshape(batch, length, -1, deltanet.head_v_dim)
        b, a = deltanet.in_proj_b(hidden), deltanet.in_proj_a(hidden)
    return mixed.transpose(1, 2), z, b, a


def run_gated_deltanet(
    deltanet: nn.Module,
    hidden: torch.Tensor,
    record: RecurrentState,
    span: Span,
    kernels: DeltaNetKernels,
    branch: BranchRecurrent | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet block over ``hidden`` ``[B, T, hidden]``, starting from ``record``.

    The conv runs over the stored ``kernel - 1`` inputs followed by the span (the same
    left context the full sequence gives it) and keeps the span's outputs; the delta rule
    starts from the stored recurrent state. A prefill chunk (``span.write``) stores the new
    conv inputs and final state; a branch reads the record and leaves it as it was. With
    ``branch`` (decoding ``B`` branches), each branch starts from its own states instead and
    they are replaced by the ones it ends with.
    """
    batch, length, _ = hidden.shape
    mixed_qkv, z, b, a = deltanet_projections(deltanet, hidden)
    if branch is None:
        conv_state, recurrent_state = record.read(span.start if span.write else None)
        conv_state, recurrent_state = conv_state[None], recurrent_state[None]
    else:
        conv_state, recurrent_state = branch.conv, branch.recurrent
    conv_input = torch.cat([conv_state.to(mixed_qkv.dtype), mixed_qkv], dim=-1)
    conv_output = kernels.conv(
        conv_input, deltanet.conv1d.weight.squeeze(1), deltanet.conv1d.bias,
        activation=deltanet.activation,
    )  # fmt: skip
    mixed_qkv = conv_output[:, :, -length:].transpose(1, 2)
    key_dim, value_dim = deltanet.key_dim, deltanet.value_dim
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(batch, length, -1, deltanet.head_k_dim)
    key = key.reshape(batch, length, -1, deltanet.head_k_dim)
    value = value.reshape(batch, length, -1, deltanet.head_v_dim)

    beta = b.sigmoid()
    g = -deltanet.A_log.float().exp() * F.softplus(a.float() + deltanet.dt_bias)
    # A decode step's one position takes the step kernel; with autograd (a branch replayed
    # in pieces on pipeline stages) the chunked one, whose backward is the replay's.
    decoding = branch is not None and not torch.is_grad_enabled()
    delta_rule = kernels.rule_for(length) if decoding else kernels.delta_rule
    output, final_state = delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=recurrent_state,
        output_final_state=span.write or branch is not None,
        use_qk_l2norm_in_kernel=True,
    )
    kept = conv_input.shape[-1] - conv_state.shape[-1]
    if span.write:
        # A copy of the last kernel - 1 columns: exact mode's recompute hands them to the
        # sweep, which keeps them to the chunk's backward, and a view would keep all of
        # conv_input (the whole chunk) alive with them past a checkpointed layer's forward.
        record.update(span.start, length, conv_input[0, :, kept:].clone(), final_state[0])
    if branch is not None:
        branch.update(conv_input[:, :, kept:], final_state)

    output = deltanet.norm(
        output.reshape(-1, deltanet.head_v_dim), z.reshape(-1, deltanet.head_v_dim)
    )
    return deltanet.out_proj(output.reshape(batch, length, -1))


# --- the adapter ------------------------------------------------------------------------------


@register_adapter
class Qwen36Adapter(ModelAdapter):
    """Qwen3.6 / Qwen3.5 / Qwen3-Next: Gated DeltaNet and gated full-attention layers."""

    family = FAMILY
    model_types = FAMILY.model_types
    llama_norm = False  # Qwen3.5's RMSNorm: (x * (1 + weight)) in fp32, then the cast

    def check_model(self) -> None:
        text = self.config.get_text_config()
        self.text_config = text
        self.layer_types: list[str] = list(text.layer_types[: len(self.decoder.layers)])
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(
                f"this {self.config.model_type} model has layer types {unknown}; the qwen36 "
                f"adapter runs {LINEAR_ATTENTION!r} and {FULL_ATTENTION!r} layers only"
            )
        if getattr(text, "attention_dropout", 0.0):
            raise ValueError(
                f"attention_dropout={text.attention_dropout}: scoring must be deterministic "
                "for RL; set attention_dropout=0.0 in the (text) config"
            )
        rope_type = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"rope_type={rope_type!r} changes its frequencies with the length of each "
                "forward call, so a chunked prefill cannot match the full-sequence forward; "
                "use a static RoPE ('default', 'linear', 'yarn', ...)"
            )
        if text.linear_conv_kernel_dim < 2:
            raise ValueError(
                f"linear_conv_kernel_dim={text.linear_conv_kernel_dim}: the adapter keeps the "
                "conv's last kernel - 1 inputs and needs a kernel of at least 2"
            )
        self.vision_token_ids = {
            getattr(self.config, field): field
            for field in _VISION_TOKEN_FIELDS
            if getattr(self.config, field, None) is not None
        }
        attention = next(
            (layer.self_attn for layer in self.decoder.layers if hasattr(layer, "self_attn")), None
        )
        self.apply_rotary = model_rotary_function(attention) if attention is not None else None

    @property
    def max_positions(self) -> int | None:
        return getattr(self.text_config, "max_position_embeddings", None)

    def new_layer_state(
        self, index: int, layer: nn.Module, capacity: int, offload: OffloadPolicy | None
    ) -> AttentionKV | RecurrentState:
        if self.layer_types[index] == LINEAR_ATTENTION:
            deltanet = layer.linear_attn
            return RecurrentState.empty(
                deltanet.conv_dim,
                deltanet.conv_kernel_size,
                deltanet.num_v_heads,
                deltanet.head_k_dim,
                deltanet.head_v_dim,
                dtype=self.dtype,
                **home_options(offload, RecurrentState.kind, self.device),
            )
        return AttentionKV.empty(
            self.text_config.num_key_value_heads,
            capacity,
            layer.self_attn.head_dim,
            dtype=self.dtype,
            **home_options(offload, AttentionKV.kind, self.device),
        )

    def layer_work(
        self,
        index: int,
        layer: nn.Module,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        record: AttentionKV | RecurrentState,
        span: Span,
        branch_record: BranchKV | BranchRecurrent | None,
        state_only: bool,
        carried: None,
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        return functools.partial(
            self.decoder_layer, layer, self.layer_types[index], position_embeddings, record,
            span, branch_record, state_only,
        )  # fmt: skip

    def decoder_layer(
        self,
        layer: nn.Module,
        kind: str,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        record: AttentionKV | RecurrentState,
        span: Span,
        branch_record: BranchKV | BranchRecurrent | None,
        state_only: bool,
        hidden: torch.Tensor,
    ) -> torch.Tensor | None:
        """One decoder layer over ``hidden``: Gated DeltaNet or gated attention, then the MLP.
        With ``state_only`` it only writes its state and returns None."""
        normed = layer.input_layernorm(hidden)
        if kind == LINEAR_ATTENTION:  # by layer type: records may be wrapped (exact mode)
            kernels = deltanet_kernels(
                layer.linear_attn, hidden.device, hidden.dtype,
                emulated=gpu_emulation.emulated(hidden),
            )  # fmt: skip
            mixed = run_gated_deltanet(
                layer.linear_attn, normed, record, span, kernels, branch_record
            )
        else:
            mixed = run_gated_attention(
                layer.self_attn,
                normed,
                position_embeddings,
                record,
                span,
                self.apply_rotary,
                branch_record,
                state_only,
            )
        if state_only:  # the DeltaNet state is written; nothing reads the output
            return None
        hidden = hidden + mixed
        mlp_output = layer.mlp(layer.post_attention_layernorm(hidden))
        if isinstance(mlp_output, tuple):  # MoE blocks may return (output, router_logits)
            mlp_output = mlp_output[0]
        return hidden + mlp_output

    # --- text only --------------------------------------------------------------------------

    def prefill(
        self, prompt_ids: torch.Tensor | Sequence[int], *args: Any, **kwargs: Any
    ) -> PrefixState:
        """``ModelAdapter.prefill``, refusing image/video placeholder tokens (text only)."""
        self._check_text_only(prompt_ids, "prompt_ids")
        return super().prefill(prompt_ids, *args, **kwargs)

    def score(
        self,
        state: PrefixState,
        response_ids: torch.Tensor | Sequence[int],
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``ModelAdapter.score``, refusing image/video placeholder tokens (text only)."""
        self._check_text_only(response_ids, "response_ids")
        return super().score(state, response_ids, *args, **kwargs)

    def _check_text_only(self, ids: torch.Tensor | Sequence[int], name: str) -> None:
        if not self.vision_token_ids:
            return
        ids = as_token_ids(ids, name, self.vocab_size)
        for token_id, field in self.vision_token_ids.items():
            if bool((ids == token_id).any()):
                raise ValueError(
                    f"{name} holds token {token_id} (config.{field}): images and videos need "
                    "pixel inputs and multimodal positions, which LongStraw does not run; "
                    "pass text-only prompts"
                )
