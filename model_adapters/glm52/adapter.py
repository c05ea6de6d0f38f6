"""The GLM-5.x / DeepSeek-V3.2 adapter: one decoder layer of MLA with DSA, then the dense
MLP or the MoE, over the layer's ``LatentKV`` record."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longstraw_core.adapters.base import ModelAdapter, Span
from longstraw_core.adapters.model_functions import model_function
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.kinds.latent import BranchLatent, LatentKV
from longstraw_core.offload import OffloadPolicy, home_options
from model_adapters.glm52.absorb import PositionEmbeddings, absorbed_weights, mla_projections
from model_adapters.glm52.dsa import indexer_projections, select_topk
from model_adapters.glm52.family import FAMILY
from model_adapters.glm52.mla import latent_attention

# The RoPE function each model's indexer uses (the main attention is interleaved in both).
_INDEXER_ROPE = {
    "glm_moe_dsa": "apply_rotary_pos_emb_interleave",
    "deepseek_v32": "apply_rotary_pos_emb",
}


@register_adapter
class GlmMoeDsaAdapter(ModelAdapter):
    """GLM-5.x / DeepSeek-V3.2: pre-norm layers of MLA with DSA, then a dense MLP or an MoE."""

    family = FAMILY

    def check_model(self) -> None:
        config = self.config
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
        """One decoder layer over ``hidden``: MLA with DSA, then the dense MLP or MoE; also
        returns the DSA selection for the next layer (``carried``: the previous layer's).
        ``state_only``: write the latent and index keys, return ``(None, None)``."""
        # Dense when the last query of the span sees no more than index_topk positions.
        dense = self.config.index_topk >= span.start + span.length

        def work(hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            attended, selection = self.run_attention(
                layer.self_attn,
                layer.input_layernorm(hidden),
                position_embeddings,
                record,
                span,
                carried,
                dense,
                branch_record,
                state_only,
            )
            if attended is None:
                return None, None
            hidden = hidden + attended
            return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), selection

        return work

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
        branch_positions = None
        if span.rows is not None:  # a ragged decode step: each row at its own position
            branch_positions = span.rows.query_positions(span.length)
        if branch is not None:
            latent, index_keys = branch.append(latent, index_keys, ragged=span.rows)
        if attention.indexer is not None and not dense:
            selection = select_topk(
                index_queries,
                index_weights,
                record.index_key_prefix(prefix_end),
                index_keys,
                attention.indexer.index_topk,
                attention.indexer.softmax_scale,
                branch_positions,
            )
        output = latent_attention(
            queries,
            latent,
            record.latent_prefix(prefix_end),
            selection,
            attention.kv_lora_rank,
            attention.scaling,
            prefix_grad=record.latent_grad(prefix_end),
            branch_positions=branch_positions,
        )
        output = torch.einsum("bhtr,hvr->bthv", output, w_uv).flatten(2)
        return attention.o_proj(output), selection
