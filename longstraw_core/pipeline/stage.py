"""A rank's pipeline stage: what an adapter on one knows of its place, and the stand-ins for
the modules it does not hold.

``longstraw_core.adapters.stage_cut.stage_model`` cuts an adapter down to one stage and sets a
``Stage`` on it; the passes on the stage (``longstraw_core.adapters.staged_forward`` and ``staged_backward``) read it. The
model keeps a ``StagedModel`` (``staged_model(model)``): the whole model's names and shapes,
which checkpoints of the stage check and index by. This module knows nothing of adapters: the
adapter's staged passes import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longstraw_core.pipeline.layout import StageLayout
from longstraw_core.pipeline.transport import StageLink


@dataclass(frozen=True)
class Stage:
    """What an adapter on a pipeline stage knows of its place: the layout, its link to the
    other stages, and the facts the modules it no longer holds would have told."""

    layout: StageLayout
    link: StageLink
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    replay_pieces: int | None = None  # pieces per replayed branch (None: ``pieces_for``)

    def pieces_for(self, branches: int) -> int:
        """How many pieces replay cuts each of ``branches`` branches into: the configured
        number, else the fewest that keep the schedule's idle share at 15%
        (``simulate.replay_pieces``)."""
        if self.replay_pieces is not None:
            return self.replay_pieces
        from longstraw_core.pipeline.simulate import replay_pieces

        return replay_pieces(self.link.stages, branches)

    @property
    def index(self) -> int:
        return self.link.stage

    @property
    def layers(self) -> range:
        return self.layout.layers_of(self.index)

    @property
    def is_first(self) -> bool:
        return self.link.is_first

    @property
    def is_last(self) -> bool:
        return self.link.is_last


# The attribute ``stage_model`` leaves on the model it cuts down (``staged_model`` reads it).
STAGED_ATTRIBUTE = "_longstraw_staged"


@dataclass(frozen=True)
class StagedModel:
    """What a checkpoint of a staged model needs to know of the whole model it was cut from:
    the stage, every state-dict entry's shape, and the trainable parameters' names in the
    whole model's order (an optimizer state's parameter indices count in that order)."""

    stage: Stage
    shapes: dict[str, tuple[int, ...]]
    trainable: tuple[str, ...]


def staged_model(model: nn.Module) -> StagedModel | None:
    """The ``StagedModel`` of a model ``stage_model`` cut down (``None``: a whole model)."""
    return getattr(model, STAGED_ATTRIBUTE, None)


class OnAnotherStage(nn.Module):
    """Stands in for a module another pipeline stage owns: no parameters, never called."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.owner_name, self.owner_stage = name, stage

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self.owner_name} lives on pipeline stage {self.owner_stage}; this rank "
            "does not hold it"
        )

    def extra_repr(self) -> str:
        return f"{self.owner_name!r} on stage {self.owner_stage}"
