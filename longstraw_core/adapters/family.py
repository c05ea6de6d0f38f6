"""What a model family declares about itself, next to its adapter: the one place the rest of
LongStraw (config, tiny models, planner, offload) learns about a family.

Each adapter module defines one ``ModelFamily`` and sets it as its adapter's ``family``;
``longstraw_core.adapters.registry`` collects them and builds the tables other modules read
(``default_lora_targets``, ``tiny_configs``, ``presets``, ``kernel_budget``). A layer kind
declares itself, in its own module (``longstraw_core.kinds.registry``); a family names the
kinds its layers keep.
This module imports nothing of LongStraw but ``adapters.probe`` (which imports nothing):
anything may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from longstraw_core.adapters.probe import FamilyProbe


@dataclass(frozen=True)
class Preset:
    """A paper-scale model no one can download here: its transformers config, documented."""

    model_type: str
    config: dict[str, Any]
    source: str


@dataclass(frozen=True)
class ModelFamily:
    """One model family: the ``config.model_type`` values its adapter serves and what the
    rest of LongStraw asks about them.

    - ``model_types``: the transformers ``config.model_type`` values the adapter serves.
    - ``layer_kinds``: the record kinds (``LayerState.kind``) its layers keep, each a
      registered layer kind (``kinds.registry``: the kind declares where it is placed, the
      family does not repeat it: a mapping is read by its keys, which may map to nothing
      but ``None``).
    - ``lora_targets``: model type -> module names LoRA adapts when ``lora.target_modules``
      is null.
    - ``tiny_configs``: model type -> the keyword arguments of its transformers config class
      (``AutoConfig.for_model(model_type, **kwargs)``) that make the toy model every test,
      demo and benchmark builds (``longstraw_core.models.tiny``).
    - ``presets``: name -> ``Preset``, paper-scale models the memory planner knows by name.
    - ``kernel_budgets``: device type (``"cpu"``, ``"cuda"``) -> the block budgets of the
      family's own kernels as they are now (read when called: tests patch them), by name;
      the planner sizes those kernels' scratch by them (``registry.kernel_budget``).
    - ``probe``: what the cross-cutting tests and benchmarks build and run of it
      (``adapters.probe.FamilyProbe``; ``adapters.matrix.families_for`` reads it). Its
      ``model_type`` left empty: the first of ``tiny_configs``.
    """

    name: str
    model_types: tuple[str, ...]
    layer_kinds: Collection[str]
    lora_targets: Mapping[str, list[str]]
    tiny_configs: Mapping[str, dict[str, Any]]
    presets: Mapping[str, Preset] = field(default_factory=dict)
    kernel_budgets: Callable[[str], Mapping[str, int]] | None = None
    probe: FamilyProbe = field(default_factory=FamilyProbe)

    def __post_init__(self) -> None:
        if not self.probe.model_type and self.tiny_configs:
            first = next(iter(self.tiny_configs))
            object.__setattr__(self, "probe", dataclasses.replace(self.probe, model_type=first))
        if self.tiny_configs:  # a family with no toy model has nothing for the tests to build
            problems = self.probe.problems(self.tiny_configs)
            if problems:
                raise ValueError(f"family {self.name!r}: {'; '.join(problems)}")
        served = set(self.model_types)
        for table in ("lora_targets", "tiny_configs"):
            unknown = sorted(set(getattr(self, table)) - served)
            if unknown:
                raise ValueError(
                    f"family {self.name!r}: {table} for model types {unknown} "
                    f"it does not serve {self.model_types}"
                )
        for preset_name, preset in self.presets.items():
            if preset.model_type not in served:
                raise ValueError(
                    f"family {self.name!r}: preset {preset_name!r} has model type "
                    f"{preset.model_type!r}, not one of {self.model_types}"
                )
        if isinstance(self.layer_kinds, str):
            raise ValueError(
                f"family {self.name!r}: layer_kinds is a collection of record kinds, got "
                f"{self.layer_kinds!r}"
            )
        if isinstance(self.layer_kinds, Mapping):
            placed = sorted(k for k, v in self.layer_kinds.items() if v is not None)
            if placed:
                raise ValueError(
                    f"family {self.name!r}: layer kinds {placed} given a placement; each kind "
                    "declares its own placement where it registers (kinds.registry): list "
                    "the kinds only"
                )
