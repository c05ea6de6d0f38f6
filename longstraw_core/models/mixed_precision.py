"""bf16 compute over float32 master weights on one device: bf16 *working weights* per step.

With ``distributed.fsdp=true``, ``distributed.mixed_precision=bf16`` is FSDP2's
``MixedPrecisionPolicy``: every pass gathers each layer's float32 shards as bfloat16, the
gradients computed in bfloat16 are reduced in float32 into the float32 shards, and AdamW
updates those. Without FSDP, ``WorkingWeights`` does the same on one device:

- ``step()``: for one training step every trained float32 parameter holds a bfloat16 copy of
  its values, so prefill, rollout, replay and the exact sweep all run the model exactly as a
  bfloat16 model runs (the prefix state is kept in bfloat16 too, half its float32 size);
- each backward's bfloat16 gradient is added into a float32 sum as soon as autograd has
  accumulated it (a post-accumulate-grad hook), so the many backwards of a step (one per
  branch, one per sweep chunk) add up in float32, as FSDP's float32 reduce-scatter does;
- ``to_masters()`` (before the clip and the optimizer step; leaving ``step()`` does it too)
  puts the float32 values back and the float32 sum in ``.grad``: clipping, AdamW, the
  non-finite guard and checkpoints only ever see float32 master weights;
- frozen float32 parameters (a LoRA base, the frozen reference model) are cast to bfloat16
  once, for good: nothing updates them, so they need no master copy.

Why this and not ``torch.autocast`` over float32 weights: ``docs/design.md``, "Mixed precision
on one device". In short: the same bfloat16 model runs every pass on every device, LongStraw's
own fused kernels included (autocast's per-op lists do not cover
``_scaled_dot_product_flash_attention_for_cpu`` or flash-attn, which would receive mixed
float32/bfloat16 inputs), the state is stored in bfloat16, and one GPU computes what the
sharded runs compute (tested equal to FSDP2's policy on a world of one rank).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from longstraw_core.grpo import generation

if TYPE_CHECKING:
    from longstraw_core.config import RunConfig


class FullPrecision:
    """Every parameter computes in its own dtype (``distributed.mixed_precision=fp32``, or
    FSDP2 applying the bf16 policy itself): nothing to do."""

    def step(self) -> nullcontext[None]:
        return nullcontext()

    def to_masters(self) -> None:
        return None

    @staticmethod
    def scale_gradients(parameters: Iterable[nn.Parameter], factor: float) -> None:
        """Multiply the gradients accumulated so far (in ``.grad``) by ``factor``."""
        generation.scale_gradients(parameters, factor)


class WorkingWeights:
    """bfloat16 working weights over the float32 master weights ``model`` holds."""

    def __init__(
        self,
        model: nn.Module,
        *,
        frozen: Iterable[nn.Module] = (),
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """``model``: the policy (its float32 trained parameters are the masters, those the
        optimizer holds); ``frozen``: models nothing trains (the reference policy), cast to
        ``dtype`` now as the policy's frozen parameters are."""
        self.dtype = dtype
        for module in (model, *frozen):
            for parameter in module.parameters():
                if not parameter.requires_grad and parameter.dtype == torch.float32:
                    parameter.data = parameter.data.to(dtype)
        self.masters = [
            p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32
        ]
        self._saved: list[torch.Tensor] | None = None  # the float32 values during a step
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step on bfloat16 working weights; float32 masters again after it
        (or after ``to_masters``, whichever comes first)."""
        if any(p.grad is not None for p in self.masters):
            raise RuntimeError(
                "WorkingWeights.step: the master weights hold gradients from before the step; "
                "zero them (optimizer.zero_grad(set_to_none=True)) first"
            )
        self._saved = [p.data for p in self.masters]
        self._sums = {}
        for parameter in self.masters:
            parameter.data = parameter.data.to(self.dtype)
            self._hooks.append(parameter.register_post_accumulate_grad_hook(self._add))
        try:
            yield
        finally:
            self.to_masters()

    def _add(self, parameter: torch.Tensor) -> None:
        """Move one backward's bfloat16 gradient into the float32 sum."""
        grad = parameter.grad.to(torch.float32)
        total = self._sums.get(parameter)
        self._sums[parameter] = grad if total is None else total.add_(grad)
        parameter.grad = None

    def scale_gradients(self, parameters: Iterable[nn.Parameter], factor: float) -> None:
        """Multiply the gradients accumulated so far by ``factor``: the float32 sums during a
        step, ``.grad`` otherwise (``GenerationBatch.finish``'s correction)."""
        with torch.no_grad():
            for parameter in parameters:
                total = self._sums.get(parameter)
                if total is not None:
                    total.mul_(factor)
                elif parameter.grad is not None:
                    parameter.grad.mul_(factor)

    def to_masters(self) -> None:
        """The float32 values back in the parameters, the float32 gradient sums in ``.grad``
        (None where no backward reached a parameter). Idempotent; a no-op outside a step."""
        if self._saved is None:
            return
        for hook in self._hooks:
            hook.remove()
        for parameter, master in zip(self.masters, self._saved, strict=True):
            parameter.data = master
            parameter.grad = self._sums.get(parameter)
        self._hooks, self._saved, self._sums = [], None, {}


def step_precision(
    cfg: RunConfig, model: nn.Module, reference: object | None = None
) -> WorkingWeights | FullPrecision:
    """The run's per-step precision: ``WorkingWeights`` for ``distributed.mixed_precision=bf16``
    without FSDP (validation allows it over float32 ``model.dtype`` in one process), else
    ``FullPrecision`` (FSDP2 applies its own policy; fp32 runs compute in ``model.dtype``).

    ``reference``: the KL reference policy, if any; a separately loaded frozen model (full
    fine-tuning) is cast to bfloat16 with the policy's frozen weights (LoRA's reference is
    the policy itself, adapters off)."""
    distributed = cfg.distributed
    if distributed.mixed_precision != "bf16" or distributed.fsdp:
        return FullPrecision()
    frozen = getattr(reference, "model", None)
    return WorkingWeights(model, frozen=[] if frozen is None else [frozen])
