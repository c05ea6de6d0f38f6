"""The Qwen3.6 blocks: gated full attention over an ``AttentionKV`` and Gated DeltaNet
threading its conv and recurrent states (``RecurrentState``, ``BranchRecurrent``)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_core.adapters.base import Span
from longstraw_core.kinds.recurrent import BranchRecurrent, RecurrentState
from model_adapters.dense import run_full_attention
from model_adapters.qwen36.kernels import DeltaNetKernels

# Qwen3.5's gated attention: dense attention whose ``q_proj`` also yields an output gate.
run_gated_attention = functools.partial(run_full_attention, gated=True)


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
    they are replaced by the ones it ends with. In a ragged step (``span.rows``) each branch
    ends after its own kept inputs (``_skip_padding``, ``_ragged_conv_state``).
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
    rows = span.rows if branch is not None else None
    if rows is not None:
        key, value, g, beta = _skip_padding(rows.counts, key, value, g, beta)
    # A decode step's one position takes the step kernel, and so does a ragged step at any
    # length; with autograd (a branch replayed in pieces on pipeline stages) the chunked
    # one, whose backward is the replay's.
    decoding = branch is not None and not torch.is_grad_enabled()
    ragged = rows is not None
    delta_rule = kernels.rule_for(length, ragged=ragged) if decoding else kernels.delta_rule
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
    if rows is not None:
        window = _ragged_conv_state(conv_input, rows.counts, conv_state.shape[-1])
        branch.update(window, final_state)
    elif branch is not None:
        branch.update(conv_input[:, :, kept:], final_state)

    output = deltanet.norm(
        output.reshape(-1, deltanet.head_v_dim), z.reshape(-1, deltanet.head_v_dim)
    )
    return deltanet.out_proj(output.reshape(batch, length, -1))


def _skip_padding(
    counts: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key, value, log decay and write strength with a ragged step's padding inputs (``t >=
    counts[b]``) zeroed, so that each padding step is the identity on the recurrent state.

    The step ``S <- S * exp(g) + k (beta (v - S^T k))^T`` is then exactly ``S * 1 + 0``; a
    selection, not a product with a mask, so a padding input that overflowed cannot carry a
    NaN into the state (the L2 norm of a zero key is zero). Padding outputs mean nothing.
    """
    length = key.shape[1]
    kept = torch.arange(length, device=counts.device) < counts[:, None]  # [B, T]
    kept = kept.to(key.device)
    key, value = (torch.where(kept[..., None, None], x, 0) for x in (key, value))
    g, beta = (torch.where(kept[..., None], x, 0) for x in (g, beta))
    return key, value, g, beta


def _ragged_conv_state(conv_input: torch.Tensor, counts: torch.Tensor, window: int) -> torch.Tensor:
    """Each row's conv window after its own kept inputs: ``conv_input [B, D, window + T]``'s
    ``window`` columns ending at column ``window + counts[b]`` (a row that sat out keeps the
    window it had)."""
    columns = counts.to(conv_input.device)[:, None] + torch.arange(window, device=conv_input.device)
    return conv_input.gather(2, columns[:, None, :].expand(-1, conv_input.shape[1], -1))
