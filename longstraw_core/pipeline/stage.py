"""A rank's pipeline stage: the layers it owns, its neighbours, and a model cut down to it.

``stage_model(adapter, layout, link)`` turns an adapter into one stage of a pipeline: the
decoder layers of other stages are replaced by parameterless stand-ins
(``OnAnotherStage``), the embeddings are kept only by the first stage and the final norm
and LM head only by the last, so the rank holds its own block's weights (and, from then
on, gradients and optimizer state). Parameter names are unchanged (``model.layers.12...``),
so a stage's ``state_dict`` is its share of the whole model's, under the whole model's names:
checkpoints written by any number of stages load into any other.

Every pass of the adapter then runs on its own layers and prefix state and talks to the
neighbouring stages (``model_adapters.staged``). Build the optimizer after staging. The
model keeps a ``StagedModel`` (``staged_model(model)``): the whole model's names and shapes,
which checkpoints of the stage check and index by.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from longstraw_core.pipeline.layout import StageLayout, StageLayoutError
from longstraw_core.pipeline.transport import StageLink

if TYPE_CHECKING:
    from model_adapters.base import ModelAdapter


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
_STAGED = "_longstraw_staged"


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
    return getattr(model, _STAGED, None)


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


def stage_model(
    adapter: ModelAdapter,
    layout: StageLayout,
    link: StageLink,
    replay_pieces: int | None = None,
) -> ModelAdapter:
    """Cut ``adapter``'s model down to stage ``link.stage`` of ``layout``, in place.

    Refused: a layout for another number of layers, a link for another number of stages,
    a model sharded already (stage first, then shard the stage over the replicas), tied input and output embeddings (the first and last stages
    would each need the one matrix and its summed gradient). Returns ``adapter``.
    """
    layers = adapter.decoder.layers
    if layout.num_layers != len(layers):
        raise StageLayoutError(
            f"the stage layout covers {layout.num_layers} layers, the model has {len(layers)}"
        )
    if layout.stages != link.stages:
        raise StageLayoutError(
            f"the layout has {layout.stages} stages, the pipeline {link.stages} ranks"
        )
    if adapter.parallel is not None:
        raise ValueError(
            "this model is sharded already: put it on its stage first, then shard the "
            "stage's layers over the replicas (shard_model(adapter, mesh=mesh['replica']))"
        )
    if layout.stages > 1 and _ties_embeddings(adapter):
        raise ValueError(
            "this model ties its input and output embeddings (tie_word_embeddings=True): the "
            "first and last pipeline stages would share one matrix; set "
            "distributed.pipeline_stages=1, or untie them in the model config"
        )
    stage = Stage(
        layout=layout,
        link=link,
        device=adapter.device,
        dtype=adapter.dtype,
        vocab_size=adapter.vocab_size,
        replay_pieces=replay_pieces,
    )
    record = StagedModel(
        stage=stage,
        shapes={name: tuple(value.shape) for name, value in adapter.model.state_dict().items()},
        trainable=tuple(n for n, p in adapter.model.named_parameters() if p.requires_grad),
    )
    owned = stage.layers
    for index in range(len(layers)):
        if index not in owned:
            layers[index] = OnAnotherStage(f"decoder layer {index}", layout.stage_of(index))
    if not stage.is_first:
        adapter.embed_tokens = _replace(adapter, adapter.embed_tokens, "embeddings", 0)
    if not stage.is_last:
        last = layout.stages - 1
        adapter.lm_head = _replace(adapter, adapter.lm_head, "the LM head", last)
        norm = _replace(adapter, adapter.decoder.norm, "the final norm", last)
        assert norm is adapter.decoder.norm
    adapter.stage = stage
    setattr(adapter.model, _STAGED, record)
    return adapter


def move_stage(adapter: ModelAdapter, device: torch.device) -> None:
    """Record that ``adapter``'s stage now lives on ``device``: a model cut to its stage on
    the ``meta`` device (``longstraw_core.loading``) and materialised there afterwards."""
    stage = dataclasses.replace(adapter.stage, device=device)
    stage.link.device = device
    adapter.stage = stage
    record = staged_model(adapter.model)
    setattr(adapter.model, _STAGED, dataclasses.replace(record, stage=stage))


def _ties_embeddings(adapter: ModelAdapter) -> bool:
    return adapter.embed_tokens.weight is getattr(adapter.lm_head, "weight", None)


def _replace(adapter: ModelAdapter, module: nn.Module, name: str, stage: int) -> nn.Module:
    """Put an ``OnAnotherStage`` where ``module`` sits in the model; return the stand-in."""
    stand_in = OnAnotherStage(name, stage)
    for qualified, candidate in adapter.model.named_modules():
        if candidate is module and qualified:
            parent_name, _, attribute = qualified.rpartition(".")
            setattr(adapter.model.get_submodule(parent_name), attribute, stand_in)
    return stand_in
