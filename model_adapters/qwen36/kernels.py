"""The Gated DeltaNet's sequence kernels, chosen per device and dtype: flash-linear-attention's
delta rule (chunked, and fused recurrent for decoding steps) and the ``causal_conv1d``
package on CUDA when installed, transformers' pure-torch functions elsewhere."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longstraw_core.adapters.model_functions import model_function
from longstraw_core.tensors import gpu_emulation

_FLA_DTYPES = (torch.float16, torch.bfloat16)  # fla's chunk kernel refuses float32
_CAUSAL_CONV1D_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CAUSAL_CONV1D_ACTIVATIONS = (None, "silu", "swish")


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

    def rule_for(self, length: int, *, ragged: bool = False) -> DeltaRuleFn:
        """The delta-rule kernel for a decoding span of ``length`` positions.

        A ragged step (``ragged``) steps token by token at any length: its padding steps
        then leave each state exactly as it was, and a branch's numbers do not depend on how
        its tokens were grouped into steps (the chunked kernel sums them in another order).
        """
        stepwise = length == 1 or ragged
        return self.step if stepwise and self.step is not None else self.delta_rule


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
