"""MLA weight absorption: ``kv_b_proj`` folded into the queries and the output, and the
projections that give the absorbed queries and the latent of a span."""

from __future__ import annotations

import torch
from torch import nn

from longstraw_core.adapters.model_functions import RotaryFn
from longstraw_core.tensors import quantization

PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]


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
