"""Sharded training: FSDP2 over the adapter's model, GRPO groups spread across ranks.

``shard_model(adapter)`` applies ``fully_shard`` to every decoder layer, then to the root
(the causal LM, which keeps the embeddings, the final norm and the head), as torchtitan's
``parallelize`` functions do; each rank keeps ``1 / world_size`` of every parameter and of its
gradient and optimizer state. Then each rank runs its own share of the step's groups
(``spread_groups``), and the gradients are averaged across ranks as they are computed.

How FSDP's hooks are engaged. ``fully_shard(layer)`` gathers a layer's parameters in a
forward pre-hook on ``layer.__call__`` and arms its backward hooks (gather again before the
layer's backward, reduce-scatter the gradients after it) from its forward hooks. The adapters
never call a layer: their ``run_layers`` drive its submodules with the prefix state. So every
decoder layer and the root get a method that only calls the function it is given
(``longstraw_forward``), registered with ``register_fsdp_forward_method``; the adapters send
each layer's work through ``ModelAdapter.call_layer`` and each pass over the model (a prefill
chunk, a branch, a decoding step, a recomputed chunk) through ``ModelAdapter._call_model``,
which call these methods on a sharded model and are plain calls otherwise. A layer's work
receives only the activations as arguments (FSDP casts them under mixed precision and hooks
the ones that need a gradient); what a recomputed prompt chunk writes (exact mode) is returned
to FSDP as well, so the layer is gathered again before the backward of those tensors.

Ranks in step. FSDP's gathers and reductions are collectives: every rank must run the same
passes in the same order, whatever its group holds. The loops whose length depends on the
data agree on the longest before they start and pad the shorter ranks with idle passes
(``ModelAdapter.in_step``): prefill chunks with passes that only gather, branches with a
zero-weight one-token branch, sweep chunks with a zero-gradient recompute; rollout decodes
until every rank's branches are done. So every rank must call ``prefill``, ``rollout``,
``grpo_step`` and the helpers below the same number of times, in the same order, with the
same settings (loss type, gradient mode, ``max_new_tokens``); groups may differ in prompt
length, group size and response lengths.

Gradient normalisation. The loss of an optimizer step is TRL's loss over all the step's
responses as one batch: ``losses.loss_weights`` over their concatenation (``dapo``/``bnpo``/
``cispo``: the sum of the per-token terms over all the step's active tokens; ``grpo``: the
mean over all responses of each response's token mean; ``dr_grpo``: the sum over
``(responses x max_completion_length)``). It equals each group's own loss (what
``grpo_step`` backpropagates) times its share of the step's normaliser: active tokens for the
token-level losses, responses for ``grpo``/``dr_grpo``. FSDP averages gradients over the
ranks, so ``group_loss_scales`` gives each group ``world_size x`` its share, to pass to
``grpo_step(..., loss_scale=...)``. One process with several groups per step gets the same
gradient with the same call. ``scale_rewards="batch"`` divides by the std of every reward of
the step (``step_reward_std``); ``generation.GenerationBatch`` does both for groups that
arrive one rollout at a time, as the recipes' do.

Typical use under ``torchrun``::

    dist.init_process_group("nccl")  # "gloo" on CPU
    adapter = shard_model(ls.adapt(model))  # before the optimizer is built
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for groups in batches:  # every rank sees the same list of groups
        mine = spread_groups(groups, dist.get_rank(), dist.get_world_size())
        scales = group_loss_scales([g.lengths for g in mine], config)
        for group, scale in zip(mine, scales):
            metrics = ls.grpo_step(adapter, ..., config=config, loss_scale=scale)
        optimizer.step()
        optimizer.zero_grad()
        metrics = reduce_metrics(metrics)

The recipes run this way under ``torchrun ... distributed.fsdp=true``: ``prompts_per_step``
groups per rank and step (samples ``data_position + rank * prompts_per_step + k``), through
``GenerationBatch``; ``require_sharding`` refuses several unsharded
processes, ``gather_rows`` collects every rank's completions for the table rank 0 logs,
``longstraw_core.checkpoint`` gathers and restores the sharded state, and ``exit_ranks`` ends
a finished rank without gloo's fragile interpreter teardown.

Communication: every pass gathers every layer once, so a prefill of ``n`` chunks (or a
rollout of ``n`` tokens) gathers the model ``n`` times: a larger ``chunk_size`` trades
activation memory for less traffic, and ``reshard_after_forward=False`` keeps the layers
gathered (no traffic after the first pass, the memory of the whole model). Every backward (one
per branch, one per recomputed chunk) reduce-scatters the gradients it produced, so only
sharded gradients are ever kept; accumulating unsharded gradients instead
(``set_requires_gradient_sync(False)``) would hold the whole model's gradient on every rank.

Two rules the library keeps and user code must keep too. A no-grad pass leaves the root's and
the last layer's parameters gathered (FSDP frees them after the next backward): before an
optimizer step that follows one, call ``adapter.release_parameters()`` or those copies are
stale (``grpo_step`` does it when it runs no backward). And ``requires_grad`` is read from the
sharded parameters: change it only with every parameter released (``lora_reference`` does).
"""

from __future__ import annotations

import math
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from longstraw_core.config.schema import ConfigError
from longstraw_core.grpo_config import GRPOConfig
from longstraw_core.losses import normaliser_share

if TYPE_CHECKING:
    from accelerate.utils import InitProcessGroupKwargs

    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.kinds.base import Produced

FORWARD_METHOD = "longstraw_forward"
MIXED_PRECISION = ("auto", "bf16", "fp32")
# FSDP warns about every view among a forward's outputs (an in-place op on one would skip its
# hook); a recomputed chunk's writes are views, and nothing writes into them.
_VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module .* returned a view tensor"

Group = TypeVar("Group")
Row = TypeVar("Row")


# --- sharding -------------------------------------------------------------------------------------


def shard_model(
    adapter: ModelAdapter,
    *,
    mixed_precision: str = "auto",
    reshard_after_forward: bool = True,
    mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
) -> ModelAdapter:
    """Shard ``adapter``'s model with FSDP2 in place: each decoder layer, then the root.

    Args:
        adapter: from ``ls.adapt(model)``, the model already on its device (plain or PEFT);
            build the optimizer afterwards (its parameters become sharded ``DTensor`` s).
        mixed_precision: ``"bf16"``: layers compute in bfloat16 (parameters gathered in it,
            the prefix state kept in it) while gradients are reduced in float32 and the
            sharded parameters keep their dtype; ``"fp32"``: everything in the parameters'
            dtype; ``"auto"``: ``"bf16"`` on CUDA, ``"fp32"`` elsewhere.
        reshard_after_forward: free each layer's gathered parameters after its forward
            (``False``: keep them, which saves the gathers of later passes for the memory of
            the whole model). The last layer always keeps them, as in torchtitan: it is the
            first to run backward, which would gather it again at once; in prefill and
            decoding it stays gathered from one pass to the next.
        mesh: a 1-D device mesh to shard over (default: every rank of the default group).
            On pipeline stages (``stage_model`` first): the mesh's ``replica`` dimension, so
            each stage's layers are sharded over the ranks holding that stage.
        device: where the model computes (default: where its parameters are). A model
            sharded on the ``meta`` device and materialised afterwards
            (``longstraw_core.loading``) passes the device it will live on.

    Requires an initialised default process group (``torchrun``). Returns ``adapter``, whose
    ``parallel`` now routes its passes through FSDP and keeps the ranks in step.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs a process group: run under torchrun and call "
            "torch.distributed.init_process_group first"
        )
    if adapter.parallel is not None or isinstance(adapter.causal_lm, FSDPModule):
        raise ValueError(
            "this adapter's model is already sharded; use the adapter shard_model returned"
        )
    device = device or adapter.device
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise ValueError(f"shard_model shards over a 1-D mesh, got {mesh.ndim} dimensions")
    policy = mixed_precision_policy(mixed_precision, device)
    # On a pipeline stage: its own layers (the others are parameterless stand-ins).
    layers = [adapter.decoder.layers[index] for index in adapter.owned_layers()]
    nested: dict[nn.Module, list[nn.Module]] = {}
    resharded: set[nn.Module] = set()
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        reshard = reshard_after_forward and not last
        nested[layer] = _shard_other_dtypes(layer, mesh, policy, reshard)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        _add_forward_method(layer)
        if reshard:
            resharded.add(layer)
    root = adapter.causal_lm
    # The root keeps its parameters gathered after forward (FSDP's default for the root):
    # the next pass or the backward needs them at once.
    fully_shard(root, mesh=mesh, mp_policy=policy)
    _add_forward_method(root)
    adapter.parallel = FSDPRun(
        root, nested, resharded, mesh.get_group(), device, policy.param_dtype
    )
    return adapter


def _shard_other_dtypes(
    layer: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool
) -> list[nn.Module]:
    """Shard, each on its own, the modules of ``layer`` whose parameters keep another dtype
    than the layer's (GLM-5.x's MoE router stays float32 in a bfloat16 model); FSDP2 gathers a
    group of one dtype only. They keep their dtype (no mixed-precision cast: the router runs
    in float32 as transformers runs it). ``FSDPRun.run_layer`` gathers them with the layer,
    whether or not the layer's work calls them (a prefill's last layer only writes its state;
    an idle pass computes nothing), so that every rank makes the same gathers. Returns them."""
    dtypes = [p.dtype for p in layer.parameters()]
    if len(set(dtypes)) <= 1:
        return []
    common = max(set(dtypes), key=dtypes.count)
    odd = [
        module
        for module in layer.modules()
        if any(p.dtype != common for p in module.parameters(recurse=False))
    ]
    keep = MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype)
    for module in odd:
        if any(p.dtype == common for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{type(module).__name__} holds parameters of two dtypes; FSDP2 shards one "
                "dtype per group: give them one dtype (model.dtype) or run without FSDP"
            )
        fully_shard(module, mesh=mesh, mp_policy=keep, reshard_after_forward=reshard)
    return odd


def mixed_precision_policy(mixed_precision: str, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP's policy for ``"bf16"`` / ``"fp32"`` / ``"auto"`` (see ``shard_model``)."""
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}"
        )
    if mixed_precision == "auto":
        mixed_precision = "bf16" if device.type == "cuda" else "fp32"
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _run(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """The method FSDP wraps with the module's forward hooks: it only calls ``fn``."""
    return fn(*args)


def _add_forward_method(module: nn.Module) -> None:
    setattr(module, FORWARD_METHOD, types.MethodType(_run, module))
    register_fsdp_forward_method(module, FORWARD_METHOD)


class FSDPRun:
    """``ModelAdapter.parallel`` of a model sharded by ``shard_model``."""

    def __init__(
        self,
        root: FSDPModule,
        layers: dict[nn.Module, list[nn.Module]],
        resharded: set[nn.Module],
        group: dist.ProcessGroup,
        device: torch.device,
        param_dtype: torch.dtype | None,
    ) -> None:
        """``layers``: each sharded decoder layer, with the modules inside it sharded on
        their own (``_shard_other_dtypes``); ``resharded``: the layers freed after forward."""
        self.root, self.layers, self.resharded, self.group = root, layers, resharded, group
        self.device, self.param_dtype = device, param_dtype
        self._in_model = False

    def run_model(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` as the root's forward (once: a pass inside a pass stays in the outer)."""
        if self._in_model:
            return fn()
        self._in_model = True
        try:
            with warnings.catch_warnings():  # a pass's outputs are never written in place
                warnings.filterwarnings("ignore", message=_VIEW_OUTPUT_WARNING)
                return getattr(self.root, FORWARD_METHOD)(fn)
        finally:
            self._in_model = False

    def run_layer(
        self,
        layer: nn.Module,
        fn: Callable[[torch.Tensor], Any],
        hidden: torch.Tensor,
        produced: Produced | None,
    ) -> Any:
        """``fn(hidden)`` as ``layer``'s forward.

        During exact mode's recompute, the tensors the chunk writes (``produced``) receive
        their gradient directly, not only through the layer's output, so they are returned
        to FSDP too: it hooks them, and gathers the layer before their backward.
        """
        forward = getattr(layer, FORWARD_METHOD)
        if self.layers.get(layer):
            fn = self._with_inner(layer, fn)
        if produced is None:
            return forward(fn, hidden)
        first = len(produced)

        def with_writes(hidden: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
            output = fn(hidden)
            return output, [tensor for tensor, _ in produced[first:]]

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_VIEW_OUTPUT_WARNING)
            output, _ = forward(with_writes, hidden)
        return output

    def _with_inner(self, layer: nn.Module, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` with the modules sharded on their own inside ``layer`` gathered before it and
        freed after it as the layer is (their backward gathers them again when they ran)."""
        inner = self.layers[layer]

        def work(hidden: Any) -> Any:
            for module in inner:
                module.unshard()
            output = fn(hidden)
            if layer in self.resharded:
                for module in inner:
                    module.reshard()
            return output

        return work

    @contextmanager
    def kept_gathered(self) -> Iterator[None]:
        """Gather each layer's parameters at its first pass and keep them until the block
        ends (then free them): a rollout's decode steps then gather the model once, not once
        per token. The memory of the unsharded model (on stages: of the stage's layers)."""
        modules = [module for layer, inner in self.layers.items() for module in (*inner, layer)]
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for layer, inner in self.layers.items():
                for module in (*inner, layer):
                    module.set_reshard_after_forward(layer in self.resharded, recurse=False)
            self.reshard()

    def most(self, count: int) -> int:
        value = torch.tensor([count], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value.item())

    def everywhere(self, flag: bool) -> bool:
        return self.everywhere_each(flag)[0]

    def everywhere_each(self, *flags: bool) -> tuple[bool, ...]:
        value = torch.tensor([int(flag) for flag in flags], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(bool(v) for v in value.tolist())

    def reshard(self) -> None:
        for layer, inner in self.layers.items():
            for module in (*inner, layer):
                module.reshard()
        self.root.reshard()


# --- runs of several processes -------------------------------------------------------------------


def require_sharding(world_size: int, fsdp: bool, pipeline_stages: int = 1) -> None:
    """Refuse a run of several processes that would not share the model.

    Unsharded and unstaged, each process would train its own copy of the model on its own
    groups and nothing would average their gradients: ``world_size`` diverging runs that look
    like one. Pipeline stages share it (each owns its layers; replicas average gradients).
    """
    if world_size > 1 and not fsdp and pipeline_stages == 1:
        raise ConfigError(
            "distributed.fsdp",
            f"{world_size} processes run this recipe but the model is neither sharded nor "
            "staged, so each would train its own copy with nothing averaging their gradients; "
            "set distributed.fsdp=true or distributed.pipeline_stages, or run a single process",
        )


def max_over_ranks(value: int, *, group: dist.ProcessGroup | None = None) -> int:
    """The largest of every rank's ``value`` (a collective when distributed): how ranks agree
    on a decision one of them made alone (a signal received, a step to skip)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def process_group_kwargs(timeout_minutes: float) -> InitProcessGroupKwargs:
    """What the recipes hand accelerate for ``init_process_group``: the run's
    ``distributed.timeout_minutes``. NCCL's default (10 minutes) is shorter than rank 0
    writing a large checkpoint while the others wait (``checkpoint.ranks``)."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))


def world_timeout() -> timedelta | None:
    """The default process group's timeout (None without one, or when it can't be read)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def any_rank(flag: bool, *, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` holds on at least one rank (a collective when distributed)."""
    return max_over_ranks(int(flag), group=group) > 0


def gather_rows(rows: Sequence[Row]) -> list[Row]:
    """Every rank's ``rows`` (picklable) on every rank, in rank order: e.g. a completions
    table of every rank's group rather than rank 0's alone. Collective: every rank calls it.
    Without a process group: the rows as they are."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(rows)
    gathered: list[list[Row] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(rows))
    return [row for part in gathered if part for row in part]


def exit_ranks() -> None:
    """End a rank of a finished distributed run at once, with status 0.

    Call it last, once the process group is destroyed and everything is written. It skips
    the interpreter's teardown: gloo's worker threads may still free finished work (which
    needs the GIL) while Python finalises, and that aborts the process now and then (torch
    2.13), turning a finished run into a failed one.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- groups and their share of the loss -----------------------------------------------------------


def spread_groups(groups: Sequence[Group], rank: int, world_size: int) -> list[Group]:
    """This rank's share of a step's groups: every ``world_size``-th, from ``rank``.

    Every rank must run the same number of groups (their collectives pair up), so the
    number of groups must be a multiple of ``world_size``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if len(groups) % world_size:
        raise ValueError(
            f"{len(groups)} groups cannot be spread evenly over {world_size} ranks: every rank "
            "runs the same number of groups; use a multiple of the world size"
        )
    return list(groups[rank::world_size])


def group_loss_scales(
    completion_lengths: Sequence[Sequence[int]],
    config: GRPOConfig,
    truncated: Sequence[Sequence[bool] | None] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """``loss_scale`` for ``grpo_step`` of each of this rank's groups in one optimizer step.

    ``completion_lengths[k]`` (and ``truncated[k]``) describe this rank's group ``k``. The
    step's loss is TRL's over all the step's responses (module docstring): each group's loss
    weighted by its share of the step's normaliser (``losses.normaliser_share``: active tokens
    for ``bnpo``/``dapo``/``cispo``/``vespo``, responses for ``grpo``/``sapo``/``dr_grpo``/
    ``luspo``), shares summed over every rank. FSDP averages the ranks' gradients, so each
    share is multiplied by the world size. Collective when a process group is initialised:
    every rank calls it, with its own groups. (``generation.GenerationBatch`` does the same
    for groups that arrive one at a time.)
    """
    if truncated is None:
        truncated = [None] * len(completion_lengths)
    if len(truncated) != len(completion_lengths):
        raise ValueError(
            f"truncated has {len(truncated)} entries for {len(completion_lengths)} groups"
        )
    counts = [
        normaliser_share(lengths, flags, config)
        for lengths, flags in zip(completion_lengths, truncated, strict=True)
    ]
    total, world_size = sum_over_ranks(float(sum(counts)), group=group)
    return [world_size * count / max(total, 1.0) for count in counts]


def sum_over_ranks(
    value: float | Sequence[float], *, group: dist.ProcessGroup | None = None
) -> tuple[Any, int]:
    """``value`` (a number or a list of them) summed over the ranks in float64, and the
    number of ranks. Collective when a process group is initialised; else ``(value, 1)``."""
    if not (dist.is_available() and dist.is_initialized()):
        return value, 1
    values = torch.tensor(value, dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(values, group=group)
    return values.tolist(), dist.get_world_size(group)


def step_reward_std(
    rewards: Sequence[Sequence[float] | torch.Tensor], *, group: dist.ProcessGroup | None = None
) -> float:
    """TRL's ``scale_rewards="batch"`` std: Bessel-corrected, over every reward of the
    optimizer step, this rank's groups ``rewards[k]`` and every other rank's, NaN rewards
    (unscorable rows) left out as TRL's ``nanstd`` does. Two passes (the mean, then the squared
    deviations from it), each one collective of two float64 numbers. NaN with fewer than two
    rewards, as TRL. Collective: every rank calls it, with its own groups.
    """
    values = torch.cat([torch.as_tensor(r, dtype=torch.float64).flatten() for r in rewards])
    values = values[~torch.isnan(values)]
    (count, total), _ = sum_over_ranks([float(values.numel()), float(values.sum())], group=group)
    mean = total / count if count else math.nan
    (squares,), _ = sum_over_ranks([float(((values - mean) ** 2).sum())], group=group)
    if count < 2:
        return math.nan
    return math.sqrt(squares / count * (count / (count - 1)))


# --- metrics --------------------------------------------------------------------------------------


def reduce_metrics(
    metrics: Mapping[str, Any],
    op: Literal["mean", "sum", "max", "min"] = "mean",
    *,
    group: dist.ProcessGroup | None = None,
    ops: Mapping[str, Literal["mean", "sum", "max", "min"]] | None = None,
) -> dict[str, float]:
    """Scalar metrics combined over the ranks: ``op`` over the ranks that report each key
    (``ops``: another op for some keys, e.g. ``min`` for a minimum).

    Non-scalar values (lists) are dropped. NaN values are left out (a rank that replayed no
    branch has no entropy); a key with none left is NaN. Ranks may report different keys
    (``grpo_step`` omits clip ratios when nothing was replayed). Collective: every rank calls
    it. Without a process group the scalars are returned as they are.
    """
    scalars = {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    if not (dist.is_available() and dist.is_initialized()):
        return scalars
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, scalars, group=group)
    keys = [key for part in gathered if part for key in part]
    combined = {}
    for key in dict.fromkeys(keys):  # first-seen order
        values = [part[key] for part in gathered if part and key in part]
        values = [value for value in values if not math.isnan(value)]
        combined[key] = _combine(values, (ops or {}).get(key, op)) if values else math.nan
    return combined


def _combine(values: list[float], op: str) -> float:
    if op == "mean":
        return sum(values) / len(values)
    if op == "sum":
        return sum(values)
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    raise ValueError(f"op must be 'mean', 'sum', 'max' or 'min', got {op!r}")


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective lives: the current GPU under NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
