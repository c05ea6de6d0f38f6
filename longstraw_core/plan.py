"""Memory planner: the peak per GPU of one LongStraw GRPO step, before anything is loaded.

A long-prompt run fails late and expensively when it does not fit: after the weights load,
after a prefill of millions of tokens. The planner predicts the peak from the config alone
and names what to change (chunk size, offload, GPUs) when it does not fit::

    python -m longstraw_core.plan --config configs/qwen36/27b_lora_grpo_8xgpu.yaml \\
        --prompt-tokens 2100000 --group 8 --gpus 8 --gpu-mem 96GiB
    python -m longstraw_core.plan --preset Qwen3.6-27B --prompt-tokens 2100000 --group 8 \\
        --gpus 8 --gpu-mem 96GiB --offload attention=cpu --resident-layers 2
    python -m longstraw_core.plan --paper-tables benchmarks/results/memory_plans.md

Where the numbers come from (so the plan cannot drift from the code):

- **Model.** The model is built from its transformers config on the ``meta`` device (no
  weights, no memory): a tiny model from ``longstraw_core.tiny_models``, a checkpoint's
  ``config.json`` through ``AutoConfig``, or a named paper-scale preset (``PRESETS``).
  Parameter counts are read from its modules; LoRA counts ``r x (in + out)`` per targeted
  ``nn.Linear``.
- **State.** The adapter's own ``new_layer_states`` builds the records (on ``meta``) at
  capacity 0 and 1: their tensors give the fixed and per-position bytes of every layer, in
  the dtype the layers compute in. ``dS`` comes from ``exact.GRAD_FACTORIES`` the same way,
  recurrent checkpoints are one record-sized copy per prefill chunk.
- **Transients.** Activation memory is derived from tensor shapes, module by module, following
  the code that runs (``_Activations``): what autograd saves in one branch (or one recomputed
  chunk), the LM head's float32 logits and ``log_softmax`` in row chunks
  (``model_adapters.base.HEAD_CHUNK_ELEMENTS``), the kernels' blocks
  (``attention._MAX_SCORE_ELEMENTS``, ``glm52._WORK_ELEMENTS``), the optimizer's scratch.

What the peak counts: tensor memory (what ``torch.cuda.max_memory_allocated`` reports, or
``memory.LiveTensorMemory`` on CPU) of parameters, gradients, AdamW moments, prefix state,
``dS``, checkpoints and every transient, per rank. Not counted: the CUDA context and
NCCL buffers (~1-3 GiB, covered by ``memory.headroom``), allocator fragmentation, the
kernels' internal scratch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Kernel block budgets, read from the modules that use them (see the *_scratch helpers).
from longstraw_core.attention import _FLASH_BWD_CHUNK, _FUSED_BWD_CHUNK
from longstraw_core.attention import _MAX_SCORE_ELEMENTS as _ATTENTION_SCORE_ELEMENTS
from longstraw_core.offload import OffloadPolicy
from model_adapters.glm52 import _WORK_ELEMENTS as _DSA_WORK_ELEMENTS

GIB = 2**30
_FP32 = 4
_INT64 = 8
_DELTA_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk size
PHASES = ("prefill", "rollout", "replay", "sweep", "optimizer")
CHUNK_CHOICES = tuple(2**k for k in range(8, 17))  # 256 .. 65536


class MemoryPlanError(RuntimeError):
    """The predicted peak does not fit the budget; the message says what to change."""

    def __init__(self, message: str, plan: MemoryPlan) -> None:
        super().__init__(message)
        self.plan = plan


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    """A paper-scale model no one can download here: its transformers config, documented."""

    model_type: str
    config: dict[str, Any]
    source: str


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
PRESETS: dict[str, Preset] = {"Qwen3.6-27B": _QWEN36_27B, "GLM-5.2": _GLM52}


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its mixer, MLP and state record, with the shapes the planner uses."""

    mixer: str  # "attention" | "gated_attention" | "deltanet" | "mla"
    record: str  # the record's kind: "full_attention" | "linear_attention" | "mla_dsa"
    dims: dict[str, int]
    mlp: str  # "dense" | "moe"
    mlp_dims: dict[str, int]
    params: int
    state_fixed: int  # bytes at capacity 0
    state_per_token: int  # bytes per stored position
    grad_fixed: int  # dS bytes at length 0
    grad_per_token: int
    checkpoint: int  # bytes of one chunk-start checkpoint (recurrent records)
    linear_shapes: dict[str, tuple[int, int]]  # linear name -> (in, out), for LoRA


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows of a model: layers, parameters, dtypes. Built on ``meta``."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    layers: tuple[LayerSpec, ...]
    params: int
    root_params: int  # outside the decoder layers: embeddings, final norm, head
    largest_param: int  # numel of the largest parameter tensor (CPU optimizer scratch)
    rotary_dim: int
    llama_norm: bool  # x.to(fp32) ... weight * x.to(dtype) (Qwen3, GLM); else Qwen3.5's
    state_dtype: torch.dtype

    @classmethod
    def from_config(cls, config: Any, name: str, state_dtype: torch.dtype) -> ModelSpec:
        """Build ``config``'s causal LM on ``meta`` (no memory) and read it."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=state_dtype)
        return cls.from_model(model, name)

    @classmethod
    def from_model(cls, model: nn.Module, name: str) -> ModelSpec:
        """Read a (meta or real) model through its LongStraw adapter (pass the model before
        any PEFT wrapping: LoRA is the workload's, not the spec's)."""
        from model_adapters.registry import adapt

        adapter = adapt(model)
        with torch.device("meta"):
            empty = adapter.new_layer_states(0)
            one = adapter.new_layer_states(1)
        layers = tuple(
            _layer_spec(layer, empty_record, one_record)
            for layer, empty_record, one_record in zip(
                adapter.decoder.layers, empty, one, strict=True
            )
        )
        params = _numel(model.parameters())
        text = getattr(adapter, "text_config", adapter.config)
        return cls(
            name=name,
            model_type=adapter.config.model_type,
            hidden=text.hidden_size,
            vocab=adapter.vocab_size,
            layers=layers,
            params=params,
            root_params=params - sum(layer.params for layer in layers),
            largest_param=max(p.numel() for p in model.parameters()),
            rotary_dim=_rotary_dim(adapter),
            llama_norm=type(adapter).__name__ != "Qwen36Adapter",
            state_dtype=adapter.dtype,
        )


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _record_bytes(record: Any) -> int:
    """Bytes of every tensor a record holds (preallocated capacity, not just valid rows)."""
    return sum(
        value.numel() * value.element_size()
        for value in vars(record).values()
        if isinstance(value, torch.Tensor)
    )


def _grad_bytes(record: Any, length: int) -> int:
    """Bytes of ``exact.GRAD_FACTORIES``' buffer for ``record`` holding ``length`` rows."""
    from longstraw_core.exact import GRAD_FACTORIES

    factory = GRAD_FACTORIES.get(type(record))
    if factory is None:
        return 0
    if record.grows_with_prompt:
        record = dataclasses.replace(record, length=length)
    dtype = torch.promote_types(_record_dtype(record), torch.float32)
    with torch.device("meta"):
        grad = factory(record, dtype)
    return _record_bytes(grad)


def _record_dtype(record: Any) -> torch.dtype:
    for value in vars(record).values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def _layer_spec(layer: nn.Module, empty: Any, one: Any) -> LayerSpec:
    """A decoder layer's shapes, read from its modules, and its record's bytes."""
    mixer, dims = _mixer_dims(layer)
    mlp, mlp_dims = _mlp_dims(layer.mlp)
    fixed = _record_bytes(empty)
    linears = {
        name.rsplit(".", 1)[-1]: (module.in_features, module.out_features)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    }
    return LayerSpec(
        mixer=mixer,
        record=empty.kind,
        dims=dims,
        mlp=mlp,
        mlp_dims=mlp_dims,
        params=_numel(layer.parameters()),
        state_fixed=fixed,
        state_per_token=_record_bytes(one) - fixed,
        grad_fixed=_grad_bytes(empty, 0),
        grad_per_token=_grad_bytes(one, 1) - _grad_bytes(empty, 0),
        checkpoint=fixed if hasattr(empty, "checkpoints") else 0,
        linear_shapes=linears,
    )


def _mixer_dims(layer: nn.Module) -> tuple[str, dict[str, int]]:
    """The token mixer of a decoder layer and the widths its activations have."""
    if hasattr(layer, "linear_attn"):
        net = layer.linear_attn
        return "deltanet", {
            "conv_dim": net.conv_dim,
            "kernel": net.conv_kernel_size,
            "key_heads": net.num_k_heads,
            "value_heads": net.num_v_heads,
            "key_dim": net.head_k_dim,
            "value_dim": net.head_v_dim,
        }
    attention = layer.self_attn
    if hasattr(attention, "kv_lora_rank"):
        indexer = attention.indexer
        return "mla", {
            "heads": attention.num_heads,
            "q_rank": attention.q_a_proj.out_features,
            "qk_dim": attention.qk_head_dim,
            "rope_dim": attention.qk_rope_head_dim,
            "kv_rank": attention.kv_lora_rank,
            "v_dim": attention.v_head_dim,
            "indexer": int(indexer is not None),
            "index_heads": indexer.n_heads if indexer is not None else 0,
            "index_dim": indexer.head_dim if indexer is not None else 0,
            "index_topk": attention.config.index_topk,  # shared layers reuse a selection
        }
    head_dim = attention.head_dim
    q_out = attention.q_proj.out_features
    gated = q_out == 2 * attention.config.num_attention_heads * head_dim
    q_width = q_out // 2 if gated else q_out
    return ("gated_attention" if gated else "attention"), {
        "heads": q_width // head_dim,
        "kv_heads": attention.k_proj.out_features // head_dim,
        "head_dim": head_dim,
        "qk_norm": int(hasattr(attention, "q_norm")),
    }


def _mlp_dims(mlp: nn.Module) -> tuple[str, dict[str, int]]:
    if hasattr(mlp, "experts"):
        experts = mlp.experts
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        top_k = getattr(mlp.gate, "top_k", None) or mlp.config.num_experts_per_tok
        return "moe", {
            "experts": experts.num_experts,
            "top_k": top_k,
            "expert_dim": experts.intermediate_dim,
            "shared_dim": shared.down_proj.in_features if shared is not None else 0,
        }
    return "dense", {"intermediate": mlp.down_proj.in_features}


def _rotary_dim(adapter: Any) -> int:
    """Width of the cos/sin tables a pass builds once and every layer reads."""
    rotary = adapter.decoder.rotary_emb
    inv_freq = getattr(rotary, "inv_freq", None)
    return 2 * inv_freq.numel() if inv_freq is not None else 0


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """One GRPO step as the planner sees it (from a ``RunConfig`` or the CLI).

    ``device``: which kernels to model: ``"cuda"`` (flash-attn, flash-linear-attention) or
    ``"cpu"`` (the pure-torch paths the CPU runs). ``param_dtype``: the parameters' dtype
    (``model.dtype``); the layers compute, and keep their state, in ``compute_dtype``.
    """

    prompt_tokens: int
    group: int
    response_tokens: int
    chunk_size: int
    gradient: str = "detached"
    checkpoints: str = "device"
    gpus: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = True
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = ()
    offload: OffloadPolicy | None = None
    device: str = "cuda"
    budget: int | None = None
    headroom: float = 0.0
    rollout: bool = True
    activation_checkpointing: bool = False  # ModelAdapter.activation_checkpointing

    @property
    def stored(self) -> int:
        """Prompt positions the state stores: all but the last (replayed with each branch)."""
        return max(self.prompt_tokens - 1, 0)

    @property
    def shards(self) -> int:
        return self.gpus if self.fsdp else 1

    @property
    def usable(self) -> int | None:
        """The budget after headroom, or None when no budget is known."""
        return None if self.budget is None else int(self.budget * (1 - self.headroom))

    def offloads(self, record_kind: str) -> bool:
        return self.offload is not None and self.offload.offloads(record_kind)


# --------------------------------------------------------------------------- activations


class _Activations:
    """Bytes per token of what autograd saves, and the kernels' scratch, from shapes.

    Follows the code that runs module by module: RMSNorms save their float32 input (and the
    normalised tensor when their weight trains), linears save their input when their weight
    trains (PEFT LoRA: a float32 copy per adapted linear when the base is 16-bit), the
    attention functions save q, k, v, output and log-sum-exp, transformers' pure-torch
    gated delta rule saves its ``64 x 64`` chunk matrices, MoE saves ``top_k`` copies of
    each token. Widths come from ``LayerSpec``; ``b`` is the compute dtype's size.
    """

    def __init__(self, spec: ModelSpec, work: Workload) -> None:
        self.spec, self.work = spec, work
        self.b = _bytes(work.compute_dtype)
        self.lora = work.lora_rank > 0
        self.targets = set(work.lora_targets)

    # --- building blocks ---------------------------------------------------------------------

    def trains(self, name: str) -> bool:
        """Whether the weight of linear ``name`` receives a gradient."""
        return not self.lora or name in self.targets

    def linear_input(self, width: int, consumers: Sequence[str]) -> int:
        """Saved bytes per token of one activation that feeds the linears ``consumers``."""
        if not self.lora:
            return self.b * width
        adapted = [name for name in consumers if name in self.targets]
        if not adapted:
            return 0
        rank = self.work.lora_rank * _FP32 * len(adapted)  # lora_A's output, saved by lora_B
        if self.b == _FP32:
            return _FP32 * width + rank
        return _FP32 * width * len(adapted) + rank  # each adapter casts its input to fp32

    def norm(self, width: int, groups: int = 1) -> int:
        """An RMSNorm over ``width`` (in ``groups`` heads): its fp32 input, rsqrt, and the
        normalised tensor when the weight trains (not under LoRA)."""
        saved = _FP32 * width + _FP32 * groups
        if not self.lora:
            saved += self.b * width if self.spec.llama_norm else _FP32 * width
        return saved

    # --- token mixers ------------------------------------------------------------------------

    def attention(self, d: dict[str, int]) -> int:
        """Dense GQA attention (Qwen3 / Llama), ``dense.run_full_attention``."""
        b, q, kv = self.b, d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        saved = self.linear_input(self.spec.hidden, ("q_proj", "k_proj", "v_proj"))
        if d["qk_norm"]:
            saved += self.norm(q, d["heads"]) + self.norm(kv, d["kv_heads"])
        saved += b * (2 * q + 2 * kv) + _FP32 * d["heads"]  # q, k, v, output; lse
        return saved + self.linear_input(q, ("o_proj",))

    def gated_attention(self, d: dict[str, int]) -> int:
        """Qwen3.5's gated attention, ``qwen36.run_gated_attention``."""
        b, q, kv = self.b, d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        saved = self.linear_input(self.spec.hidden, ("q_proj", "k_proj", "v_proj"))
        # q_norm reads a view of q_proj's [T, 2q] output: in fp32 it keeps all of it alive.
        saved += self.norm(q, d["heads"]) + (_FP32 * q if b == _FP32 else 0)
        saved += self.norm(kv, d["kv_heads"])
        saved += b * (2 * q + 2 * kv) + _FP32 * d["heads"]  # q, k, v, output; lse
        saved += 2 * b * q  # sigmoid(gate) and the reshaped output, saved by their product
        return saved + self.linear_input(q, ("o_proj",))

    def deltanet(self, d: dict[str, int], tokens: int) -> int:
        """Gated DeltaNet, ``qwen36.run_gated_deltanet``, for ``tokens`` tokens (bytes)."""
        b, hidden = self.b, self.spec.hidden
        value_width = d["value_heads"] * d["value_dim"]
        consumers = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        per_token = self.linear_input(hidden, consumers)
        conv = d["conv_dim"] * (2 * tokens + 3 * (d["kernel"] - 1)) * b  # conv in, silu in
        if self.lora:
            conv = d["conv_dim"] * (tokens + 2 * (d["kernel"] - 1)) * b  # conv weight frozen
        per_token += 3 * _FP32 * d["value_heads"] + b * d["value_heads"]  # beta, g, softplus
        # Gated RMSNorm of the output: fp32 input, rsqrt, fp32 gate, silu(gate), weighted.
        per_token += 4 * _FP32 * value_width + _FP32 * d["value_heads"] + b * value_width
        if not self.lora:
            per_token += b * value_width
        per_token += self.linear_input(value_width, ("out_proj",))
        return per_token * tokens + conv + self.delta_rule(d, tokens)

    def delta_rule(self, d: dict[str, int], tokens: int) -> int:
        """What the delta-rule kernel saves for ``tokens`` tokens (bytes)."""
        heads, dk, dv = d["value_heads"], d["key_dim"], d["value_dim"]
        if self.work.device == "cuda" and self.b < _FP32:
            # flash-linear-attention's chunk kernel saves its inputs (q and k repeated to
            # the value heads by our wrapper), g and beta, and recomputes the rest.
            return tokens * (self.b * heads * (2 * dk + dv) + 2 * _FP32 * heads)
        # transformers' torch_chunk_gated_delta_rule, padded to chunks of 64: five [64, 64]
        # matrices per chunk and head, five key-wide and three value-wide tensors per padded
        # token, the l2-normalised q and k, and the state entering every chunk.
        padded = math.ceil(tokens / _DELTA_CHUNK) * _DELTA_CHUNK
        chunks = padded // _DELTA_CHUNK
        per_padded = heads * (5 * _DELTA_CHUNK + 5 * dk + 3 * dv + 5)
        per_token = heads * (2 * dk + 2)
        states = max(chunks - 1, 0) * heads * dk * dv
        mask = _DELTA_CHUNK * _DELTA_CHUNK // _FP32  # bool [64, 64]
        return _FP32 * (padded * per_padded + tokens * per_token + states + mask)

    def mla(self, d: dict[str, int], sparse: bool) -> int:
        """MLA with weight absorption, ``glm52.GlmMoeDsaAdapter.run_attention``."""
        b, heads, latent = self.b, d["heads"], d["kv_rank"] + d["rope_dim"]
        saved = self.linear_input(self.spec.hidden, ("q_a_proj", "kv_a_proj_with_mqa"))
        saved += self.norm(d["q_rank"]) + self.linear_input(d["q_rank"], ("q_b_proj",))
        if self.trains("kv_b_proj"):
            saved += b * heads * d["qk_dim"]  # q_b_proj's output, for q_nope @ W_uk
        # kv_a_layernorm reads the c_kv view: in fp32 the whole [T, rank + rope] output.
        saved += self.norm(d["kv_rank"]) + (_FP32 * d["rope_dim"] if b == _FP32 else 0)
        saved += b * heads * latent + b * latent  # absorbed queries, the span's latent
        saved += b * heads * d["kv_rank"] + _FP32 * heads  # attention output, lse
        if sparse and d["indexer"]:
            saved += _INT64 * d["index_topk"]  # the DSA selection
        return saved + self.linear_input(heads * d["v_dim"], ("o_proj",))

    # --- MLPs --------------------------------------------------------------------------------

    def mlp(self, layer: LayerSpec) -> int:
        b, hidden = self.b, self.spec.hidden
        if layer.mlp == "dense":
            width = layer.mlp_dims["intermediate"]
            saved = self.linear_input(hidden, ("gate_proj", "up_proj"))
            return saved + 3 * b * width + self.linear_input(width, ("down_proj",))
        d = layer.mlp_dims
        k, expert, shared = d["top_k"], d["expert_dim"], d["shared_dim"]
        saved = self.linear_input(hidden, ("gate_proj", "up_proj"))  # MoE input (shared MLP)
        if not self.lora:
            saved = max(saved, b * hidden) + (_FP32 * hidden if b < _FP32 else 0)  # router
        saved += _FP32 * d["experts"] + 16 * k + 8  # router scores, top-k, weights
        experts = b * (3 * expert + hidden) + 20  # gate_up, silu, the weighted output, ids
        if not self.lora:
            experts += b * (hidden + expert)  # grouped_mm inputs (the experts train)
        saved += k * experts
        if shared:
            saved += 3 * b * shared + self.linear_input(shared, ("down_proj",))
        return saved

    # --- whole passes ------------------------------------------------------------------------

    def layer(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Saved bytes of one decoder layer over ``tokens`` tokens after ``prefix``."""
        d = layer.dims
        if layer.mixer == "deltanet":
            mixer = self.deltanet(d, tokens)
        elif layer.mixer == "mla":
            sparse = d["index_topk"] < prefix + tokens
            mixer = self.mla(d, sparse) * tokens
        elif layer.mixer == "gated_attention":
            mixer = self.gated_attention(d) * tokens
        else:
            mixer = self.attention(d) * tokens
        return mixer + (2 * self.norm(self.spec.hidden) + self.mlp(layer)) * tokens

    def last_layer_state_only(self, layer: LayerSpec, tokens: int) -> int:
        """A recomputed chunk's last layer only writes its state: what that write keeps."""
        d, hidden = layer.dims, self.spec.hidden
        saved = self.norm(hidden) * tokens
        if layer.mixer == "deltanet":
            return saved + self.deltanet(d, tokens)
        if layer.mixer == "mla":
            mla = self.linear_input(hidden, ("kv_a_proj_with_mqa",)) + self.norm(d["kv_rank"])
            return saved + mla * tokens
        kv = d["kv_heads"] * d["head_dim"]
        keys = self.linear_input(hidden, ("k_proj", "v_proj")) + self.norm(kv, d["kv_heads"])
        return saved + keys * tokens

    def rotary(self, tokens: int) -> int:
        return 2 * self.spec.rotary_dim * self.b * tokens

    def head_rows(self, tokens: int) -> int:
        """Rows per chunk of ``score``'s LM head (``model_adapters.base.head_rows``)."""
        from model_adapters.base import head_rows

        return head_rows(tokens, self.spec.vocab)

    def head(self, tokens: int) -> int:
        """What the final norm, the LM head and ``log_softmax`` keep for backward (bytes).
        One chunk: the head's input and the float32 log-probs ``[T, vocab]``. Several
        (checkpointed) chunks: only the normed hidden states the chunks read."""
        hidden = self.spec.hidden
        head = self.norm(hidden) + 2 * _INT64  # gather index, input ids
        if self.head_rows(tokens) < tokens:
            head += self.b * hidden
        else:
            head += self.linear_input(hidden, ("lm_head",)) + _FP32 * self.spec.vocab
        return head * tokens

    def branch_graph(self, tokens: int) -> int:
        """Everything one replayed branch keeps for its backward (bytes). Checkpointed: each
        layer's input instead of its activations (``checkpoint_kept``)."""
        prefix = self.work.stored
        if self.work.activation_checkpointing:
            layers = sum(self.checkpoint_kept(layer, tokens, prefix) for layer in self.spec.layers)
        else:
            layers = sum(self.layer(layer, tokens, prefix) for layer in self.spec.layers)
        return layers + self.head(tokens) + self.rotary(tokens)

    def chunk_graph(self, tokens: int, start: int) -> int:
        """Everything one recomputed prompt chunk keeps for its backward (bytes)."""
        if self.work.activation_checkpointing:
            kept = sum(
                self.checkpoint_kept(layer, tokens, start) + self.written(layer, tokens)
                for layer in self.spec.layers
            )
            return kept + self.rotary(tokens) + _INT64 * tokens
        *layers, last = self.spec.layers
        saved = sum(self.layer(layer, tokens, start) for layer in layers)
        saved += self.last_layer_state_only(last, tokens)
        return saved + self.rotary(tokens) + _INT64 * tokens

    # --- activation checkpointing ------------------------------------------------------------

    def checkpoint_kept(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """What a checkpointed layer keeps from its forward to its backward: its input
        ``[T, hidden]``, and the DSA selection it passes on (the next layer's work holds it)."""
        kept = self.b * self.spec.hidden * tokens
        d = layer.dims
        if layer.mixer == "mla" and d["indexer"] and d["index_topk"] < prefix + tokens:
            kept += _INT64 * d["index_topk"] * tokens
        return kept

    def written(self, layer: LayerSpec, tokens: int) -> int:
        """What a recomputed chunk's layer hands the sweep, alive until the chunk's backward
        ends: keys and values, the latent, or DeltaNet's final states (conv window, fp32
        recurrent state)."""
        d = layer.dims
        if layer.mixer == "deltanet":
            conv = self.b * d["conv_dim"] * (d["kernel"] - 1)
            return conv + _FP32 * d["value_heads"] * d["key_dim"] * d["value_dim"]
        if layer.mixer == "mla":
            return self.b * (d["kv_rank"] + d["rope_dim"]) * tokens
        return 2 * self.b * d["kv_heads"] * d["head_dim"] * tokens

    def layer_recompute(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Backward of one checkpointed layer: its graph recomputed (with the kernels'
        forward scratch), then its MLP's backward over the whole graph, then its mixer's
        once the MLP's share is freed (with the attention's blocks over the prefix)."""
        b, hidden = self.b, self.spec.hidden
        graph = self.layer(layer, tokens, prefix)
        mlp_graph = (self.norm(hidden) + self.mlp(layer)) * tokens
        residual = 2 * b * hidden * tokens + self.weight_grad_scratch(layer)
        mlp = graph + residual + 3 * b * tokens * self.mlp_width(layer)
        mixer = graph - mlp_graph + residual + 3 * b * tokens * self.mixer_width(layer)
        mixer += self.prefix_backward_scratch(layer, tokens, prefix)
        return max(graph + self.kernel_forward_scratch(layer, tokens, prefix), mlp, mixer)

    def checkpointed_branch_peak(self, tokens: int) -> int:
        """A checkpointed branch's peak beyond the state: every layer's input kept, then the
        head's logits, or one layer recomputed and backpropagated while the inputs of the
        layers before it are still kept (the head's graph is freed by then)."""
        prefix = self.work.stored
        layers = self.spec.layers
        kept = [self.checkpoint_kept(layer, tokens, prefix) for layer in layers]
        rotary = self.rotary(tokens)
        peak = sum(kept) + rotary + self.head(tokens) + self.head_peak(tokens)
        for index, layer in enumerate(layers):
            before = sum(kept[:index]) + rotary
            peak = max(peak, before + self.forward_working(layer, tokens, prefix))
            recompute = self.layer_recompute(layer, tokens, prefix)
            peak = max(peak, before + kept[index] + recompute)
        return peak

    def checkpointed_chunk_peak(self, tokens: int, start: int) -> int:
        """A checkpointed chunk recompute's peak (without the ``dS`` slices handed with it):
        what every layer writes stays alive to the end of the chunk's backward; each layer's
        input until its own backward, which recomputes its graph (the last layer's: the
        state it writes)."""
        layers = self.spec.layers
        kept = [self.checkpoint_kept(layer, tokens, start) for layer in layers]
        written = [self.written(layer, tokens) for layer in layers]
        fixed = self.rotary(tokens) + _INT64 * tokens
        peak = 0
        for index, layer in enumerate(layers):
            before = sum(kept[:index]) + sum(written[:index]) + fixed  # in its forward
            after = before + sum(written[index:])  # in its backward: every layer wrote
            last = index == len(layers) - 1
            if last:
                forward = self.state_only_working(layer, tokens, start)
                graph = self.last_layer_state_only(layer, tokens)
                working = forward
                if layer.mixer != "deltanet":  # its backward: the key/value projections only
                    working = max(working, self.weight_grad_scratch(layer))
                recompute = graph + working
            else:
                forward = self.forward_working(layer, tokens, start)
                recompute = self.layer_recompute(layer, tokens, start)
            peak = max(peak, before + forward, after + kept[index] + recompute)
        return peak

    # --- working sets: what lives only while a step runs (no autograd, or in backward) -------

    def widest(self, layer: LayerSpec) -> int:
        """The widest per-token activation of a layer (elements): its MLP or its mixer."""
        return max(self.mlp_width(layer), self.mixer_width(layer), self.spec.hidden)

    def mlp_width(self, layer: LayerSpec) -> int:
        if layer.mlp == "dense":
            return layer.mlp_dims["intermediate"]
        m = layer.mlp_dims
        return max(m["top_k"] * (2 * m["expert_dim"] + self.spec.hidden), m["shared_dim"])

    def mixer_width(self, layer: LayerSpec) -> int:
        d = layer.dims
        if layer.mixer == "deltanet":
            return d["conv_dim"] + d["value_heads"] * d["value_dim"]
        if layer.mixer == "mla":
            return d["heads"] * (d["qk_dim"] + d["kv_rank"] + d["rope_dim"])
        return (2 + (layer.mixer == "gated_attention")) * d["heads"] * d["head_dim"]

    def forward_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Peak bytes a layer holds while it runs without autograd (a prefill chunk), besides
        the residual stream: its normed input, then the larger of its mixer's activations
        with the kernel's scratch and its MLP's (silu(gate), up and their product)."""
        normed = tokens * self.b * self.spec.hidden
        return normed + max(
            self.mixer_working(layer, tokens, prefix), self.mlp_working(layer, tokens)
        )

    def mixer_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """A token mixer's projections (and their roped / convolved copies) and kernel."""
        d, b = layer.dims, self.b
        if layer.mixer == "deltanet":
            width = 2 * d["conv_dim"] + 2 * d["value_heads"] * d["value_dim"]
            return tokens * b * width + self.delta_rule_working(d, tokens)
        if layer.mixer == "mla":
            latent = d["kv_rank"] + d["rope_dim"]
            width = d["heads"] * (d["qk_dim"] + 2 * latent) + 2 * latent
            return tokens * b * width + self.mla_working(d, tokens, prefix, batch=1)
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        width = (3 if layer.mixer == "gated_attention" else 2) * q + 3 * kv
        return tokens * b * width + self.attention_forward_scratch(d, tokens, prefix)

    def mlp_working(self, layer: LayerSpec, tokens: int) -> int:
        if layer.mlp == "dense":
            return 3 * tokens * self.b * layer.mlp_dims["intermediate"]
        m = layer.mlp_dims
        experts = m["top_k"] * (self.spec.hidden + 4 * m["expert_dim"])  # gathered, gate_up..
        return tokens * (self.b * max(experts, 3 * m["shared_dim"]) + _FP32 * m["experts"])

    def decode_scratch(self, layer: LayerSpec, group: int, prefix: int) -> int:
        """One decoding step of ``group`` branches: the DSA search and latent gathers, or
        the pure-torch loop over the prefix when no fused kernel serves it."""
        d = layer.dims
        if layer.mixer == "mla":
            return self.mla_working(d, 1, prefix, batch=group)
        if layer.mixer == "deltanet":
            return 0
        if self.attention_path(d["head_dim"], d["head_dim"]) != "blocked":
            return 0
        rows = group * d["heads"] // d["kv_heads"]
        dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
        return _blocked_scratch(*dims, prefix, self.b, backward=False)

    def state_only_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """A writing span's last layer (``base.writes_only``): attention layers compute only
        the keys/values (or latent) they store; a DeltaNet layer runs whole."""
        if layer.mixer == "deltanet":
            return self.forward_working(layer, tokens, prefix)
        return tokens * self.b * (self.spec.hidden + self.widest(layer))

    def kernel_forward_scratch(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Scratch of a layer's attention kernels in a pass with autograd (beyond what the
        graph saves): the DSA top-k search and latent gathers, the attention merge."""
        if layer.mixer == "mla":
            return self.mla_working(layer.dims, tokens, prefix, batch=1)
        if layer.mixer == "deltanet":
            return 0
        return self.attention_forward_scratch(layer.dims, tokens, prefix)

    def attention_path(self, dk: int, dv: int) -> str:
        """Which kernel ``segmented_attention`` runs: ``"flash"`` (flash-attn on CUDA, 16-bit,
        equal head dims), ``"fused"`` (PyTorch's CPU flash kernel: float32, equal head dims)
        or ``"blocked"`` (the pure-torch loop over key blocks: everything else)."""
        if dk != dv:
            return "blocked"
        if self.work.device == "cuda":
            ok = self.b < _FP32 and dk % 8 == 0 and dk <= 256
            return "flash" if ok else "blocked"
        return "fused" if self.b == _FP32 else "blocked"

    def attention_forward_scratch(self, d: dict[str, int], tokens: int, prefix: int) -> int:
        """Segmented attention's forward: per segment an fp32 output merged by log-sum-exp
        (two products alive), the branch K/V repeated per query head for the fused kernels,
        and the pure-torch loop's score blocks over the prefix."""
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        scratch = tokens * (4 * _FP32 * q + 2 * self.b * q)
        if self.b < _FP32:
            scratch += tokens * _FP32 * (q + 2 * kv)  # rows cast to the accumulation dtype
        if self.attention_path(d["head_dim"], d["head_dim"]) == "blocked" and prefix:
            rows = d["heads"] // d["kv_heads"] * tokens
            dims = (d["kv_heads"], rows, d["head_dim"], d["head_dim"])
            scratch += _blocked_scratch(*dims, prefix, self.b, backward=False)
        return scratch

    def delta_rule_working(self, d: dict[str, int], tokens: int) -> int:
        """The delta rule without autograd: torch's chunk path holds four [64, 64] matrices
        per chunk and head (decays, UT system, intra-chunk scores, a product) besides its
        padded fp32 q/k/v; flash-linear-attention's kernel keeps only its inputs/outputs."""
        heads, dk, dv = d["value_heads"], d["key_dim"], d["value_dim"]
        if self.work.device == "cuda" and self.b < _FP32:
            return tokens * self.b * heads * (2 * dk + 2 * dv)
        padded = math.ceil(tokens / _DELTA_CHUNK) * _DELTA_CHUNK
        return _FP32 * padded * heads * (4 * _DELTA_CHUNK + 5 * dk + 4 * dv)

    def mla_working(self, d: dict[str, int], tokens: int, prefix: int, batch: int) -> int:
        """The DSA indexer's top-k search plus the latent attention's gather blocks."""
        if d["index_topk"] >= prefix + tokens:  # dense: segmented attention over the latent
            latent = d["kv_rank"] + d["rope_dim"]
            rows = batch * d["heads"] * tokens  # one latent "head" for every query head
            return _blocked_scratch(1, rows, latent, d["kv_rank"], prefix, self.b, False)
        scratch = _sparse_attention_scratch(d, tokens, batch)
        if d["indexer"]:
            scratch = max(scratch, _select_topk_peak(d, tokens, prefix, batch))
        return scratch

    def backward_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Peak bytes of one layer's backward besides the graph: gradients of its widest
        activations and of the residual stream, a weight gradient before it is added into
        ``.grad``, and the attention kernel's per-block scratch over the prefix."""
        grads = tokens * (2 * self.b * self.spec.hidden + 3 * self.b * self.widest(layer))
        grads += self.weight_grad_scratch(layer)
        return grads + self.prefix_backward_scratch(layer, tokens, prefix)

    def weight_grad_scratch(self, layer: LayerSpec) -> int:
        """One weight gradient computed before it is added into an existing ``.grad`` (the
        largest trainable matrix of the layer; sharded runs account for theirs in FSDP)."""
        if self.work.fsdp:
            return 0
        grad_bytes = _FP32 if self.lora else _bytes(self.work.param_dtype)
        shapes = [
            (inp * out if not self.lora else self.work.lora_rank * max(inp, out))
            for name, (inp, out) in layer.linear_shapes.items()
            if self.trains(name)
        ]
        if layer.mlp == "moe" and not self.lora:
            m = layer.mlp_dims
            shapes.append(m["experts"] * 2 * m["expert_dim"] * self.spec.hidden)
        return grad_bytes * max(shapes, default=0)

    def prefix_backward_scratch(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """The attention backward over the stored prefix, per block of keys."""
        d = layer.dims
        if layer.mixer == "deltanet" or prefix == 0:
            return 0
        if layer.mixer == "mla":
            if d["index_topk"] < prefix + tokens:
                return 2 * _sparse_attention_scratch(d, tokens, 1)
            rows, latent = d["heads"] * tokens, d["kv_rank"] + d["rope_dim"]
            return _blocked_scratch(1, rows, latent, d["kv_rank"], prefix, self.b, True)
        kv, head = d["kv_heads"], d["head_dim"]
        rows = d["heads"] * tokens
        path = self.attention_path(head, head)
        if path == "flash":
            # flash-attn backward per chunk of keys: dK/dV of the chunk (fp32 when they are
            # added into dS), the queries' fp32 gradient accumulator.
            keys = min(prefix, _FLASH_BWD_CHUNK)
            return 2 * kv * keys * head * (self.b + _FP32) + _FP32 * rows * head
        if path == "blocked":
            group_rows = d["heads"] // kv * tokens
            return _blocked_scratch(kv, group_rows, head, head, prefix, self.b, True)
        # PyTorch's fused CPU kernel per chunk of keys: dK/dV (fp32), the queries' gradient.
        keys = min(prefix, _FUSED_BWD_CHUNK)
        return 2 * kv * keys * head * _FP32 + _FP32 * rows * head

    def head_peak(self, tokens: int) -> int:
        """The LM head beyond the graph: float32 logits next to the saved log-probs
        (entropy's exp and product; backward's gather and log_softmax grads), for the whole
        branch in one chunk. In several chunks, one chunk's backward: its recomputed
        log-probs and those, the gradients of the chunks' inputs, and (when the head trains)
        its weight's gradient next to the sum of the chunks' before it."""
        rows = self.head_rows(tokens)
        chunked = rows < tokens
        logits = _FP32 * rows * self.spec.vocab
        peak = 2 * logits + (self.b * rows * self.spec.vocab if self.b < _FP32 else 0)
        if not chunked:
            return peak
        peak += logits + self.b * self.spec.hidden * tokens
        if not self.lora:
            peak += self.b * self.spec.vocab * self.spec.hidden
        return peak


def _blocked_scratch(
    kv_heads: int, rows: int, dk: int, dv: int, keys: int, state_bytes: int, backward: bool
) -> int:
    """``attention._segment_forward`` / ``_segment_backward``'s pure-torch loop over blocks
    of keys, as ``attention._block_length`` sizes them (scores of a block under
    ``_MAX_SCORE_ELEMENTS``). Forward holds a block's scores, shifted scores and
    probabilities, backward also the probabilities' gradients; from the second block on,
    the previous block's tensors stay bound until the new ones replace them. Blocks of a
    16-bit state are cast to float32 as they are read."""
    if keys <= 0:
        return 0
    per_key = kv_heads * rows + kv_heads * (dk + dv)
    block = min(keys, max(1, _ATTENTION_SCORE_ELEMENTS // per_key))
    alone, carried = (5, 4) if backward else (3, 2)  # a block's own; the previous one's
    sizes = [_FP32 * kv_heads * rows * n for n in _block_sizes(keys, block)]
    scratch = max(
        max(alone * now, carried * before + 2 * now)
        for now, before in zip(sizes, [0, *sizes], strict=False)
    )
    if state_bytes < _FP32:  # forward casts keys, then values; backward keeps the keys
        scratch += _FP32 * kv_heads * block * ((dk + dv) if backward else max(dk, dv))
    return scratch + 2 * _FP32 * kv_heads * rows * max(dk, dv)  # output / dq accumulators


def _sparse_attention_scratch(d: dict[str, int], tokens: int, batch: int) -> int:
    """``glm52._SparseLatentAttention``: per block of queries the gathered latent rows, the
    scores and probabilities (fp32); blocks keep ``3 x (dim + heads)`` per row under
    ``_WORK_ELEMENTS``."""
    topk, heads, dim = d["index_topk"], d["heads"], d["kv_rank"] + d["rope_dim"]
    step = max(1, _DSA_WORK_ELEMENTS // (batch * topk * 3 * (dim + heads)))
    queries = min(tokens, step)
    return _FP32 * batch * queries * topk * (2 * dim + 3 * heads)


def _select_topk_peak(d: dict[str, int], tokens: int, prefix: int, batch: int) -> int:
    """Peak scratch of ``glm52.select_topk``, replayed block by block as the code runs.

    During one block's index scores, the previous block's concatenated scores (fp32) and
    positions (int64) are still bound, next to this block's scores and two products
    ``[B, T, heads_step, n]`` (the matmul and its scaled relu).
    """
    topk, heads = d["index_topk"], d["index_heads"]
    rows = batch * tokens
    block = max(topk, _DSA_WORK_ELEMENTS // rows)
    sizes = _block_sizes(prefix, block) + _block_sizes(tokens, block)
    peak, kept, previous = 0, 0, 0
    for n in sizes:
        step = min(heads, max(1, _DSA_WORK_ELEMENTS // (rows * n)))
        scores = _FP32 * rows * n
        steps = [step] * (heads // step) + ([heads % step] if heads % step else [])
        products = [_FP32 * rows * h * n for h in steps]
        # the matmul and its scaled relu, next to the previous step's relu (still bound)
        inner = max(2 * now + before for now, before in zip(products, [0, *products], strict=False))
        peak = max(peak, previous + scores + inner)
        joined = rows * (kept + n)
        peak = max(peak, (_FP32 + _INT64) * joined + _FP32 * rows * n)
        previous = (_FP32 + _INT64) * joined
        kept = min(topk, kept + n)
    return peak


def _block_sizes(length: int, block: int) -> list[int]:
    """The sizes of ``length`` rows in blocks of ``block``, with runs of full blocks cut to
    two: a block's scratch depends only on its own size and the previous block's."""
    if length <= 0:
        return []
    full, rest = divmod(length, block)
    return [block] * min(full, 2) + ([rest] if rest else [])


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Line:
    """One row of the plan: bytes per rank on the device and in CPU memory."""

    name: str
    device: int
    cpu: int = 0
    note: str = ""


@dataclass
class MemoryPlan:
    """The predicted memory of one GRPO step, per rank: rows, phase peaks, advice."""

    spec: ModelSpec
    work: Workload
    lines: list[Line]
    phases: dict[str, int]
    advice: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def cpu_bytes(self) -> int:
        return sum(line.cpu for line in self.lines)

    @property
    def budget(self) -> int | None:
        return self.work.usable

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the budget (None: no budget known)."""
        return None if self.budget is None else self.peak <= self.budget

    def line(self, name: str) -> Line:
        return next(line for line in self.lines if line.name == name)


def plan_memory(spec: ModelSpec, work: Workload, advise: bool = True) -> MemoryPlan:
    """Predict the per-rank memory of one GRPO step of ``work`` on ``spec``."""
    _check_workload(work)
    parts = _Parts(spec, work)
    plan = MemoryPlan(spec, work, parts.lines(), parts.phases())
    if advise:
        plan.advice = _advice(plan)
    return plan


def _check_workload(work: Workload) -> None:
    if work.prompt_tokens < 2:
        raise ValueError(f"prompt_tokens={work.prompt_tokens}: a prompt has at least 2 tokens")
    for name in ("group", "response_tokens", "chunk_size", "gpus"):
        if getattr(work, name) < 1:
            raise ValueError(f"{name}={getattr(work, name)}: must be at least 1")
    if work.gradient not in ("detached", "exact"):
        raise ValueError(f"gradient={work.gradient!r}: 'detached' or 'exact'")
    if work.device not in ("cuda", "cpu"):
        raise ValueError(f"device={work.device!r}: 'cuda' or 'cpu' (which kernels to model)")


class _Parts:
    """The pieces of the step's memory on one rank, and the phases that add them up."""

    def __init__(self, spec: ModelSpec, work: Workload) -> None:
        self.spec, self.work = spec, work
        self.act = _Activations(spec, work)
        self.cb = _bytes(work.compute_dtype)
        self.pb = _bytes(work.param_dtype)
        self.exact = work.gradient == "exact"

    # --- parameters, gradients, optimizer ----------------------------------------------------

    def lora_params(self, layer: LayerSpec | None = None) -> int:
        """Adapter parameters (all layers, or one): ``r x (in + out)`` per adapted linear."""
        work = self.work
        if not work.lora_rank:
            return 0
        layers = self.spec.layers if layer is None else (layer,)
        return sum(
            work.lora_rank * (inp + out)
            for item in layers
            for name, (inp, out) in item.linear_shapes.items()
            if name in work.lora_targets
        )

    @property
    def trainable(self) -> int:
        return self.lora_params() if self.work.lora_rank else self.spec.params

    @property
    def state_bytes(self) -> int:
        """Bytes per element of gradients and AdamW moments: the trainable parameters'
        dtype (PEFT keeps adapters in float32 over a 16-bit base)."""
        return _FP32 if self.work.lora_rank else self.pb

    def parameters(self) -> int:
        total = self.spec.params * self.pb + self.lora_params() * _FP32
        return total // self.work.shards

    def gradients(self) -> int:
        return self.trainable * self.state_bytes // self.work.shards

    def optimizer(self) -> int:
        return 2 * self.trainable * self.state_bytes // self.work.shards

    # --- state, dS, checkpoints ---------------------------------------------------------------

    def state_split(self, kind: str, per_token: str, fixed: str) -> tuple[int, int]:
        """(device, cpu) bytes of ``kind`` records' ``fixed + per_token x stored`` field."""
        device = cpu = 0
        for layer in self.spec.layers:
            if layer.record != kind:
                continue
            size = getattr(layer, fixed) + getattr(layer, per_token) * self.work.stored
            if self.work.offloads(kind):
                cpu += size
            else:
                device += size
        return device, cpu

    def kinds(self) -> list[str]:
        return list(dict.fromkeys(layer.record for layer in self.spec.layers))

    def checkpoints(self) -> tuple[int, int]:
        if not self.exact:
            return 0, 0
        chunks = math.ceil(self.work.stored / self.work.chunk_size)
        size = chunks * sum(layer.checkpoint for layer in self.spec.layers)
        on_cpu = self.work.checkpoints == "cpu" or self.work.offloads("linear_attention")
        return (0, size) if on_cpu else (size, 0)

    def streamed(self, position: int) -> int:
        """Offloaded layers copied to the device during a pass reading ``position`` rows:
        at most ``offload.resident_layers`` of them at once."""
        offloaded = [
            layer.state_fixed + layer.state_per_token * position
            for layer in self.spec.layers
            if self.work.offloads(layer.record)
        ]
        if not offloaded:
            return 0
        keep = min(self.work.offload.resident_layers, len(offloaded))
        return sum(sorted(offloaded)[-keep:])

    # --- FSDP ---------------------------------------------------------------------------------

    def gathered(self) -> int:
        """Parameters FSDP holds unsharded during a pass: the root (embeddings, head), the
        last layer (kept gathered), the layer computing and the one prefetched."""
        if not self.work.fsdp:
            return 0
        if not self.work.reshard_after_forward:
            return self.spec.params * self.cb
        biggest = max(layer.params for layer in self.spec.layers)
        return (self.spec.root_params + self.spec.layers[-1].params + 2 * biggest) * self.cb

    def unsharded_grads(self) -> int:
        """Backward of a sharded layer: its unsharded gradients in the compute dtype and
        their copy in the reduce dtype (float32), until reduce-scatter; the root's are held
        to the end of backward."""
        if not self.work.fsdp:
            return 0
        reduce = self.cb + (_FP32 if self.cb < _FP32 else 0)
        if self.work.lora_rank:
            per_layer = [self.lora_params(layer) for layer in self.spec.layers]
            root = 0
        else:
            per_layer = [layer.params for layer in self.spec.layers]
            root = self.spec.root_params * self.cb
        return max(per_layer) * reduce + root

    # --- transients ---------------------------------------------------------------------------

    def prefill_transient(self) -> int:
        """One chunk through the layers without autograd: the residual stream and the widest
        layer's working set, at the last chunk (the longest prefix)."""
        work = self.work
        tokens = min(work.chunk_size, work.stored)
        prefix = max(work.stored - tokens, 0)
        *layers, last = self.spec.layers
        working = max(
            (self.act.forward_working(layer, tokens, prefix) for layer in layers),
            default=0,
        )
        working = max(working, self.act.state_only_working(last, tokens, prefix))
        return tokens * self.cb * self.spec.hidden + working

    def branch_transient(self) -> int:
        """One replayed branch: its graph, then the head's logits or a layer's backward."""
        tokens, prefix = self.work.response_tokens, self.work.stored
        if self.work.activation_checkpointing:
            return self.act.checkpointed_branch_peak(tokens)
        graph = self.act.branch_graph(tokens)
        working = max(
            max(
                self.act.backward_working(layer, tokens, prefix),
                self.act.kernel_forward_scratch(layer, tokens, prefix),
            )
            for layer in self.spec.layers
        )
        return graph + max(self.act.head_peak(tokens), working)

    def sweep_transient(self) -> int:
        """Exact mode's recompute of the last chunk (the longest prefix) with autograd: its
        graph, the dS slices handed to backward with it, and a layer's backward."""
        if not self.exact:
            return 0
        work = self.work
        tokens = min(work.chunk_size, work.stored)
        start = work.stored - tokens
        produced = sum(
            layer.grad_per_token * tokens * self.cb // _FP32 + layer.grad_fixed * self.cb // _FP32
            for layer in self.spec.layers
        )
        if work.activation_checkpointing:
            return produced + self.act.checkpointed_chunk_peak(tokens, start)
        graph = self.act.chunk_graph(tokens, start)
        *layers, last = self.spec.layers
        working = max(
            (
                max(
                    self.act.backward_working(layer, tokens, start),
                    self.act.kernel_forward_scratch(layer, tokens, start),
                )
                for layer in layers
            ),
            default=0,
        )
        last_working = self.act.state_only_working(last, tokens, start)
        if last.mixer != "deltanet":  # its backward: the key/value projections only
            last_working = max(last_working, self.act.weight_grad_scratch(last))
        return graph + produced + max(working, last_working)

    def rollout_transient(self) -> int:
        """Rollout: the G branches' own caches and one decoding step's logits."""
        work = self.work
        group, new = work.group, work.response_tokens
        caches = sum(
            group * (layer.state_per_token * new + layer.state_fixed * (not layer.state_per_token))
            for layer in self.spec.layers
        )
        logits = 3 * group * self.spec.vocab * _FP32
        step = max(self.act.decode_scratch(layer, group, work.stored) for layer in self.spec.layers)
        tokens = 2 * group * new * _INT64  # sampled tokens, behaviour log-probs
        return caches + logits + step + tokens

    def optimizer_transient(self) -> int:
        """AdamW's step: foreach on CUDA (one temporary per moment, the whole shard);
        one tensor at a time on CPU (sqrt and quotient of the largest parameter)."""
        if self.work.device == "cuda":
            return self.trainable * self.state_bytes // self.work.shards
        largest = self.spec.largest_param if not self.work.lora_rank else self.lora_largest()
        return 2 * largest * self.state_bytes // self.work.shards

    def lora_largest(self) -> int:
        shapes = [
            self.work.lora_rank * max(inp, out)
            for layer in self.spec.layers
            for name, (inp, out) in layer.linear_shapes.items()
            if name in self.work.lora_targets
        ]
        return max(shapes, default=0)

    # --- the table and the phases ---------------------------------------------------------

    def lines(self) -> list[Line]:
        work = self.work
        lines = [
            Line("parameters", self.parameters(), note=self._param_note()),
            Line("gradients", self.gradients(), note=f"{_dtype_name(self.state_bytes)}"),
            Line("optimizer (AdamW)", self.optimizer(), note="2 moments"),
        ]
        for kind in self.kinds():
            device, cpu = self.state_split(kind, "state_per_token", "state_fixed")
            count = sum(layer.record == kind for layer in self.spec.layers)
            lines.append(Line(f"prefix state: {kind}", device, cpu, f"{count} layers"))
        if self.exact:
            grad_device = grad_cpu = 0
            for kind in self.kinds():
                device, cpu = self.state_split(kind, "grad_per_token", "grad_fixed")
                grad_device, grad_cpu = grad_device + device, grad_cpu + cpu
            lines.append(Line("dS (exact)", grad_device, grad_cpu, "float32, like the state"))
            device, cpu = self.checkpoints()
            if device or cpu:
                lines.append(Line("recurrent checkpoints", device, cpu, "one per chunk start"))
        lines.append(Line("prompt ids", 2 * _INT64 * work.prompt_tokens))
        if work.offload is not None and work.offload.active:
            lines.append(
                Line(
                    "streamed offloaded layers",
                    self.streamed(work.stored),
                    note=f"resident_layers={work.offload.resident_layers}",
                )
            )
        if work.fsdp:
            lines.append(Line("FSDP gathered parameters", self.gathered(), note="during passes"))
            lines.append(Line("FSDP unsharded gradients", self.unsharded_grads(), note="backward"))
        lines += [
            Line("prefill chunk (transient)", self.prefill_transient(), note="no autograd"),
            Line("one branch graph (transient)", self.branch_transient(), note=self._branch_note()),
        ]
        if self.exact:
            note = "layers checkpointed" if work.activation_checkpointing else ""
            lines.append(Line("sweep chunk graph (transient)", self.sweep_transient(), note=note))
        if work.rollout:
            lines.append(Line("rollout caches + step (transient)", self.rollout_transient()))
        lines.append(Line("optimizer step (transient)", self.optimizer_transient()))
        return lines

    def phases(self) -> dict[str, int]:
        """Peak device bytes of each phase of the step (recipe order)."""
        work = self.work
        state_device = sum(
            self.state_split(kind, "state_per_token", "state_fixed")[0] for kind in self.kinds()
        )
        grad_device = 0
        if self.exact:
            grad_device = sum(
                self.state_split(kind, "grad_per_token", "grad_fixed")[0] for kind in self.kinds()
            )
        base = self.parameters() + self.optimizer() + 2 * _INT64 * work.prompt_tokens
        base += state_device + self.checkpoints()[0]
        chunk = min(work.chunk_size, work.stored)
        backward = grad_device + self.gradients() + self.gathered() + self.unsharded_grads()
        phases = {
            "prefill": base
            + self.gathered()
            + self.streamed(work.stored - chunk)
            + self.prefill_transient(),
            "replay": base + backward + self.streamed(work.stored) + self.branch_transient(),
        }
        if work.rollout:
            phases["rollout"] = (
                base + self.gathered() + self.streamed(work.stored) + self.rollout_transient()
            )
        if self.exact:
            phases["sweep"] = (
                base + backward + self.streamed(work.stored - chunk) + self.sweep_transient()
            )
        phases["optimizer"] = base + self.gradients() + self.optimizer_transient()
        return {name: phases[name] for name in PHASES if name in phases}

    def _param_note(self) -> str:
        work = self.work
        note = f"{_count(self.spec.params)} x {_dtype_name(self.pb)}"
        if work.lora_rank:
            note += f" + LoRA {_count(self.lora_params())} x fp32"
        if work.shards > 1:
            note += f", sharded /{work.shards}"
        return note

    def _branch_note(self) -> str:
        tokens = self.work.response_tokens
        rows = self.act.head_rows(tokens)
        if rows < tokens:
            note = f"{tokens} tokens, logits [{rows}, {self.spec.vocab}] fp32 per chunk"
        else:
            note = f"{tokens} tokens, logits [T, {self.spec.vocab}] fp32"
        return note + (", layers checkpointed" if self.work.activation_checkpointing else "")


def _dtype_name(size: int) -> str:
    return {2: "bf16", 4: "fp32", 8: "fp64"}.get(size, f"{size} B")


def _advice(plan: MemoryPlan) -> list[str]:
    return []


# --------------------------------------------------------------------------- model sources


def preset_config(name: str) -> Any:
    """The transformers config of a named preset (``PRESETS``)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    return AutoConfig.for_model(preset.model_type, **preset.config)


def spec_for_preset(name: str, compute_dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    return ModelSpec.from_config(preset_config(name), name, compute_dtype)


def spec_for_config(cfg: Any, compute_dtype: torch.dtype) -> ModelSpec:
    """The model of a ``RunConfig``: its tiny config, or ``model.path/config.json`` (read
    through ``AutoConfig``: no weights), built on ``meta``."""
    from transformers import AutoConfig

    from longstraw_core.tiny_models import TINY_CONFIGS

    model = cfg.model
    if model.tiny is not None:
        config = AutoConfig.for_model(
            model.tiny, **{**TINY_CONFIGS[model.tiny], **model.tiny_overrides}
        )
        return ModelSpec.from_config(config, f"tiny {model.tiny}", compute_dtype)
    if model.path in PRESETS:
        return spec_for_preset(model.path, compute_dtype)
    config = AutoConfig.from_pretrained(
        model.path, trust_remote_code=model.trust_remote_code, local_files_only=True
    )
    return ModelSpec.from_config(config, Path(model.path).name, compute_dtype)


def workload_from_config(
    cfg: Any,
    prompt_tokens: int | None = None,
    *,
    group: int | None = None,
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    offload: OffloadPolicy | str | dict | None = None,
    device: str | None = None,
    model_type: str | None = None,
) -> Workload:
    """The step a ``RunConfig`` runs, with the CLI's overrides (``None``: from the config).

    The budget is ``gpu_mem`` or ``memory.gpu_mem``; ``gpus`` (or ``memory.gpus``) ranks
    shard the parameters when ``distributed.fsdp`` is on. Kernels are CUDA's when a budget
    is known, the CPU's otherwise (``device`` overrides). Without ``gpus`` or
    ``memory.gpus``, a launched run counts its ranks (``WORLD_SIZE``).
    """
    from longstraw_core.config import lora_targets
    from longstraw_core.memory import parse_bytes

    memory = getattr(cfg, "memory", None)
    gpu_mem = gpu_mem if gpu_mem is not None else getattr(memory, "gpu_mem", None)
    # torchrun and accelerate launch export WORLD_SIZE: a launched recipe shards over it.
    gpus = gpus or getattr(memory, "gpus", None) or int(os.environ.get("WORLD_SIZE", "1"))
    budget = None if gpu_mem is None else parse_bytes(gpu_mem)
    param_dtype = getattr(torch, cfg.model.dtype)
    bf16 = cfg.distributed.fsdp and cfg.distributed.mixed_precision == "bf16"
    lora = cfg.lora
    targets: tuple[str, ...] = ()
    if lora.enabled:
        targets = tuple(lora_targets(lora, model_type or _model_type(cfg)))
    return Workload(
        prompt_tokens=prompt_tokens or cfg.data.prompt_tokens,
        group=group or cfg.rollout.num_generations,
        response_tokens=cfg.rollout.max_new_tokens,
        chunk_size=cfg.train.chunk_size,
        gradient=cfg.grpo.gradient,
        checkpoints=cfg.grpo.recurrent_checkpoints,
        gpus=gpus,
        fsdp=cfg.distributed.fsdp,
        reshard_after_forward=cfg.distributed.reshard_after_forward,
        param_dtype=param_dtype,
        compute_dtype=torch.bfloat16 if bf16 else param_dtype,
        lora_rank=lora.r if lora.enabled else 0,
        lora_targets=targets,
        offload=_offload_of(cfg, offload),
        device=device or ("cuda" if budget is not None else "cpu"),
        budget=budget,
        headroom=getattr(memory, "headroom", 0.0) if budget is not None else 0.0,
        activation_checkpointing=_activation_checkpointing(cfg),
    )


def _activation_checkpointing(cfg: Any) -> bool:
    """The config's ``train.activation_checkpointing`` (False when the key is absent)."""
    return bool(getattr(getattr(cfg, "train", None), "activation_checkpointing", False))


def _model_type(cfg: Any) -> str | None:
    if cfg.model.tiny is not None:
        return cfg.model.tiny
    if cfg.model.path in PRESETS:
        return PRESETS[cfg.model.path].model_type
    from longstraw_core.config import model_facts

    return model_facts(cfg.model, check_paths=True).model_type


def _offload_of(cfg: Any, override: OffloadPolicy | str | dict | None) -> OffloadPolicy | None:
    """The offload policy: the CLI's, else the config's ``offload`` section."""
    from longstraw_core.config import offload_policy

    return OffloadPolicy.parse(override) if override is not None else offload_policy(cfg)


# --------------------------------------------------------------------------- advice


@dataclass(frozen=True)
class Fix:
    """A change that makes the step fit, with its config keys and the plan it gives."""

    label: str
    keys: str
    plan: MemoryPlan


def _advice(plan: MemoryPlan) -> list[str]:
    """What to change: the largest chunk that fits, offload when the state does not fit."""
    if plan.budget is None:
        return ["no GPU memory budget (memory.gpu_mem / --gpu-mem): nothing to check against"]
    work = plan.work
    advice = []
    if plan.cpu_bytes:
        ranks = min(work.gpus, 8)
        advice.append(
            f"CPU memory for the offloaded state: {_gib(plan.cpu_bytes)} per rank, "
            f"{_gib(plan.cpu_bytes * ranks)} for {ranks} ranks on a node"
        )
    if plan.fits:
        chunk = largest_chunk(plan.spec, work)
        if chunk is not None:
            advice.append(
                f"train.chunk_size={chunk} is the largest chunk that fits (configured: "
                f"{work.chunk_size}; larger chunks mean fewer prefill passes)"
            )
        return advice
    fixes = fixes_for(plan)
    if fixes:
        advice += [f"{fix.label}: {fix.keys} (peak {_gib(fix.plan.peak)})" for fix in fixes]
    else:
        advice.append(_no_fix(plan))
    return advice


def largest_chunk(spec: ModelSpec, work: Workload) -> int | None:
    """The largest power-of-two chunk (256 .. 65536, at most the prompt) that fits."""
    ceiling = max(CHUNK_CHOICES[0], work.stored)
    for chunk in sorted(CHUNK_CHOICES, reverse=True):
        if chunk > ceiling and chunk != CHUNK_CHOICES[0]:
            continue
        if plan_memory(spec, dataclasses.replace(work, chunk_size=chunk), advise=False).fits:
            return chunk
    return None


def _offload_options(spec: ModelSpec, work: Workload) -> list[tuple[OffloadPolicy, str]]:
    """(offload policy, where exact mode's checkpoints go) to try, least disruptive first:
    the growing state's layer types to CPU streaming two layers, the recurrent
    checkpoints to CPU too, one streamed layer, then every layer type."""
    base = work.offload or OffloadPolicy()
    growing = {layer.record for layer in spec.layers if layer.state_per_token}
    fields = {"full_attention": "attention", "mla_dsa": "latent"}
    changes = {fields[kind]: "cpu" for kind in growing if kind in fields}
    checkpoints = work.gradient == "exact" and any(layer.checkpoint for layer in spec.layers)
    options = [(dataclasses.replace(base, **changes, resident_layers=2), work.checkpoints)]
    if checkpoints:
        options.append((options[0][0], "cpu"))
    last = "cpu" if checkpoints else work.checkpoints
    options.append((dataclasses.replace(base, **changes, resident_layers=1), last))
    options.append((OffloadPolicy.cpu(resident_layers=1), last))
    return [option for option in options if _offloads_more(option, work)]


def _offloads_more(option: tuple[OffloadPolicy, str], work: Workload) -> bool:
    """Whether ``option`` keeps less on the device than the workload already does."""
    policy, checkpoints = option
    current = work.offload or OffloadPolicy()
    names = ("attention", "recurrent", "latent")
    if any(getattr(current, n) == "cpu" and getattr(policy, n) != "cpu" for n in names):
        return False
    if checkpoints != "cpu" and work.checkpoints == "cpu":
        return False
    if current.active and policy.resident_layers > current.resident_layers:
        return False
    return (policy, checkpoints) != (work.offload, work.checkpoints)


def fixes_for(plan: MemoryPlan) -> list[Fix]:
    """Changes that make ``plan`` fit: a smaller chunk, offload, or both (best first)."""
    spec, work = plan.spec, plan.work
    fixes = []
    chunk = largest_chunk(spec, work)
    if chunk is not None and chunk < work.chunk_size:
        fixed = plan_memory(spec, dataclasses.replace(work, chunk_size=chunk), advise=False)
        saves = _gib(plan.peak - fixed.peak)
        label = f"set train.chunk_size={chunk} (saves {saves})"
        fixes.append(Fix(label, f"train.chunk_size={chunk}", fixed))
    for policy, checkpoints in _offload_options(spec, work):
        trial = dataclasses.replace(work, offload=policy, checkpoints=checkpoints)
        keys = _offload_keys(policy)
        if checkpoints != work.checkpoints:
            keys += f" grpo.recurrent_checkpoints={checkpoints}"
        fixed = plan_memory(spec, trial, advise=False)
        if not fixed.fits:
            chunk = largest_chunk(spec, trial)
            if chunk is None or (fixes and chunk <= fixes[0].plan.work.chunk_size):
                continue  # no better than changing the chunk alone
            trial = dataclasses.replace(trial, chunk_size=chunk)
            fixed = plan_memory(spec, trial, advise=False)
            keys += f" train.chunk_size={chunk}"
        what = "offload the prefix state" if _all_cpu(policy) else "offload attention K/V"
        if "latent=cpu" in keys and not _all_cpu(policy):
            what = "offload the MLA latent"
        saves = _gib(plan.peak - fixed.peak)
        fixes.append(Fix(f"{what} to CPU (saves {saves})", keys, fixed))
        break
    if not work.activation_checkpointing:
        fixes += _checkpointing_fix(plan)
    return fixes


def _checkpointing_fix(plan: MemoryPlan) -> list[Fix]:
    """Activation checkpointing, with the first of its own fixes when it needs one."""
    trial = dataclasses.replace(plan.work, activation_checkpointing=True)
    fixed = plan_memory(plan.spec, trial, advise=False)
    keys = "train.activation_checkpointing=true"
    if not fixed.fits:
        more = fixes_for(fixed)
        if not more:
            return []
        fixed, keys = more[0].plan, f"{keys} {more[0].keys}"
    label = f"checkpoint each decoder layer's activations (saves {_gib(plan.peak - fixed.peak)})"
    return [Fix(label, keys, fixed)]


def _all_cpu(policy: OffloadPolicy) -> bool:
    return all(getattr(policy, name) == "cpu" for name in ("attention", "recurrent", "latent"))


def _offload_keys(policy: OffloadPolicy) -> str:
    keys = [
        f"offload.{name}=cpu"
        for name in ("attention", "recurrent", "latent")
        if getattr(policy, name) == "cpu"
    ]
    return " ".join([*keys, f"offload.resident_layers={policy.resident_layers}"])


def _no_fix(plan: MemoryPlan) -> str:
    """Nothing in chunking or offload fits: say what dominates, how far the prompt (or the
    responses) may go, and what else would help."""
    spec, work = plan.spec, plan.work
    best = dataclasses.replace(
        work,
        offload=OffloadPolicy.cpu(resident_layers=1),
        checkpoints="cpu",
        chunk_size=CHUNK_CHOICES[0],
    )
    floor = plan_memory(spec, dataclasses.replace(best, prompt_tokens=2), advise=False)
    parts = []
    if floor.fits:
        longest = _longest(spec, best, "prompt_tokens")
        parts.append(f"at most {longest:,} prompt tokens fit (state offloaded, chunk 256)")
    else:
        top = sorted(floor.lines, key=lambda line: -line.device)[:3]
        named = ", ".join(f"{line.name} {_gib(line.device)}" for line in top)
        parts.append(f"even a 2-token prompt needs {_gib(floor.peak)} per GPU ({named})")
    shorter = dataclasses.replace(best, response_tokens=1)
    if plan_memory(spec, shorter, advise=False).fits:
        longest = _longest(spec, best, "response_tokens")
        parts.append(f"or rollout.max_new_tokens={longest} with the whole prompt (offloaded)")
    if not work.lora_rank:
        parts.append("LoRA (lora.enabled=true) trains far fewer parameters")
    if work.fsdp:
        parts.append("more GPUs shard parameters, gradients and optimizer further")
    else:
        parts.append("distributed.fsdp=true shards parameters, gradients and optimizer")
    return "no chunk size or offload fits; " + "; ".join(parts)


def _longest(spec: ModelSpec, work: Workload, name: str) -> int:
    """The largest value of ``work.<name>`` (prompt or response tokens) that fits."""
    low, high = 1, max(getattr(work, name), 2)
    if plan_memory(spec, dataclasses.replace(work, **{name: high}), advise=False).fits:
        return high
    while high - low > max(1, low // 1000):
        middle = (low + high) // 2
        trial = dataclasses.replace(work, **{name: middle})
        if plan_memory(spec, trial, advise=False).fits:
            low = middle
        else:
            high = middle
    return low


# --------------------------------------------------------------------------- the check


def check_fits(
    cfg: Any,
    prompt_tokens: int | None = None,
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    *,
    group: int | None = None,
    offload: OffloadPolicy | str | dict | None = None,
) -> MemoryPlan:
    """The plan of ``cfg``'s step; raises ``MemoryPlanError`` naming a fix if it won't fit.

    No budget (``gpu_mem`` and ``memory.gpu_mem`` unset, e.g. a CPU run) or
    ``memory.check=false``: the plan is returned unchecked. Recipes call this before
    loading weights.
    """
    spec, work = plan_for_config(
        cfg, prompt_tokens, gpus=gpus, gpu_mem=gpu_mem, group=group, offload=offload
    )
    plan = plan_memory(spec, work)
    memory = getattr(cfg, "memory", None)
    if plan.fits is False and getattr(memory, "check", True):
        raise MemoryPlanError(_error_message(plan), plan)
    return plan


def plan_for_config(
    cfg: Any,
    prompt_tokens: int | None = None,
    **overrides: Any,
) -> tuple[ModelSpec, Workload]:
    model_type = None
    if cfg.model.tiny is not None:
        model_type = cfg.model.tiny
    work = workload_from_config(cfg, prompt_tokens, model_type=model_type, **overrides)
    spec = spec_for_config(cfg, work.compute_dtype)
    if work.lora_rank and not work.lora_targets:
        work = dataclasses.replace(work, lora_targets=tuple(_default_targets(cfg, spec)))
    return spec, work


def _default_targets(cfg: Any, spec: ModelSpec) -> list[str]:
    from longstraw_core.config import lora_targets

    return lora_targets(cfg.lora, spec.model_type)


def _error_message(plan: MemoryPlan) -> str:
    work = plan.work
    head = (
        f"predicted {_gib(plan.peak)} per GPU ({plan.peak_phase} phase) > "
        f"{_gib(plan.budget)} budget ({_gib(work.budget)} x (1 - memory.headroom "
        f"{work.headroom:g})) for {work.prompt_tokens:,} prompt tokens, G={work.group}, "
        f"{work.gpus} GPU(s)"
    )
    fixes = fixes_for(plan)
    if fixes:
        return head + ": " + " or ".join(f"{fix.label}: {fix.keys}" for fix in fixes)
    return head + ": " + _no_fix(plan)


def _gib(value: int | None) -> str:
    """Human-readable bytes (``format_bytes``), ``-`` for an unknown budget."""
    from longstraw_core.state import format_bytes

    return "-" if value is None else format_bytes(value)


def _count(value: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(value)


# --------------------------------------------------------------------------- output


def assumptions(plan: MemoryPlan) -> list[str]:
    """What the numbers assume, in words (printed under every table)."""
    work, spec = plan.work, plan.spec
    sharded = (
        f"FSDP2 over {work.gpus} GPUs shards parameters, gradients and AdamW moments; "
        "the prefix state, dS and activations are per rank (each rank holds its own group)"
        if work.fsdp
        else "one process: nothing sharded"
    )
    kernels = (
        "CUDA kernels: flash-attn (16-bit, equal head dims; MLA's latent uses the torch loop), "
        "flash-linear-attention for Gated DeltaNet"
        if work.device == "cuda"
        else "CPU kernels: PyTorch's fused attention for float32, the torch loops otherwise"
    )
    tuning = (
        f"LoRA r={work.lora_rank} on {', '.join(work.lora_targets)} (adapters fp32)"
        if work.lora_rank
        else "full fine-tuning"
    )
    return [
        f"model: {spec.name} ({spec.model_type}), {_count(spec.params)} parameters in "
        f"{_dtype_name(_bytes(work.param_dtype))}; layers compute and keep their state in "
        f"{_dtype_name(_bytes(work.compute_dtype))}; {tuning}",
        sharded,
        f"gradient={work.gradient}; {_checkpointing_note(work)}; logits in float32, in chunks of "
        f"at most {_head_chunk_elements():,} (recomputed in backward)",
        kernels,
        "AdamW moments in the trainable parameters' dtype; counted: tensor memory only "
        "(no CUDA context, NCCL buffers, fragmentation: that is what memory.headroom is for)",
    ]


def _head_chunk_elements() -> int:
    from model_adapters.base import HEAD_CHUNK_ELEMENTS

    return HEAD_CHUNK_ELEMENTS


def _checkpointing_note(work: Workload) -> str:
    if work.activation_checkpointing:
        return (
            "activation checkpointing per decoder layer (a branch, or a recomputed chunk, keeps "
            "each layer's input; backward recomputes one layer at a time)"
        )
    return (
        "no activation checkpointing inside a branch (the whole branch graph is kept until "
        "its backward)"
    )


def table_rows(plan: MemoryPlan) -> list[tuple[str, str, str, str]]:
    """The plan as (what, device, CPU, note) rows: pieces, phase peaks, the verdict."""
    rows = [
        (line.name, _gib(line.device), _gib(line.cpu) if line.cpu else "", line.note)
        for line in plan.lines
    ]
    rows += [(f"peak in {name}", _gib(value), "", "") for name, value in plan.phases.items()]
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no budget given"}[plan.fits]
    rows.append(
        (
            f"predicted peak per GPU ({plan.peak_phase})",
            _gib(plan.peak),
            _gib(plan.cpu_bytes),
            f"budget {_gib(plan.budget)}: {verdict}",
        )
    )
    return rows


def _title(plan: MemoryPlan) -> str:
    work = plan.work
    offload = ""
    if work.offload is not None and work.offload.active:
        offload = ", offload " + _offload_keys(work.offload).replace("offload.", "")
    checkpointing = ", activation checkpointing" if work.activation_checkpointing else ""
    return (
        f"{plan.spec.name}: {work.prompt_tokens:,} prompt tokens, G={work.group}, "
        f"{work.response_tokens} response tokens, chunk {work.chunk_size}, "
        f"{work.gradient}{checkpointing}, {work.gpus} GPU(s){offload}"
    )


def render_text(plan: MemoryPlan) -> str:
    """Plain aligned text (used when ``rich`` is missing, and in logs)."""
    rows = [("", "device", "CPU", ""), *table_rows(plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = [_title(plan)]
    for row in rows:
        out.append(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}")
    out += [f"advice: {line}" for line in plan.advice]
    out += [f"assumes: {line}" for line in assumptions(plan)]
    return "\n".join(out)


def render_markdown(plan: MemoryPlan) -> str:
    lines = [f"**{_title(plan)}**", "", "| | device | CPU | note |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows(plan)]
    lines.append("")
    lines += [f"- advice: {line}" for line in plan.advice]
    return "\n".join(lines)


def print_plan(plan: MemoryPlan) -> None:
    """The table with ``rich`` when installed, plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_text(plan))
        return
    table = Table(title=_title(plan), title_justify="left")
    for name, justify in (("", "left"), ("device", "right"), ("CPU", "right"), ("", "left")):
        table.add_column(name, justify=justify)
    rows = table_rows(plan)
    for index, row in enumerate(rows):
        style = "bold" if index == len(rows) - 1 else None
        table.add_row(*row, style=style, end_section=index == len(plan.lines) - 1)
    console = Console(width=max(120, Console().width))
    console.print(table)
    for line in plan.advice:
        console.print(f"advice: {line}")
    for line in assumptions(plan):
        console.print(f"[dim]assumes: {line}[/dim]")


# --------------------------------------------------------------------------- paper tables


@dataclass(frozen=True)
class Scenario:
    """One paper-scale setting: a preset, a prompt length, GPUs, LoRA or full."""

    preset: str
    prompt_tokens: int
    gpus: int
    gpu_mem: str
    lora_rank: int
    lora_targets: tuple[str, ...]


_QWEN_LORA = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_GLM_LORA = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
SCENARIOS = (
    Scenario("Qwen3.6-27B", 2_100_000, 8, "96GiB", 32, _QWEN_LORA),
    Scenario("Qwen3.6-27B", 2_100_000, 8, "96GiB", 0, ()),
    Scenario("Qwen3.6-27B", 4_460_000, 8, "96GiB", 32, _QWEN_LORA),
    Scenario("Qwen3.6-27B", 4_460_000, 8, "96GiB", 0, ()),
    Scenario("GLM-5.2", 2_100_000, 32, "96GiB", 32, _GLM_LORA),
    Scenario("GLM-5.2", 2_100_000, 32, "141GiB", 32, _GLM_LORA),
)


def scenario_workload(scenario: Scenario, group: int, gradient: str) -> Workload:
    """The shipped 8-/32-GPU configs' settings for a scenario (see ``paper_tables``)."""
    from longstraw_core.memory import parse_bytes

    lora = scenario.lora_rank > 0
    return Workload(
        prompt_tokens=scenario.prompt_tokens,
        group=group,
        response_tokens=2048,
        chunk_size=8192,
        gradient=gradient,
        checkpoints="device",
        gpus=scenario.gpus,
        fsdp=True,
        param_dtype=torch.bfloat16 if lora else torch.float32,
        compute_dtype=torch.bfloat16,
        lora_rank=scenario.lora_rank,
        lora_targets=scenario.lora_targets,
        device="cuda",
        budget=parse_bytes(scenario.gpu_mem),
        headroom=0.05,
        activation_checkpointing=True,  # as the shipped GPU configs set it
    )


def settle(spec: ModelSpec, work: Workload) -> MemoryPlan:
    """The plan as configured, or with the planner's first fix applied when it won't fit."""
    plan = plan_memory(spec, work)
    if plan.fits:
        return plan
    fixes = fixes_for(plan)
    return plan_memory(spec, fixes[0].plan.work) if fixes else plan


def paper_tables() -> str:
    """Markdown tables for the paper-scale scenarios, G=2 and G=8, detached and exact."""
    specs = {name: spec_for_preset(name) for name in PRESETS}
    out = [
        "## Memory plans at paper scale",
        "",
        "Generated by `python -m longstraw_core.plan --paper-tables PATH` (the planner: "
        "`longstraw_core/plan.py`). Per-GPU tensor memory of one GRPO step, as predicted "
        "before anything is loaded; when the configured step does not fit, the planner's "
        "first fix (a smaller chunk, or the growing prefix state offloaded to CPU memory) "
        "is applied and named.",
        "",
    ]
    for scenario in SCENARIOS:
        out += _scenario_table(specs[scenario.preset], scenario)
    out += ["### Assumptions", ""]
    out += [f"- {line}" for line in _paper_assumptions(specs)]
    return "\n".join(out) + "\n"


def _scenario_table(spec: ModelSpec, scenario: Scenario) -> list[str]:
    columns = [(g, mode) for mode in ("detached", "exact") for g in (2, 8)]
    plans = [settle(spec, scenario_workload(scenario, g, mode)) for g, mode in columns]
    tuning = f"LoRA r={scenario.lora_rank}" if scenario.lora_rank else "full fine-tuning"
    out = [
        f"### {scenario.preset}, {tuning}, {scenario.prompt_tokens / 1e6:.2f}M positions, "
        f"{scenario.gpus} x {scenario.gpu_mem}",
        "",
        "| GiB per GPU | " + " | ".join(f"{m} G={g}" for g, m in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    names = list(dict.fromkeys(line.name for plan in plans[::-1] for line in plan.lines))
    for name in names:
        cells = []
        for plan in plans:
            line = next((x for x in plan.lines if x.name == name), None)
            cells.append(_cell(line))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    for phase in PHASES:
        cells = [_gib_number(plan.phases.get(phase)) for plan in plans]
        out.append(f"| peak in {phase} | " + " | ".join(cells) + " |")
    out.append(
        "| **predicted peak** | " + " | ".join(f"**{_gib_number(p.peak)}**" for p in plans) + " |"
    )
    out.append(
        "| budget after headroom | " + " | ".join(_gib_number(p.budget) for p in plans) + " |"
    )
    out.append("| fits | " + " | ".join("yes" if p.fits else "**no**" for p in plans) + " |")
    per_node = min(scenario.gpus, 8)
    cpu = " | ".join(_gib_number(p.cpu_bytes * per_node) for p in plans)
    out.append(f"| CPU memory per node ({per_node} ranks) | {cpu} |")
    out.append("| settings | " + " | ".join(_settings(p) for p in plans) + " |")
    out.append("")
    for mode in ("detached", "exact"):
        two, eight = (plans[columns.index((g, mode))] for g in (2, 8))
        delta = (eight.peak - two.peak) / 1e9
        rollout = (eight.phases["rollout"] - two.phases["rollout"]) / 1e9
        out.append(
            f"- {mode}: G=2 -> G=8 adds {delta:+.2f} GB to the predicted peak "
            f"({two.peak_phase} -> {eight.peak_phase}); the rollout phase grows by "
            f"{rollout:+.2f} GB (G branch caches and logits)."
        )
    for plan in plans:
        if not plan.fits:
            out.append(
                f"- does not fit ({plan.work.gradient}, G={plan.work.group}): "
                + "; ".join(plan.advice)
            )
            break
    out.append("")
    return out


def _cell(line: Line | None) -> str:
    if line is None:
        return ""
    text = _gib_number(line.device)
    if line.cpu:
        text += f" (+{_gib_number(line.cpu)} CPU)"
    return text


def _gib_number(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _settings(plan: MemoryPlan) -> str:
    work = plan.work
    text = f"chunk {work.chunk_size}"
    if work.offload is not None and work.offload.active:
        text += ", " + _offload_keys(work.offload).replace("offload.", "")
    if work.gradient == "exact" and work.checkpoints == "cpu":
        text += ", recurrent_checkpoints=cpu"
    if work.activation_checkpointing:
        text += ", activation checkpointing"
    return text


def _paper_assumptions(specs: dict[str, ModelSpec]) -> list[str]:
    qwen = PRESETS["Qwen3.6-27B"]
    return [
        f"Qwen3.6-27B preset: {qwen.source}; built as `qwen3_5_text` "
        f"({specs['Qwen3.6-27B'].params / 1e9:.2f}B parameters): "
        + ", ".join(f"{k}={v}" for k, v in qwen.config.items() if k != "rope_parameters"),
        f"GLM-5.2 preset: {PRESETS['GLM-5.2'].source} ({specs['GLM-5.2'].params / 1e9:.1f}B "
        "parameters): 78 layers (3 dense, 75 MoE: 256 experts of 2048, top-8, 1 shared), "
        "hidden 6144, MLA q_lora 2048 / kv_lora 512 / rope 64, 64 heads, DSA indexer "
        "(32 x 128, top-2048) on every layer, vocabulary 154880",
        "Settings of the shipped configs (configs/qwen36/27b_*_8xgpu.yaml, "
        "configs/glm52/lora_grpo_32xgpu.yaml): 2048 response tokens, prefill chunk 8192, "
        "loss dapo, beta 0 (no reference model), FSDP2 per decoder layer with bf16 mixed "
        "precision (fp32 gradient reduction), reshard_after_forward on; LoRA r=32 on the "
        "configs' target modules with a bf16 base, full fine-tuning with fp32 master "
        "weights, gradients and AdamW moments (16 bytes per parameter, sharded)",
        "What FSDP2 shards: parameters, gradients, optimizer state (/ number of GPUs). Not "
        "sharded: the prefix state, dS, checkpoints and activations (each rank prefills "
        "its own group); the gathered parameters of the root (embeddings, head), the last "
        "layer and two more layers (computing, prefetched); in backward one layer's "
        "unsharded gradients in bf16 plus their fp32 copy for the reduction",
        "The prefix state is bf16 (the compute dtype); dS float32; Gated DeltaNet "
        "checkpoints (exact mode) one per chunk start, on the GPU",
        "Activation checkpointing per decoder layer (train.activation_checkpointing=true, "
        "as in the shipped configs): a 2048-token branch keeps each layer's input and one "
        "layer's graph during its backward; logits [2048, vocab] in float32 with "
        "log_softmax. Exact mode recomputes one prompt chunk (8192 tokens unless the table "
        "says otherwise) the same way",
        "Offload, when applied: the growing state (full-attention K/V, or MLA latent + "
        "indexer keys) in CPU memory, dS beside it, `resident_layers` layers streamed to the "
        "GPU at once (longstraw_core.offload); CPU figures are per rank (x8 per node)",
        "Kernels: flash-attn 2 for attention (head dim 256), flash-linear-attention for "
        "Gated DeltaNet, the pure-torch sparse latent attention and DSA top-k search for "
        "GLM (blocks of 2^22 elements); AdamW with foreach on CUDA",
        "Budget: the GPU's memory less 5% headroom for the CUDA context, NCCL and "
        "fragmentation, which the peak (tensor memory) does not count",
        "G only changes what rollout holds (G branch caches, logits [G, vocab]); replay "
        "keeps one branch at a time, so the replay and sweep peaks do not depend on G",
    ]


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m longstraw_core.plan",
        description="Predict the per-GPU memory of one LongStraw GRPO step (no weights loaded).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="a run config (YAML); key=value overrides follow")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a paper-scale preset")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.chunk_size=2048")
    parser.add_argument("--prompt-tokens", type=int, help="default: data.prompt_tokens")
    parser.add_argument("--group", type=int, help="G; default: rollout.num_generations")
    parser.add_argument("--response-tokens", type=int, help="default: rollout.max_new_tokens")
    parser.add_argument("--chunk-size", type=int, help="default: train.chunk_size")
    parser.add_argument("--gradient", choices=("detached", "exact"))
    parser.add_argument("--gpus", type=int, help="ranks (FSDP shards over them)")
    parser.add_argument("--gpu-mem", help="memory per GPU, e.g. 96GiB or 80GB")
    parser.add_argument("--headroom", type=float, help="fraction of --gpu-mem kept free")
    parser.add_argument(
        "--offload",
        action="append",
        default=[],
        metavar="KIND=cpu",
        help="attention=cpu, recurrent=cpu, latent=cpu or all=cpu (repeatable)",
    )
    parser.add_argument("--resident-layers", type=int, help="offloaded layers on the GPU at once")
    parser.add_argument("--lora-rank", type=int, help="preset: LoRA rank (0: full fine-tuning)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="which kernels to model")
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="recompute each decoder layer in backward (default: train.activation_checkpointing"
        ", off for a preset)",
    )
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    parser.add_argument("--paper-tables", metavar="PATH", help="write the paper-scale tables")
    return parser


def _offload_arg(args: argparse.Namespace) -> OffloadPolicy | None:
    if not args.offload and args.resident_layers is None:
        return None
    fields: dict[str, Any] = {}
    for item in args.offload:
        kind, _, place = item.partition("=")
        kinds = ("attention", "recurrent", "latent") if kind == "all" else (kind,)
        for name in kinds:
            fields[name] = place or "cpu"
    if args.resident_layers is not None:
        fields["resident_layers"] = args.resident_layers
    return OffloadPolicy.parse(fields)


def _cli_plan(args: argparse.Namespace) -> MemoryPlan:
    offload = _offload_arg(args)
    if args.preset:
        scenario = Scenario(
            args.preset,
            args.prompt_tokens or 131072,
            args.gpus or 1,
            args.gpu_mem or "96GiB",
            32 if args.lora_rank is None else args.lora_rank,
            _QWEN_LORA if PRESETS[args.preset].model_type != "glm_moe_dsa" else _GLM_LORA,
        )
        work = scenario_workload(scenario, args.group or 8, args.gradient or "exact")
        if args.gpu_mem is None:
            work = dataclasses.replace(work, budget=None)
        spec = spec_for_preset(args.preset, work.compute_dtype)
    else:
        from longstraw_core.config import load_config

        overrides = list(args.overrides)
        if args.gradient:
            overrides.append(f"grpo.gradient={args.gradient}")
        if args.chunk_size:
            overrides.append(f"train.chunk_size={args.chunk_size}")
        cfg = load_config(args.config, overrides, check_paths=False)
        spec, work = plan_for_config(
            cfg,
            args.prompt_tokens,
            group=args.group,
            gpus=args.gpus,
            gpu_mem=args.gpu_mem,
            offload=offload,
            device=args.device,
        )
    changes: dict[str, Any] = {}
    if args.response_tokens:
        changes["response_tokens"] = args.response_tokens
    if args.chunk_size:
        changes["chunk_size"] = args.chunk_size
    if args.headroom is not None:
        changes["headroom"] = args.headroom
    if offload is not None:
        changes["offload"] = offload
    if args.device:
        changes["device"] = args.device
    if args.activation_checkpointing is not None:
        changes["activation_checkpointing"] = args.activation_checkpointing
    return plan_memory(spec, dataclasses.replace(work, **changes))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; exit 1 with the fix named when it does not fit the budget."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.paper_tables:
        text = paper_tables()
        Path(args.paper_tables).write_text(text)
        print(text)
        print(f"wrote {args.paper_tables}")
        return 0
    if not args.config and not args.preset:
        parser.error("give --config PATH, --preset NAME or --paper-tables PATH")
    try:
        plan = _cli_plan(args)
    except (ValueError, OSError) as exc:
        hint = ""
        if "model.path" in str(exc) or isinstance(exc, OSError):
            hint = (
                f" (no weights are needed: a checkpoint's config.json, or a preset: "
                f"model.path={' / '.join(PRESETS)} or --preset)"
            )
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    print_plan(plan)
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(plan) + "\n")
    if plan.fits is False:
        print(f"error: {_error_message(plan)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
