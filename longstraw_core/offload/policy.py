"""``OffloadPolicy``: where each layer type keeps its prefix state (on the device or in CPU
memory) and how many offloaded layers may be on the device at once; ``home_options`` turns
it into where a new record is allocated. Plain configuration: no tensors move here.

Each layer kind names the field that places it (``kinds.registry.LayerKind.offload``); the
placement fields are the dataclass's fields marked ``placement`` (``PLACEMENT_FIELDS``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from longstraw_core.kinds import registry

PLACEMENTS = ("device", "cpu")


def _placement() -> Any:
    """A placement field: ``"device"`` (the default) or ``"cpu"``."""
    return field(default="device", metadata={"placement": True})


@dataclass(frozen=True)
class OffloadPolicy:
    """Where each layer type keeps its prefix state, and how much of it may be on the device.

    ``attention`` (full-attention K/V), ``recurrent`` (Gated DeltaNet conv and recurrent
    states, and their chunk-start checkpoints) and ``latent`` (MLA latent and DSA indexer keys)
    are each ``"device"`` (kept on the compute device) or ``"cpu"`` (kept in CPU memory and
    streamed in layer by layer). ``resident_layers``: the most offloaded layers on the device at
    once during a pass (1: no overlap of copy and compute; 2: the next layer is copied while the
    current one computes). ``pin_memory``: pin the CPU copies when the model runs on CUDA
    (asynchronous copies need it).
    """

    attention: str = _placement()
    recurrent: str = _placement()
    latent: str = _placement()
    resident_layers: int = 2
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for name in PLACEMENT_FIELDS:
            value = getattr(self, name)
            if value not in PLACEMENTS:
                raise ValueError(f"offload {name}={value!r}: a placement is 'device' or 'cpu'")
        count = self.resident_layers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"offload resident_layers={count!r}: at least one layer must fit on the device"
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload pin_memory={self.pin_memory!r}: must be True or False")

    @classmethod
    def cpu(cls, resident_layers: int = 2, pin_memory: bool = True) -> OffloadPolicy:
        """Every layer type in CPU memory."""
        placed = dict.fromkeys(PLACEMENT_FIELDS, "cpu")
        return cls(**placed, resident_layers=resident_layers, pin_memory=pin_memory)

    @classmethod
    def parse(cls, value: OffloadPolicy | str | Mapping[str, Any] | None) -> OffloadPolicy | None:
        """A policy from config: ``None``, a policy, ``"device"``/``"cpu"`` for every layer
        type, or a mapping of the dataclass's fields (``{"attention": "cpu", ...}``)."""
        if value is None or isinstance(value, OffloadPolicy):
            return value
        if isinstance(value, str):
            if value not in PLACEMENTS:
                raise ValueError(f"offload={value!r}: a placement is 'device' or 'cpu'")
            return cls(**dict.fromkeys(PLACEMENT_FIELDS, value))
        if isinstance(value, Mapping):
            known = {field.name for field in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"offload has unknown keys {unknown}; known: {sorted(known)} "
                    f"(layer types: {list(PLACEMENT_FIELDS)})"
                )
            return cls(**value)
        raise ValueError(
            f"offload must be None, 'device', 'cpu', a mapping or an OffloadPolicy, got {value!r}"
        )

    def placement(self, kind: str) -> str:
        """``"device"`` or ``"cpu"`` for a layer type (``"attention"``, ...) or record kind."""
        if kind in PLACEMENT_FIELDS:
            return getattr(self, kind)
        try:
            name = registry.kind(kind).offload
        except KeyError:
            name = None
        if name not in PLACEMENT_FIELDS:
            raise ValueError(
                f"unknown layer type {kind!r}; layer types: {list(PLACEMENT_FIELDS)}, record "
                f"kinds: {list(registry.offload_fields())}"
            )
        return getattr(self, name)

    def offloads(self, kind: str) -> bool:
        return self.placement(kind) == "cpu"

    @property
    def active(self) -> bool:
        """Whether any layer type is kept in CPU memory."""
        return any(getattr(self, name) == "cpu" for name in PLACEMENT_FIELDS)

    def offloaded_fields(self) -> list[str]:
        """The placement fields set to ``"cpu"``, in field order."""
        return [name for name in PLACEMENT_FIELDS if getattr(self, name) == "cpu"]


# The fields that place a layer type ("attention", ...), in declaration order.
PLACEMENT_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(OffloadPolicy) if f.metadata.get("placement")
)


def home_options(policy: OffloadPolicy | None, kind: str, device: torch.device) -> dict[str, Any]:
    """``device`` and ``pin_memory`` for a new record of ``kind`` computed on ``device``: where
    its state lives. Pinned only for a CUDA device (asynchronous copies need it; elsewhere it
    would only take page-locked memory from the system)."""
    if policy is None or not policy.offloads(kind):
        return {"device": device, "pin_memory": False}
    pin = policy.pin_memory and torch.device(device).type == "cuda"
    return {"device": torch.device("cpu"), "pin_memory": pin}
