"""The Qwen3.6 adapter: Gated DeltaNet and gated full-attention decoder layers, text only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from longstraw_core.adapters.base import ModelAdapter, Span, as_token_ids
from longstraw_core.adapters.model_functions import model_rotary_function
from longstraw_core.adapters.registry import register_adapter
from longstraw_core.kinds.attention import AttentionKV, BranchKV
from longstraw_core.kinds.recurrent import BranchRecurrent, RecurrentState
from longstraw_core.offload import OffloadPolicy, home_options
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors import gpu_emulation
from model_adapters.qwen36.family import FAMILY
from model_adapters.qwen36.kernels import deltanet_kernels
from model_adapters.qwen36.layers import run_gated_attention, run_gated_deltanet

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# RoPE variants whose frequencies depend on the length of each forward call: a chunked prefill
# cannot reproduce the full-sequence forward with them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Token ids that stand for images/videos in the multimodal config: they need pixel inputs and
# 3-D positions, which a text-only adapter does not have.
_VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id")


@register_adapter
class Qwen36Adapter(ModelAdapter):
    """Qwen3.6 / Qwen3.5 / Qwen3-Next: Gated DeltaNet and gated full-attention layers."""

    family = FAMILY
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
        """One decoder layer over ``hidden``: Gated DeltaNet or gated attention, then the MLP.
        With ``state_only`` it only writes its state and returns None."""
        kind = self.layer_types[index]

        def work(hidden: torch.Tensor) -> torch.Tensor | None:
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

        return work

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
