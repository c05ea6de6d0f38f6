"""FSDP2 over the adapter's model: ``shard_model`` shards each decoder layer, then the root,
and gives the adapter an ``FSDPRun``, which engages FSDP's hooks around each layer's work and
each pass (the package docstring tells how and why)."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.kinds.base import Produced

FORWARD_METHOD = "longstraw_forward"
MIXED_PRECISION = ("auto", "bf16", "fp32")
# FSDP warns about every view among a forward's outputs (an in-place op on one would skip its
# hook); a recomputed chunk's writes are views, and nothing writes into them.
_VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


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
            (``longstraw_core.models.sharded_loading``) passes the device it will live on.

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
    """Shard, each on its own, the modules of ``layer`` that keep their own dtype; returns them.

    The layer's dtype is the one most of its weights (by size) have. A module whose
    parameters have another dtype keeps it (its own FSDP2 unit, no mixed-precision cast):
    GLM-5.x's float32 MoE router in a bfloat16 model runs in float32 as transformers runs
    it, and FSDP2 reduces the gradients of one unit in one dtype only. Adapters are the
    exception (``_adapts``): float32 LoRA weights over a frozen bfloat16 base stay in the
    layer's unit, so the layer is one gather, and the policy gives LoRA the same compute
    dtype in every layer. ``FSDPRun.run_layer`` gathers the modules returned with the layer,
    whether or not the layer's work calls them (a prefill's last layer only writes its
    state; an idle pass computes nothing), so that every rank makes the same gathers."""
    sizes: dict[torch.dtype, int] = {}
    for parameter in layer.parameters():
        sizes[parameter.dtype] = sizes.get(parameter.dtype, 0) + parameter.numel()
    if len(sizes) <= 1:
        return []
    common = max(sizes, key=sizes.__getitem__)
    trained_base = any(p.requires_grad for p in layer.parameters() if p.dtype == common)
    odd = [
        module
        for module in layer.modules()
        if any(p.dtype != common for p in module.parameters(recurse=False))
        and (trained_base or not _adapts(module))
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


def _adapts(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` trains (a LoRA adapter's, when the layer's base
    weights are frozen): such modules share their layer's FSDP2 unit and its cast."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.requires_grad for p in own)


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
        self._kept = False  # inside ``kept_gathered``: nothing is freed after a pass

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
        freed after it as the layer is (their backward gathers them again when they ran);
        inside ``kept_gathered`` they stay gathered with the layer (``unshard`` of a
        gathered module gathers nothing)."""
        inner = self.layers[layer]

        def work(hidden: Any) -> Any:
            for module in inner:
                module.unshard()
            output = fn(hidden)
            if layer in self.resharded and not self._kept:
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
        self._kept = True
        try:
            yield
        finally:
            self._kept = False
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
