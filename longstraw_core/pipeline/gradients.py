"""Gradients on pipeline stages: averaged over the replicas, clipped by the whole model's norm.

A stage holds the gradients of its own layers only. The norm a clip must use is the whole
model's: each stage's sum of squares, summed over the stages of its pipeline. Replicas of a
stage trained different prompts; their gradients are averaged (as FSDP and DDP average), and
``distributed.group_loss_scales`` over the replica group weights each prompt's share. With
FSDP2 across the replicas, FSDP averages them (its reduce-scatter) and each rank holds a
shard of its stage's gradients: the squares are then summed over every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Gradients are averaged in flat buckets of about this many bytes: one collective per bucket
# instead of one per parameter, without a second copy of every gradient at once.
BUCKET_BYTES = 1 << 28
# The dtype of the clip's sum of squares on every rank, whatever gradients a rank holds (or
# none): a fixed dtype is the only choice every rank of a group makes alike without asking
# the others (stages hold different parameters, so a rule over the local gradients or
# parameters could differ: a float64 stage beside a float32 one, a stage with none).
# float64, as the float64 runs need; each gradient's own sum stays float32 or float64.
SQUARES_DTYPE = torch.float64


def average_over_replicas(
    parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None
) -> None:
    """Average ``.grad`` over ``group`` (the replicas of this stage), in place.

    A parameter that got a gradient on some replica but not on this one (an expert only
    another prompt routed to) counts as zeros here, as one process over every prompt would
    see it; one that got none anywhere keeps ``grad=None``, so the optimizer leaves it alone
    as one process would (AdamW's weight decay skips it). No-op for a group of one. Every
    replica holds the same stage, so the same parameters: the flags and buckets pair up, and
    a stage with no parameters returns on every replica alike. What this hands the
    collectives lives on ``reduction_device`` (the group's device, whether or not this rank
    has a gradient).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    parameters = list(parameters)
    if not parameters:
        return
    device = reduction_device(parameters, group)
    has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.uint8)
    has_grad = has_grad.to(device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    with_grad = [p for p, flag in zip(parameters, has_grad.tolist(), strict=True) if flag]
    for parameter in with_grad:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    replicas = dist.get_world_size(group)
    for bucket in _buckets([p.grad for p in with_grad]):
        flat = torch.cat([grad.reshape(-1) for grad in bucket]).to(device)
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
    total norm (float64, the same on every rank of ``group``).

    A rank may hold no gradient at all (every reward of its groups equal with ``beta=0``): its
    zero still joins the all-reduce, as a tensor on the device the group takes
    (``reduction_device``: a GPU under NCCL) in ``SQUARES_DTYPE``. Neither depends on which
    gradients a rank holds, so every rank hands the collective the same dtype and kind of
    device.
    """
    parameters = list(parameters)
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    device = reduction_device(parameters, group)
    squares = torch.zeros((), dtype=SQUARES_DTYPE, device=device)
    for grad in grads:
        # Each gradient's squares summed in float32 at least (float64 ones in float64).
        partial = grad.detach().to(torch.promote_types(grad.dtype, torch.float32))
        squares += partial.pow(2).sum().to(device=device, dtype=SQUARES_DTYPE)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
    return total


def reduction_device(
    parameters: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None
) -> torch.device:
    """Where the tensors this module hands a collective on ``group`` live. A group running
    NCCL takes CUDA tensors only: the GPU the parameters are on (their gradients need no
    copy), or the current GPU when this rank holds no parameter there (a stage with nothing
    to train). Any other group: the CPU. Without a group: where the parameters are. Read from
    the group and the parameters, never the gradients, so a rank holding none picks the same
    kind of device as its peers. (``distributed.collectives.collective_device`` is the same
    rule for tensors made from scratch, a floor above.)"""
    if group is None:
        return parameters[0].device if parameters else torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        on_gpu = (p.device for p in parameters if p.device.type == "cuda")
        return next(on_gpu, None) or torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a gradient (a ``DTensor``'s shard itself, under no_grad: scaling
    it scales the gradient)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad
