"""Cut an adapter's model down to one pipeline stage (``stage_model``), or move a stage.

``stage_model(adapter, layout, link)`` turns an adapter into one stage of a pipeline: the
decoder layers of other stages are replaced by parameterless stand-ins
(``OnAnotherStage``), the embeddings are kept only by the first stage and the final norm
and LM head only by the last, so the rank holds its own block's weights (and, from then
on, gradients and optimizer state). Parameter names are unchanged (``model.layers.12...``),
so a stage's ``state_dict`` is its share of the whole model's, under the whole model's names:
checkpoints written by any number of stages load into any other.

Every pass of the adapter then runs on its own layers and prefix state and talks to the
neighbouring stages (``longstraw_core.adapters.staged_forward`` and ``staged_backward``). Build the optimizer after staging.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from longstraw_core.pipeline.layout import StageLayout, StageLayoutError
from longstraw_core.pipeline.stage import (
    STAGED_ATTRIBUTE,
    OnAnotherStage,
    Stage,
    StagedModel,
    staged_model,
)
from longstraw_core.pipeline.transport import StageLink

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter


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
    setattr(adapter.model, STAGED_ATTRIBUTE, record)
    return adapter


def move_stage(adapter: ModelAdapter, device: torch.device) -> None:
    """Record that ``adapter``'s stage now lives on ``device``: a model cut to its stage on
    the ``meta`` device (``longstraw_core.models.sharded_loading``) and materialised there afterwards."""
    stage = dataclasses.replace(adapter.stage, device=device)
    stage.link.device = device
    adapter.stage = stage
    record = staged_model(adapter.model)
    setattr(adapter.model, STAGED_ATTRIBUTE, dataclasses.replace(record, stage=stage))


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
