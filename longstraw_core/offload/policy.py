"""``OffloadPolicy``: where each layer type keeps its prefix state (on the device or in CPU
memory) and how many offloaded layers may be on the device at once; ``home_options`` turns
it into where a new record is allocated. Plain configuration: no tensors move here.

The placements (``"attention"``, ``"recurrent"``, ``"latent"``, ...) are not named here: each
layer kind declares the one that places it when it registers (``kinds.registry.LayerKind
.offload``), and the policy has one placement per name the registered kinds declare
(``placement_fields``, ``kinds.registry.placements``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longstraw_core.kinds import registry

PLACEMENTS = ("device", "cpu")
_OPTIONS = ("resident_layers", "pin_memory")


def placement_fields() -> tuple[str, ...]:
    """The placement names, in the registry's order (``kinds.registry.placements``)."""
    return registry.placements()


class OffloadPolicy:
    """Where each layer type keeps its prefix state, and how much of it may be on the device.

    One placement per name the layer kinds declare (``placement_fields``): ``attention``
    (full-attention K/V, and a sliding window's), ``recurrent`` (Gated DeltaNet conv and
    recurrent states, and their chunk-start checkpoints), ``latent`` (MLA latent and DSA index
    keys); each ``"device"`` (the default: kept on the compute device) or ``"cpu"`` (kept in
    CPU memory and streamed in layer by layer), given by keyword and read as an attribute
    (``policy.attention``). ``resident_layers``: the most offloaded layers on the device at
    once during a pass (1: no overlap of copy and compute; 2: the next layer is copied while
    the current one computes). ``pin_memory``: pin the CPU copies when the model runs on CUDA
    (asynchronous copies need it). Immutable, compared and hashed by value.
    """

    __slots__ = ("pin_memory", "placements", "resident_layers")

    def __init__(self, resident_layers: int = 2, pin_memory: bool = True, **placed: str):
        fields = placement_fields()
        unknown = sorted(set(placed) - set(fields))
        if unknown:
            raise ValueError(
                f"offload has unknown keys {unknown}; known: {sorted((*fields, *_OPTIONS))} "
                f"(layer types: {list(fields)})"
            )
        placements = {name: placed.get(name, "device") for name in fields}
        for name, value in placements.items():
            if value not in PLACEMENTS:
                raise ValueError(f"offload {name}={value!r}: a placement is 'device' or 'cpu'")
        count = resident_layers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"offload resident_layers={count!r}: at least one layer must fit on the device"
            )
        if not isinstance(pin_memory, bool):
            raise ValueError(f"offload pin_memory={pin_memory!r}: must be True or False")
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "resident_layers", resident_layers)
        object.__setattr__(self, "pin_memory", pin_memory)

    def __getattr__(self, name: str) -> str:
        if not name.startswith("_"):
            try:
                return object.__getattribute__(self, "placements")[name]
            except (AttributeError, KeyError):
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"OffloadPolicy is immutable (setting {name!r})")

    def as_dict(self) -> dict[str, Any]:
        """The keyword arguments that build this policy again (the config's keys)."""
        return {**self.placements, "resident_layers": self.resident_layers,
                "pin_memory": self.pin_memory}  # fmt: skip

    def replace(self, **changes: Any) -> OffloadPolicy:
        """This policy with ``changes`` (placements or options) made."""
        return OffloadPolicy(**{**self.as_dict(), **changes})

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.as_dict(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OffloadPolicy) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"OffloadPolicy({fields})"

    @classmethod
    def cpu(cls, resident_layers: int = 2, pin_memory: bool = True) -> OffloadPolicy:
        """Every layer type in CPU memory."""
        placed = dict.fromkeys(placement_fields(), "cpu")
        return cls(**placed, resident_layers=resident_layers, pin_memory=pin_memory)

    @classmethod
    def parse(cls, value: OffloadPolicy | str | Mapping[str, Any] | None) -> OffloadPolicy | None:
        """A policy from config: ``None``, a policy, ``"device"``/``"cpu"`` for every layer
        type, or a mapping of its keyword arguments (``{"attention": "cpu", ...}``)."""
        if value is None or isinstance(value, OffloadPolicy):
            return value
        if isinstance(value, str):
            if value not in PLACEMENTS:
                raise ValueError(f"offload={value!r}: a placement is 'device' or 'cpu'")
            return cls(**dict.fromkeys(placement_fields(), value))
        if isinstance(value, Mapping):
            return cls(**value)
        raise ValueError(
            f"offload must be None, 'device', 'cpu', a mapping or an OffloadPolicy, got {value!r}"
        )

    def placement(self, kind: str) -> str:
        """``"device"`` or ``"cpu"`` for a layer type (``"attention"``, ...) or record kind."""
        if kind in self.placements:
            return self.placements[kind]
        try:
            name = registry.kind(kind).offload
        except KeyError:
            name = None
        if name not in self.placements:
            raise ValueError(
                f"unknown layer type {kind!r}; layer types: {list(self.placements)}, record "
                f"kinds: {list(registry.offload_fields())}"
            )
        return self.placements[name]

    def offloads(self, kind: str) -> bool:
        return self.placement(kind) == "cpu"

    @property
    def active(self) -> bool:
        """Whether any layer type is kept in CPU memory."""
        return "cpu" in self.placements.values()

    def offloaded_fields(self) -> list[str]:
        """The placements set to ``"cpu"``, in the registry's order."""
        return [name for name, value in self.placements.items() if value == "cpu"]


def _rebuild(options: dict[str, Any]) -> OffloadPolicy:
    return OffloadPolicy(**options)


def home_options(policy: OffloadPolicy | None, kind: str, device: torch.device) -> dict[str, Any]:
    """``device`` and ``pin_memory`` for a new record of ``kind`` computed on ``device``: where
    its state lives. Pinned only for a CUDA device (asynchronous copies need it; elsewhere it
    would only take page-locked memory from the system)."""
    if policy is None or not policy.offloads(kind):
        return {"device": device, "pin_memory": False}
    pin = policy.pin_memory and torch.device(device).type == "cuda"
    return {"device": torch.device("cpu"), "pin_memory": pin}
