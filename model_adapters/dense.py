"""Dense decoder-only models with full (GQA) attention: Qwen3, Qwen2, Llama; Qwen3 and Qwen2
configs may make some layers sliding-window attention (``layer_types``, ``sliding_window``).

Each full-attention layer keeps its keys (after ``k_norm`` and RoPE) and values over the
prompt; a sliding-window layer keeps those of the last ``sliding_window - 1`` positions
(``kinds.window``) and attends to them and the span under the window. The layer
computation is the model's own, module by module (norms, projections, RoPE function, MLP),
with attention replaced by ``segmented_attention`` over the stored prefix plus the span.
Decoding runs the same code on ``B`` branches: the span's keys/values are appended to each
branch's ``BranchKV`` and the queries attend to the shared prefix plus all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longstraw_core.adapters.base import ModelAdapter, Span
from longstraw_core.adapters.family import ModelFamily
from longstraw_core.adapters.model_functions import RotaryFn, model_rotary_function
from longstraw_core.adapters.probe import (
    BENCHMARK_CAPABILITIES,
    TEST_CAPABILITIES,
    FamilyProbe,
    GpuShapes,
)
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.attention import segmented_attention
from longstraw_core.kinds.attention import AttentionKV, BranchKV
from longstraw_core.kinds.window import WindowKV, WindowReads
from longstraw_core.offload import OffloadPolicy, home_options

# --- the family: what config, tiny models, planner and offload know of it -------------------

# LoRA targets when ``lora.target_modules`` is null: attention and MLP projections everywhere
# (what "all-linear" LoRA means in practice). The other families extend these.
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]

# The tiny model: small but not degenerate: GQA (4 query heads over 2 KV heads), two layers,
# RoPE. The hybrid family starts from it.
TINY_DENSE: dict[str, Any] = {
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

# The prefill benchmark's widths (make gpu-check): wide enough for the GPU to be busy, a few
# layers (random weights). The hybrid family adds its Gated DeltaNet widths.
BENCH_WIDE: dict[str, int] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32000,
}

# What the cross-cutting tests and benchmarks build of it: qwen3 stands for the family, on
# every test and benchmark; on a GPU with head dim 64 (flash / SDPA take it).
PROBE = FamilyProbe(
    model_type="qwen3",
    capabilities=TEST_CAPABILITIES | BENCHMARK_CAPABILITIES,
    gpu=GpuShapes(
        recipe=("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
        recipe_dims={"head_dim": 64},
        bench_dims=BENCH_WIDE,
    ),
    expected_kernels=("attention",),
)

FAMILY = ModelFamily(
    name="dense",
    model_types=("qwen3", "qwen2", "llama"),
    layer_kinds=(AttentionKV.kind, WindowKV.kind),
    lora_targets={
        "qwen3": ATTENTION_TARGETS + MLP_TARGETS,
        "qwen2": ATTENTION_TARGETS + MLP_TARGETS,
        "llama": ATTENTION_TARGETS + MLP_TARGETS,
    },
    tiny_configs={
        "qwen3": dict(TINY_DENSE),
        "llama": dict(TINY_DENSE),
        "qwen2": dict(TINY_DENSE),
    },
    probe=PROBE,
)


def run_full_attention(
    attention: nn.Module,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    record: AttentionKV,
    span: Span,
    apply_rotary: RotaryFn,
    branch: BranchKV | None = None,
    state_only: bool = False,
    *,
    gated: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One full-attention block over ``hidden`` ``[B, T, hidden]``, reading/writing ``record``.

    Mirrors the transformers attention forward (q/k norms when present, RoPE, GQA) and
    returns the input of ``o_proj``'s caller: the projected attention output. ``branch``:
    the ``B`` decoded branches' own keys/values (see ``AttentionInputs``). ``state_only``
    (a writing span's last layer): write the keys/values, attend to nothing, return None.
    ``gated`` (Qwen3.5's gated attention, ``qwen36.run_gated_attention``): ``q_proj`` yields
    each head's query and its output gate side by side, and the attention output is
    multiplied by ``sigmoid(gate)`` before ``o_proj``, as the model does. ``window``: a
    sliding-window layer of that width, whose ``record`` is a ``WindowKV``
    (``attend_in_window``). ``sink``: per-head attention sinks (gpt-oss,
    ``segmented_attention(sink=)``).
    """
    batch, length, _ = hidden.shape
    head_dim = attention.head_dim
    shape = (batch, length, -1, head_dim)
    gate = None
    if gated:
        queries, gate = torch.chunk(
            attention.q_proj(hidden).view(batch, length, -1, head_dim * 2), 2, dim=-1
        )
        queries, gate = queries.view(shape), gate.reshape(batch, length, -1)
    else:
        queries = attention.q_proj(hidden).view(shape)
    keys = attention.k_proj(hidden).view(shape)
    values = attention.v_proj(hidden).view(shape).transpose(1, 2)
    if hasattr(attention, "q_norm"):
        queries, keys = attention.q_norm(queries), attention.k_norm(keys)
    cos, sin = position_embeddings
    queries, keys = apply_rotary(queries.transpose(1, 2), keys.transpose(1, 2), cos, sin)
    inputs = AttentionInputs(
        queries, keys, values, span, attention.scaling, branch, state_only, sink
    )
    if window is None:
        output = attend_with_state(inputs, record)
    else:
        output = attend_in_window(inputs, record, window=window)
    if output is None:
        return None
    output = output.transpose(1, 2).reshape(batch, length, -1)
    if gate is not None:
        output = output * torch.sigmoid(gate)
    return attention.o_proj(output)


@dataclass(frozen=True)
class AttentionInputs:
    """One span's attention inputs, as ``attend_with_state`` (full attention) and
    ``attend_in_window`` (sliding window) both take them: the two differ only in what they
    read of the record, so they share these, and the write and branch append below.

    ``queries`` ``[B, H, T, D]`` and ``keys``/``values`` ``[B, KVH, T, D]`` after RoPE;
    ``scale``: the softmax scale. ``branch`` (decoding): the ``B`` branches' own
    keys/values, which the span is appended to. ``state_only`` (a writing span's last
    layer): write the keys/values, attend to nothing. ``sink``: per-head attention sinks.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    span: Span
    scale: float
    branch: BranchKV | None = None
    state_only: bool = False
    sink: torch.Tensor | None = None

    def write(self, record: AttentionKV | WindowReads) -> None:
        """Fold a prefill chunk's keys and values (``B = 1``) into ``record``."""
        record.write(self.span.start, self.keys[0], self.values[0])

    def own_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values of what the queries belong to: the span alone, or appended to the
        ``branch``'s own (all the branches hold)."""
        if self.branch is None:
            return self.keys, self.values
        return self.branch.append(self.keys, self.values, ragged=self.span.rows)


def attend_with_state(inputs: AttentionInputs, record: AttentionKV) -> torch.Tensor | None:
    """Attention of a span over the stored prefix and itself; a prefill chunk is stored.

    A prefill chunk (``span.write``, ``B = 1``) reads the prefix before it and writes its
    own keys and values; a branch reads the whole prefix. With ``inputs.branch`` (decoding),
    the span is appended to the ``B`` branches' own keys/values and attends to all they hold;
    without it the branch is the span alone. In exact mode ``record`` is a view whose
    ``grad_segments`` receive the gradient of every prefix read. A record that keeps
    attention outputs stores a prefill chunk's, and exact mode's recompute of that chunk
    reuses it instead of attending again (``AttentionKV.keeps_outputs``).
    """
    span = inputs.span
    prefix_end = span.start if span.write else None
    prefix = record.segments(end=prefix_end)
    reuse = keep = None
    if span.write:
        inputs.write(record)
        if inputs.state_only:
            return None
        reuse = record.output_for(span.start, span.length)
        keep = [] if reuse is None and record.keeps_outputs else None
    keys, values = inputs.own_keys()
    ragged = span.rows is not None
    output = segmented_attention(
        inputs.queries,
        keys,
        values,
        prefix,
        scale=inputs.scale,
        prefix_grads=record.grad_segments(end=prefix_end),
        reuse=reuse,
        keep=keep,
        branch_positions=span.rows.query_positions(span.length) if ragged else None,
        sink=inputs.sink,
    )
    if keep:
        record.write_output(span.start, keep[0])
    return output


def attend_in_window(
    inputs: AttentionInputs, record: WindowReads, *, window: int
) -> torch.Tensor | None:
    """``attend_with_state`` for a sliding-window layer of width ``window``.

    The stored window before the span (at most ``window - 1`` positions: the record's
    ``read``, with gradient sinks in exact mode) goes at the head of the span's (or the
    branches') keys and values (those the first query can still see), and
    ``segmented_attention(window=)`` hides from each query the keys ``window`` or more
    positions before it. A prefill chunk then folds its keys and values into the record
    (after the read: the record shifts in place).
    """
    span, queries = inputs.span, inputs.queries
    stored_keys, stored_values = record.read(span.start if span.write else None)
    if span.write and inputs.state_only:
        inputs.write(record)
        return None
    keys, values = inputs.own_keys()
    if span.rows is None:  # only the stored keys the first query still sees (none once the
        # branch has run ``window - 1`` positions): decoding copies less, then nothing
        first = keys.shape[2] - queries.shape[2]  # the first query's branch position
        hidden = min(max(first + stored_keys.shape[1] - window + 1, 0), stored_keys.shape[1])
        stored_keys, stored_values = stored_keys[:, hidden:], stored_values[:, hidden:]
    batch, ahead = queries.shape[0], stored_keys.shape[1]
    all_keys, all_values = (
        torch.cat([stored.to(own).expand(batch, -1, -1, -1), own], dim=2)
        for stored, own in ((stored_keys, keys), (stored_values, values))
    )
    if span.write:
        inputs.write(record)
    positions = None
    if span.rows is not None:
        positions = span.rows.query_positions(span.length) + ahead
    return segmented_attention(
        queries,
        all_keys,
        all_values,
        scale=inputs.scale,
        window=window,
        branch_positions=positions,
        sink=inputs.sink,
    )


@register_adapter
class DenseAdapter(ModelAdapter):
    """Qwen3 / Qwen2 / Llama: pre-norm decoder layers of full attention and a gated MLP."""

    family = FAMILY

    def check_model(self) -> None:
        config = self.config
        layer_types = getattr(config, "layer_types", None) or []
        known = ("full_attention", "sliding_attention")
        other = [i for i, kind in enumerate(layer_types) if kind not in known]
        if other:
            raise ValueError(
                f"layers {other} of this {config.model_type} model use "
                f"{layer_types[other[0]]!r}; the dense adapter runs {list(known)}"
            )
        sliding = [kind == "sliding_attention" for kind in layer_types]
        width = getattr(config, "sliding_window", None)
        if any(sliding) and (not isinstance(width, int) or width < 1):
            raise ValueError(
                f"this {config.model_type} model has sliding-window layers but "
                f"sliding_window={width!r}; it must be an int >= 1"
            )
        # The window of each layer (None: full attention), as the model's own mask has it.
        self.windows = [width if slides else None for slides in sliding] or [None] * len(
            self.decoder.layers
        )
        self.apply_rotary = model_rotary_function(self.decoder.layers[0].self_attn)

    def new_layer_state(
        self, index: int, layer: nn.Module, capacity: int, offload: OffloadPolicy | None
    ) -> AttentionKV | WindowKV:
        kv_heads = self.config.num_key_value_heads
        head_dim = layer.self_attn.head_dim
        window = self.windows[index]
        if window is not None:  # a fixed size, whatever the prompt's length
            home = home_options(offload, WindowKV.kind, self.device)
            return WindowKV.empty(kv_heads, window, head_dim, dtype=self.dtype, **home)
        home = home_options(offload, AttentionKV.kind, self.device)
        return AttentionKV.empty(kv_heads, capacity, head_dim, dtype=self.dtype, **home)

    def layer_work(
        self,
        index: int,
        layer: nn.Module,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        record: AttentionKV,
        span: Span,
        branch_record: BranchKV | None,
        state_only: bool,
        carried: None,
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """One pre-norm decoder layer over ``hidden``: attention with the state, then the MLP.
        With ``state_only`` it only writes its keys/values and returns None."""

        def work(hidden: torch.Tensor) -> torch.Tensor | None:
            attended = run_full_attention(
                layer.self_attn,
                layer.input_layernorm(hidden),
                position_embeddings,
                record,
                span,
                self.apply_rotary,
                branch_record,
                state_only,
                window=self.windows[index],
                sink=self.attention_sink(layer),
            )
            if attended is None:
                return None
            hidden = hidden + attended
            return hidden + self.run_mlp(layer, layer.post_attention_layernorm(hidden))

        return work

    def attention_sink(self, layer: nn.Module) -> torch.Tensor | None:
        """The layer's per-head attention sinks (``segmented_attention(sink=)``): none here."""
        return None

    def run_mlp(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's MLP over the normed ``hidden``."""
        return layer.mlp(hidden)
