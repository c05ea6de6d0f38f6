"""Gradients on pipeline stages: averaged over the replicas, clipped by the whole model's norm.

A stage holds the gradients of its own layers only. The norm a clip must use is the whole
model's: each stage's sum of squares, summed over the stages of its pipeline. Replicas of a
stage trained different prompts; their gradients are averaged (as FSDP and DDP average), and
``distributed.group_loss_scales`` over the replica group weights each prompt's share. With
FSDP2 across the replicas, FSDP averages them (its reduce-scatter) and each rank holds a
shard of its stage's gradients: the squares are then summed over every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Gradients are averaged in flat buckets of about this many bytes: one collective per bucket
# instead of one per parameter, without a second copy of every gradient at once.
BUCKET_BYTES = 1 << 28


def average_over_replicas(
    parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None
) -> None:
    """Average ``.grad`` over ``group`` (the replicas of this stage), in place.

    A parameter that got a gradient on some replica but not on this one (an expert only
    another prompt routed to) counts as zeros here, as one process over every prompt would
    see it; one that got none anywhere keeps ``grad=None``, so the optimizer leaves it alone
    as one process would (AdamW's weight decay skips it). No-op for a group of one.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    parameters = list(parameters)
    device = next((p.grad.device for p in parameters if p.grad is not None), None)
    device = device or (parameters[0].device if parameters else torch.device("cpu"))
    has_grad = torch.tensor([p.grad is not None for p in parameters], device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    with_grad = [p for p, flag in zip(parameters, has_grad.tolist(), strict=True) if flag]
    for parameter in with_grad:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    replicas = dist.get_world_size(group)
    for bucket in _buckets([p.grad for p in with_grad]):
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(replicas)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in runs of one dtype and device, each about ``BUCKET_BYTES`` at most."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        last = buckets[-1] if buckets else None
        same = last and last[0].dtype == grad.dtype and last[0].device == grad.device
        nbytes = grad.numel() * grad.element_size()
        if not same or size + nbytes > BUCKET_BYTES:
            buckets.append([grad])
            size = nbytes
        else:
            last.append(grad)
            size += nbytes
    return buckets


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the norm over every rank of ``group``: each
    rank's gradients scaled by ``max_norm / total_norm`` when that is below one. ``group``
    must hold each gradient element once: a pipeline's stages, or every rank when FSDP shards
    the stages over the replicas (a ``DTensor`` gradient counts its local shard). Returns the
    total norm (the same on every rank of ``group``)."""
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=dtype, device=device)
    for grad in grads:
        squares += grad.detach().to(dtype).pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return total


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a gradient (a ``DTensor``'s shard itself, under no_grad: scaling
    it scales the gradient)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad
