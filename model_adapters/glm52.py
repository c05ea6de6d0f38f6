"""GLM-5.x (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``): MLA + DSA indexer + MoE.

Each layer keeps only its compressed latent: the normalised ``c_kv`` and the roped shared key
``k_pe`` per position (``LatentKV``), plus the DSA indexer's keys on layers that run their
own indexer. The latent is never expanded into per-head keys and values (``docs/design.md``,
"Prefix state per layer kind"):

- **Weight absorption.** ``kv_b_proj`` maps the latent to per-head ``k_nope`` and ``v``. The
  key half is folded into the query (``q_nope W_uk``) and the value half into the output
  (``(P c_kv) W_uv``), so attention runs in latent space over single-"head" keys
  ``[c_kv, k_pe]`` and values ``c_kv``, for the prefix and the span alike.
- **DSA.** A "full" layer's indexer scores every earlier position (prefix and span) per query,
  streaming the keys in blocks and keeping a running top-k; "shared" layers reuse the previous
  full layer's selection. The attention then gathers only the selected latent rows per query
  block. When ``index_topk`` covers every visible position, the selection is everything and
  attention is dense causal: it goes through ``segmented_attention``. The indexer runs under
  ``no_grad``, as in transformers (its projections are frozen).
- **Exact mode.** The record's exact view (``longstraw_core.exact.LatentKVExactView``) gives
  a gradient buffer for the latent; both attention paths add the gradient of their prefix
  reads into it (``segmented_attention``'s ``prefix_grads``, or ``index_add_`` of the gathered
  rows in the sparse backward), never building a prefix-sized temporary. The indexer keys
  need none: nothing differentiable flows through the selection.
- **Decoding.** ``B`` branches run at once, each appending its latent and index keys to its
  own ``BranchLatent``; every function below takes a leading batch axis, the prefix latent
  and indexer keys stay shared (the batch is folded into the query axis against them).
- Everything else is the model's own modules (norms, projections, RoPE functions, router,
  experts, shared experts), so LoRA and checkpoints keep working.

This module is the family's one home (its declaration, the indexer, both attention paths
and their backward, the layer): longer than most, because splitting it would scatter one
family over several rooms, which ``docs/design.md`` ("Adding a model family") rules out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from longstraw_core import gpu_emulation, quantization
from longstraw_core.adapters.base import ModelAdapter, Span
from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.adapters.model_functions import RotaryFn, model_function
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.attention import accumulation_dtype, segmented_attention
from longstraw_core.fake import is_fake, representative
from longstraw_core.kinds.latent import BranchLatent, LatentKV
from longstraw_core.offload import OffloadPolicy, home_options
from model_adapters.dense import MLP_TARGETS

# --- the family: what config, tiny models, planner and offload know of it -------------------

# LoRA targets when ``lora.target_modules`` is null: of MLA, both low-rank halves of q and kv
# and ``o_proj``; never the DSA indexer (``wq_b``, ``wk``, ``weights_proj``: frozen during RL,
# as transformers runs it under no_grad). Routed experts are fused 3-D parameters, not
# ``nn.Linear``, so LoRA reaches only the dense MLP layers and the shared experts through
# ``gate/up/down_proj`` (plain peft would move those names onto the routed experts:
# ``longstraw_core.models.add_lora`` keeps them as written).
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

FAMILY = ModelFamily(
    name="glm52",
    model_types=("glm_moe_dsa", "deepseek_v32"),
    layer_kinds={LatentKV.kind: "latent"},
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
)


PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]

# Elements of scratch per block (indexer scores, gathered latent rows). On a CPU ~16 MB in
# fp32 keeps blocks in cache. On a GPU each block is a few kernel launches, and at GLM-5.2's
# widths 2^22 elements is ONE query per sparse-attention block and 2,048 keys per top-k
# block: millions of launches per layer for a million-token prompt (found by the dry run at
# real dimensions, ``longstraw_core.scale_check``). 2^28 (1 GiB in fp32) gives 68 queries
# and 65,536 keys per block.
_WORK_ELEMENTS = 1 << 22
_GPU_WORK_ELEMENTS = 1 << 28
# The RoPE function each model's indexer uses (the main attention is interleaved in both).
_INDEXER_ROPE = {
    "glm_moe_dsa": "apply_rotary_pos_emb_interleave",
    "deepseek_v32": "apply_rotary_pos_emb",
}


def work_elements(device_type: str = "cpu") -> int:
    """The block budget on a ``device_type`` device as it is now (read when called: tests
    patch it), for the planner."""
    return _GPU_WORK_ELEMENTS if device_type == "cuda" else _WORK_ELEMENTS


def _work_elements(like: torch.Tensor) -> int:
    """The block budget for work on ``like``'s device (a dry run's stand-in for a GPU's
    tensor gets the GPU's)."""
    return work_elements("cuda" if gpu_emulation.takes_gpu_path(like) else "cpu")


# --- weight absorption -----------------------------------------------------------------------


def effective_weight(linear: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a linear map applies, differentiable in its parameters.

    A plain ``nn.Linear`` gives its ``weight``, a 4-bit one (QLoRA's frozen base) its
    dequantized weight in its compute dtype. A wrapped one (PEFT LoRA, DoRA, ...) is applied
    to the identity, which folds every active adapter term in exactly as its forward would
    (a 4-bit base layer dequantizes in that forward, in its compute dtype).
    """
    if type(linear) is nn.Linear:
        return linear.weight
    if quantization.is_quantized(linear):
        return quantization.dequantized_weight(linear).to(linear.compute_dtype)
    if linear.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in linear.modules()):
        raise ValueError(
            "kv_b_proj is wrapped with dropout in training mode; its weight cannot be absorbed "
            "into attention. Use lora_dropout=0.0 for kv_b_proj or call model.eval()"
        )
    get_base_layer = getattr(linear, "get_base_layer", None)
    base = get_base_layer() if callable(get_base_layer) else linear
    dtype = quantization.weight_dtype(base)
    eye = torch.eye(base.in_features, dtype=dtype, device=base.weight.device)
    return linear(eye).T


def absorbed_weights(attention: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj`` split per head: ``W_uk [H, qk_nope, r]`` and ``W_uv [H, v_head_dim, r]``."""
    weight = effective_weight(attention.kv_b_proj)
    weight = weight.view(attention.num_heads, -1, attention.kv_lora_rank)
    return weight.split([attention.qk_nope_head_dim, attention.v_head_dim], dim=1)


def mla_projections(
    attention: nn.Module,
    hidden: torch.Tensor,
    position_embeddings: PositionEmbeddings,
    w_uk: torch.Tensor,
    rope: RotaryFn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absorbed queries ``[B, H, T, r + rope]``, the latent ``[B, T, r + rope]``, ``q_resid``.

    Mirrors the model's attention forward up to the attention itself: ``q_a_proj`` ->
    ``q_a_layernorm`` -> ``q_b_proj``; ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` on the
    latent; interleaved RoPE on ``q_rot`` and the shared ``k_rot``. Then ``q_nope`` is
    multiplied by ``W_uk``, so ``query . [c_kv, k_pe]`` equals the expanded ``q . k``.
    """
    batch, length, _ = hidden.shape
    q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden))
    queries = attention.q_b_proj(q_resid).view(batch, length, -1, attention.qk_head_dim)
    q_nope, q_rot = queries.transpose(1, 2).split(
        [attention.qk_nope_head_dim, attention.qk_rope_head_dim], dim=-1
    )
    compressed = attention.kv_a_proj_with_mqa(hidden)
    c_kv, k_rot = compressed.split([attention.kv_lora_rank, attention.qk_rope_head_dim], dim=-1)
    c_kv = attention.kv_a_layernorm(c_kv)
    cos, sin = position_embeddings
    q_rot, k_rot = rope(q_rot, k_rot.view(batch, 1, length, -1), cos, sin)
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
    latent = torch.cat([c_kv, k_rot[:, 0]], dim=-1)
    return torch.cat([q_latent, q_rot], dim=-1), latent, q_resid


# --- DSA indexer -----------------------------------------------------------------------------


@torch.no_grad()
def indexer_projections(
    indexer: nn.Module,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: PositionEmbeddings,
    rope: RotaryFn,
    with_queries: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The indexer's keys ``[B, T, Di]`` and, when asked, queries ``[B, T, Hi, Di]`` and
    head weights ``[B, T, Hi]``.

    Mirrors the model's indexer: ``k_norm(wk(x))``, RoPE on the leading ``rope`` dims (the
    model's own function: interleaved for GLM, half-split for DeepSeek-V3.2), head weights
    from ``weights_proj`` in float32 scaled by ``Hi ** -0.5``. Frozen: no gradients.
    """
    batch, length, _ = hidden.shape
    split = [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim]
    cos, sin = position_embeddings
    keys = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, T, 1, Di]
    k_rot, k_pass = keys.split(split, dim=-1)
    if not with_queries:
        _, k_rot = rope(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
        return torch.cat([k_rot, k_pass], dim=-1)[:, :, 0], None, None
    queries = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = queries.split(split, dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    queries = torch.cat([q_rot, q_pass], dim=-1)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * indexer.n_heads**-0.5
    return torch.cat([k_rot, k_pass], dim=-1)[:, :, 0], queries, weights


@torch.no_grad()
def select_topk(
    queries: torch.Tensor,
    weights: torch.Tensor,
    prefix_keys: torch.Tensor,
    span_keys: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The ``topk`` highest-scoring visible positions per query, ``[B, T, topk]``.

    ``queries`` ``[B, T, Hi, Di]`` and ``weights`` ``[B, T, Hi]`` of ``B`` branches, the
    shared ``prefix_keys`` ``[L, Di]`` and each branch's own ``span_keys`` ``[B, S, Di]``
    (``S >= T``: the queries are the last ``T`` of the branch's ``S`` positions). Index score
    of query ``t`` for key ``s``: ``sum_h w[t, h] relu(scale q[t, h] . k[s])`` in float32, as
    the model computes it; a query sees the whole prefix and its branch's keys up to itself.
    Keys are streamed in blocks of at least ``topk`` with a running top-k, so no ``[T, L]``
    score matrix is built and merging costs at most about one extra pass. Entries are
    absolute positions; ``-1`` pads the rows of queries that see fewer than ``topk``
    positions (they attend to all they see).
    """
    batch, length = queries.shape[:2]
    prefix_length = prefix_keys.shape[0]
    first = prefix_length + span_keys.shape[1] - length
    query_positions = first + torch.arange(length, device=queries.device)
    best_scores = queries.new_empty(batch, length, 0, dtype=torch.float32)
    best_positions = query_positions.new_empty(batch, length, 0)
    work = _work_elements(queries)
    block = max(topk, work // (batch * length))
    blocks = _blocks(prefix_keys, 0, block) + _blocks(span_keys, prefix_length, block)
    for keys, offset in representative(blocks, queries):
        scores = _index_scores(queries, weights, keys.to(queries.device), scale, work)
        positions = offset + torch.arange(keys.shape[-2], device=queries.device)
        scores = scores.masked_fill(positions[None, :] > query_positions[:, None], float("-inf"))
        scores = torch.cat([best_scores, scores], dim=-1)
        positions = torch.cat([best_positions, positions.expand(batch, length, -1)], dim=-1)
        best_scores, picked = scores.topk(min(topk, scores.shape[-1]), dim=-1)
        best_positions = positions.gather(-1, picked)
    return best_positions.masked_fill(best_scores == float("-inf"), -1)


def _index_scores(
    queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, work: int
) -> torch.Tensor:
    """``[B, T, n]`` index scores of ``n`` keys, a few indexer heads at a time (bounded memory).

    ``keys`` are ``[n, Di]`` (shared by the batch) or ``[B, n, Di]`` (one set per branch).
    """
    batch, length, heads, _ = queries.shape
    count = keys.shape[-2]
    keys_t = keys.float().transpose(-1, -2)
    if keys_t.dim() == 3:
        keys_t = keys_t[:, None]  # [B, 1, Di, n]: each branch's keys for all its queries
    scores = queries.new_zeros(batch, length, count, dtype=torch.float32)
    step = max(1, work // (batch * length * count))
    for head in representative(range(0, heads, step), queries):
        per_head = torch.relu((queries[:, :, head : head + step].float() @ keys_t) * scale)
        scores += (weights[:, :, None, head : head + step] @ per_head)[:, :, 0]
    return scores


def _blocks(x: torch.Tensor, offset: int, block: int) -> list[tuple[torch.Tensor, int]]:
    """Views of ``x`` ``[..., n, D]`` in blocks of rows, each with the absolute position of
    its first row."""
    return [
        (x[..., start : start + block, :], offset + start) for start in range(0, x.shape[-2], block)
    ]


# --- latent attention ------------------------------------------------------------------------


def latent_attention(
    queries: torch.Tensor,
    span_latent: torch.Tensor,
    prefix_latent: torch.Tensor,
    selection: torch.Tensor | None,
    value_dim: int,
    scale: float,
    prefix_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in latent space: ``[B, H, T, value_dim]`` from absorbed ``queries``.

    ``queries`` ``[B, H, T, D]``; ``span_latent`` ``[B, S, D]``, each branch's own rows (``S >=
    T``: the queries are its last ``T`` positions), or ``[T, D]`` when ``B = 1``;
    ``prefix_latent`` ``[L, D]`` shared by the batch; ``selection`` ``[B, T, k]`` absolute
    positions (``[T, k]`` when ``B = 1``). Keys are latent rows ``[c_kv, k_pe]`` (one head
    shared by all query heads), values their first ``value_dim`` columns (``c_kv``), as views
    of one buffer. ``selection=None`` is dense causal attention over prefix + span through
    ``segmented_attention`` (prefix by reference); otherwise each query attends to its
    selected positions only. ``prefix_grad`` (exact mode), shaped like ``prefix_latent``:
    backward *adds* the prefix's gradient into it, block by block, instead of returning one
    (no prefix-sized temporary).
    """
    if span_latent.dim() == 2:
        span_latent = span_latent[None]
        selection = None if selection is None else selection[None]
    if selection is None:
        keys = span_latent[:, None]
        prefix, sinks = [], []
        if prefix_latent.shape[0]:
            prefix = [(prefix_latent[None], prefix_latent[None, :, :value_dim])]
            if prefix_grad is not None:  # key and value views of one buffer: both add into it
                sinks = [(prefix_grad[None], prefix_grad[None, :, :value_dim])]
        return segmented_attention(
            queries, keys, keys[..., :value_dim], prefix, scale=scale, prefix_grads=sinks or None
        )
    output = _SparseLatentAttention.apply(
        queries.transpose(1, 2),
        span_latent,
        prefix_latent,
        selection,
        value_dim,
        scale,
        prefix_grad,
    )
    return output.transpose(1, 2)


def _query_blocks(positions: torch.Tensor, dim: int, heads: int) -> list[slice]:
    """Query blocks (of ``positions`` ``[B, T, k]``) whose gathered rows and scores stay
    under the block budget (``work_elements``); on fake tensors only the representative ones."""
    batch, length, topk = positions.shape
    step = max(1, _work_elements(positions) // (batch * topk * 3 * (dim + heads)))
    blocks = [slice(start, start + step) for start in range(0, length, step)]
    return list(representative(blocks, positions))


def _gather_rows(
    prefix_latent: torch.Tensor, span_latent: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Latent rows ``[B, b, k, D]`` at absolute ``positions`` ``[B, b, k]``, without joining
    the prefix and the span: each is gathered where it lives (``span_latent`` ``[B, S, D]``,
    one set of rows per branch) and the two are selected per entry. Padding entries (``-1``)
    yield an arbitrary row; callers mask them."""
    prefix_length = prefix_latent.shape[0]
    branch = torch.arange(span_latent.shape[0], device=positions.device)[:, None, None]
    rows = span_latent[branch, (positions - prefix_length).clamp(min=0)]
    if prefix_length:
        index = positions.clamp(0, prefix_length - 1).to(prefix_latent.device)
        prefix_rows = prefix_latent[index].to(rows.device)
        rows = torch.where((positions < prefix_length)[..., None], prefix_rows, rows)
    return rows


def _scatter_rows(
    d_span: torch.Tensor,
    d_prefixes: list[torch.Tensor],
    prefix_length: int,
    positions: torch.Tensor,
    d_rows: torch.Tensor,
) -> None:
    """Add ``d_rows [B, b, k, D]`` into the gradients of the rows they were gathered from.

    ``d_span``: ``[B, S, D]`` (contiguous); ``d_prefixes``: the buffers (any device and dtype)
    that take the prefix rows' share.
    """
    batch, span_length, dim = d_span.shape
    offsets = torch.arange(batch, device=positions.device)[:, None, None] * span_length
    span_rows = (positions - prefix_length + offsets).reshape(-1)
    positions, d_rows = positions.reshape(-1), d_rows.reshape(-1, dim)
    in_span = positions >= prefix_length
    if is_fake(positions):  # a dry run: no values to select by; the worst case, every row
        rows = d_rows.clone()  # what a boolean selection of every row copies
        d_span.view(-1, dim).index_add_(0, span_rows.clamp(min=0), rows)
        for d_prefix in d_prefixes:
            d_prefix.index_add_(0, positions.clamp(min=0).to(d_prefix.device),
                                rows.to(device=d_prefix.device, dtype=d_prefix.dtype))  # fmt: skip
        return
    d_span.view(-1, dim).index_add_(0, span_rows[in_span], d_rows[in_span])
    if d_prefixes:
        in_prefix = (positions >= 0) & ~in_span
        rows, index = d_rows[in_prefix], positions[in_prefix]
        for d_prefix in d_prefixes:
            d_prefix.index_add_(
                0,
                index.to(d_prefix.device),
                rows.to(device=d_prefix.device, dtype=d_prefix.dtype),
            )


class _SparseLatentAttention(torch.autograd.Function):
    """Each query attends to its own selected latent rows; flash-style recompute in backward.

    Arguments: ``queries [B, T, H, D]``, ``span_latent [B, S, D]`` (each branch's rows),
    ``prefix_latent [L, D]`` (shared, read by reference), ``positions [B, T, k]`` (absolute,
    ``-1`` = none), ``value_dim``, ``scale``,
    ``prefix_grad`` (``[L, D]`` or ``None``). Saves only the inputs, the output and the
    log-sum-exp; rows are gathered again per query block in backward. The prefix rows'
    gradient is added into ``prefix_grad`` (exact mode's sink) when given, and returned only
    when the prefix requires grad.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        queries: torch.Tensor,
        span_latent: torch.Tensor,
        prefix_latent: torch.Tensor,
        positions: torch.Tensor,
        value_dim: int,
        scale: float,
        prefix_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if prefix_grad is not None and prefix_grad.shape != prefix_latent.shape:
            raise ValueError(
                f"prefix_grad {tuple(prefix_grad.shape)} does not match the prefix latent "
                f"{tuple(prefix_latent.shape)}"
            )
        batch, length, heads, dim = queries.shape
        dtype = accumulation_dtype(queries.dtype)
        output = queries.new_empty(batch, length, heads, value_dim)
        lse = queries.new_empty(batch, length, heads, dtype=dtype)
        for block in _query_blocks(positions, dim, heads):
            rows = _gather_rows(prefix_latent, span_latent, positions[:, block]).to(dtype)
            scores = _masked_scores(queries[:, block].to(dtype), rows, positions[:, block], scale)
            lse[:, block] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, block, :, None])
            output[:, block] = (probs @ rows[..., :value_dim]).to(queries.dtype)
        ctx.save_for_backward(queries, span_latent, prefix_latent, positions, output, lse)
        ctx.value_dim, ctx.scale, ctx.prefix_grad = value_dim, scale, prefix_grad
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, d_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, span_latent, prefix_latent, positions, output, lse = ctx.saved_tensors
        need_query, need_span, need_prefix = ctx.needs_input_grad[:3]
        value_dim, scale, dtype = ctx.value_dim, ctx.scale, lse.dtype
        heads, dim = queries.shape[2:]
        d_queries = torch.zeros(queries.shape, dtype=dtype, device=queries.device)
        d_span = torch.zeros(span_latent.shape, dtype=dtype, device=span_latent.device)
        d_prefix = None
        if need_prefix:
            d_prefix = torch.zeros(prefix_latent.shape, dtype=dtype, device=prefix_latent.device)
        d_prefixes = [t for t in (d_prefix, ctx.prefix_grad) if t is not None]
        for block in _query_blocks(positions, dim, heads):
            rows = _gather_rows(prefix_latent, span_latent, positions[:, block]).to(dtype)
            q = queries[:, block].to(dtype)
            scores = _masked_scores(q, rows, positions[:, block], scale)
            probs = torch.exp(scores - lse[:, block, :, None])
            d_out = d_output[:, block].to(dtype)  # [B, b, H, r]
            d_sum = (d_out * output[:, block].to(dtype)).sum(-1, keepdim=True)
            d_probs = d_out @ rows[..., :value_dim].transpose(-1, -2)  # [B, b, H, k]
            d_scores = probs * (d_probs - d_sum) * scale
            d_queries[:, block] = d_scores @ rows
            if need_span or d_prefixes:
                d_rows = d_scores.transpose(-1, -2) @ q  # [B, b, k, D]
                d_rows[..., :value_dim] += probs.transpose(-1, -2) @ d_out
                _scatter_rows(
                    d_span, d_prefixes, prefix_latent.shape[0], positions[:, block], d_rows
                )
        return (
            d_queries.to(queries.dtype) if need_query else None,
            d_span.to(span_latent.dtype) if need_span else None,
            d_prefix.to(prefix_latent.dtype) if d_prefix is not None else None,
            None,
            None,
            None,
            None,
        )


def _masked_scores(
    queries: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """``scale * q . row`` ``[B, b, H, k]``, ``-inf`` at padding entries."""
    scores = (queries @ rows.transpose(-1, -2)) * scale
    return scores.masked_fill((positions < 0)[..., None, :], float("-inf"))


# --- one layer, the adapter ------------------------------------------------------------------


@register_adapter
class GlmMoeDsaAdapter(ModelAdapter):
    """GLM-5.x / DeepSeek-V3.2: pre-norm layers of MLA with DSA, then a dense MLP or an MoE."""

    family = FAMILY
    model_types = FAMILY.model_types

    def check_model(self) -> None:
        config = self.config
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(
                f"config.attention_dropout={config.attention_dropout}: scoring must be "
                "deterministic for RL; set attention_dropout=0.0"
            )
        if config.index_topk < 1:
            raise ValueError(f"config.index_topk must be at least 1, got {config.index_topk}")
        first = self.decoder.layers[0].self_attn
        if first.indexer is None:
            raise ValueError(
                "layer 0 reuses another layer's DSA selection (indexer_types[0] == 'shared'), "
                "but no earlier layer makes one; the first layer must be 'full'"
            )
        kv_b_proj = first.kv_b_proj
        base = kv_b_proj.get_base_layer() if hasattr(kv_b_proj, "get_base_layer") else kv_b_proj
        if getattr(base, "bias", None) is not None:
            raise ValueError("kv_b_proj has a bias; weight absorption assumes none (as in GLM-5)")
        self.rope = model_function(type(first), "apply_rotary_pos_emb_interleave")
        self.index_rope = model_function(type(first), _INDEXER_ROPE[config.model_type])

    def new_layer_state(
        self, index: int, layer: nn.Module, capacity: int, offload: OffloadPolicy | None
    ) -> LatentKV:
        attention = layer.self_attn
        indexer = attention.indexer
        return LatentKV.empty(
            capacity,
            attention.kv_lora_rank,
            attention.qk_rope_head_dim,
            None if indexer is None else indexer.head_dim,
            attention.num_heads * (attention.qk_head_dim + attention.v_head_dim),
            dtype=self.dtype,
            **home_options(offload, LatentKV.kind, self.device),
        )

    def layer_work(
        self,
        index: int,
        layer: nn.Module,
        position_embeddings: PositionEmbeddings,
        record: LatentKV,
        span: Span,
        branch_record: BranchLatent | None,
        state_only: bool,
        carried: torch.Tensor | None,
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]:
        """The layer's work; ``carried``: the previous layer's DSA selection."""
        # Dense when the last query of the span sees no more than index_topk positions.
        dense = self.config.index_topk >= span.start + span.length
        return functools.partial(
            self.decoder_layer,
            layer,
            position_embeddings,
            record,
            span,
            carried,
            dense,
            branch_record,
            state_only,
        )

    def carried_spec(self, batch: int, span: Span) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The DSA selection a stage hands the next: ``[batch, T, index_topk]`` positions,
        none while dense (when no query of the span sees more than ``index_topk``)."""
        if self.config.index_topk >= span.start + span.length:
            return None
        return ((batch, span.length, self.config.index_topk), torch.long)

    def layer_result(
        self, output: tuple[torch.Tensor | None, torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's output and its DSA selection, which the next layer receives."""
        return output

    def decoder_layer(
        self,
        layer: nn.Module,
        position_embeddings: PositionEmbeddings,
        record: LatentKV,
        span: Span,
        selection: torch.Tensor | None,
        dense: bool,
        branch_record: BranchLatent | None,
        state_only: bool,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One decoder layer over ``hidden``: MLA with DSA, then the dense MLP or MoE; also
        returns the DSA selection for the next layer. ``state_only``: write the latent and
        index keys, return ``(None, None)``."""
        attended, selection = self.run_attention(
            layer.self_attn,
            layer.input_layernorm(hidden),
            position_embeddings,
            record,
            span,
            selection,
            dense,
            branch_record,
            state_only,
        )
        if attended is None:
            return None, None
        hidden = hidden + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), selection

    def run_attention(
        self,
        attention: nn.Module,
        hidden: torch.Tensor,
        position_embeddings: PositionEmbeddings,
        record: LatentKV,
        span: Span,
        selection: torch.Tensor | None,
        dense: bool,
        branch: BranchLatent | None = None,
        state_only: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One MLA block over ``hidden`` ``[B, T, hidden]``: its output and the DSA selection.

        A layer with its own indexer makes a new selection (none when ``dense``); a shared
        layer passes the previous one on. Prefill chunks write their latent and index keys
        (kept even while dense: later chunks and branches may see more than ``index_topk``).
        With ``branch`` (decoding), the span's latent and index keys are appended to the
        branches' own (index keys even while dense, for later steps) and the queries see the
        prefix plus everything their branch holds. ``state_only``: write, then return
        ``(None, None)`` (see ``writes_only``).
        """
        w_uk, w_uv = absorbed_weights(attention)
        queries, latent, q_resid = mla_projections(
            attention, hidden, position_embeddings, w_uk, self.rope
        )
        prefix_end = span.start if span.write else record.length
        index_keys = None
        if attention.indexer is not None and (span.write or branch is not None or not dense):
            index_keys, index_queries, index_weights = indexer_projections(
                attention.indexer, hidden, q_resid, position_embeddings, self.index_rope, not dense
            )
        if span.write:
            record.write(span.start, latent[0], None if index_keys is None else index_keys[0])
            if state_only:
                return None, None
        if branch is not None:
            latent, index_keys = branch.append(latent, index_keys)
        if attention.indexer is not None and not dense:
            selection = select_topk(
                index_queries,
                index_weights,
                record.index_key_prefix(prefix_end),
                index_keys,
                attention.indexer.index_topk,
                attention.indexer.softmax_scale,
            )
        output = latent_attention(
            queries,
            latent,
            record.latent_prefix(prefix_end),
            selection,
            attention.kv_lora_rank,
            attention.scaling,
            prefix_grad=record.latent_grad(prefix_end),
        )
        output = torch.einsum("bhtr,hvr->bthv", output, w_uv).flatten(2)
        return attention.o_proj(output), selection
