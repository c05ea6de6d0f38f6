"""Which layers each pipeline stage owns, and a stage's slice of the model.

Why here: the runtime calls ``stage_layout`` to pick a run's stage boundaries (a config's
``distributed.stage_starts`` overrides it), and the planner's per-stage memory and time use
the same layout, so the plan describes the stages that run.

A stage owns a contiguous block of decoder layers, their weights and their prefix state;
embeddings go with the first stage, the final norm and the LM head with the last
(``longstraw_core.pipeline.layout``). Each layer's cost is a vector (state bytes per stored
position, parameters, context-free FLOPs per token, FLOPs per query-key pair), every
dimension normalised by its total. ``balanced_boundaries`` finds the smallest largest stage
load; among the splits that reach it, ``stage_layout`` takes the one with the smallest sum of
squared loads, so stages below the largest are even too (the largest alone leaves GLM-5.2 on
32 stages with 23 stages of three layers and 9 of one). The quadratic part of the compute and
the growing state sit on the full-attention layers (Qwen3.6: one in four), so those spread
evenly over the stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from longstraw_core.pipeline.layout import (
    StageLayout,
    StageLayoutError,
    balanced_boundaries,
    check_stage_count,
    contiguous_partition,
    normalised_loads,
)
from longstraw_core.plan.activations import Activations
from longstraw_core.plan.flops import pair_flops, token_flops
from longstraw_core.plan.model import PHASES, ModelSpec, Workload
from longstraw_core.plan.pieces import PieceMemory, piece_memory


def layer_costs(spec: ModelSpec, gradient: str = "detached") -> list[tuple[float, ...]]:
    """Each layer's cost vector: (state bytes per stored position, with exact mode's dS;
    parameters; forward FLOPs per token that do not grow with the context; forward FLOPs
    per query-key pair, which do)."""
    exact = gradient == "exact"
    return [
        (
            float(layer.state_per_token + (layer.grad_per_token if exact else 0)),
            float(layer.params),
            token_flops(spec, layer),
            pair_flops(layer),
        )
        for layer in spec.layers
    ]


def stage_layout(spec: ModelSpec, stages: int, *, gradient: str = "detached") -> StageLayout:
    """The contiguous layout of ``spec``'s decoder layers over ``stages`` stages that
    balances each stage's prefix state, weights and compute (``layer_costs``). Refuses more
    stages than layers, naming ``distributed.pipeline_stages``."""
    costs = layer_costs(spec, gradient)
    cap = _largest_load(costs, balanced_boundaries(costs, stages))
    return even_boundaries(costs, stages, cap)


def _largest_load(costs: Sequence[Sequence[float]], layout: StageLayout) -> float:
    loads = normalised_loads(costs)
    return max(sum(loads[i] for i in layout.layers_of(s)) for s in range(layout.stages))


def even_boundaries(costs: Sequence[Sequence[float]], stages: int, cap: float) -> StageLayout:
    """The contiguous split into ``stages`` blocks, each of load at most ``cap``, with the
    smallest sum of squared loads."""
    check_stage_count(stages, len(costs))
    limit = cap * (1 + 1e-9) + 1e-12

    def squares(before: float, load: float) -> float:
        return before + load * load if load <= limit else float("inf")

    return contiguous_partition(normalised_loads(costs), stages, squares)


def layout_for(spec: ModelSpec, work: Workload) -> StageLayout:
    """The layout a workload runs: its ``stage_starts``, else the balanced one; refuses a
    stage count that does not divide the GPUs."""
    check_stage_count(work.stages, len(spec.layers), work.gpus)
    if work.stage_starts is None:
        return stage_layout(spec, work.stages, gradient=work.gradient)
    layout = StageLayout.from_starts(work.stage_starts, len(spec.layers))
    if layout.stages != work.stages:
        raise StageLayoutError(
            f"distributed.stage_starts={list(work.stage_starts)} lays out {layout.stages} "
            f"stages, but distributed.pipeline_stages={work.stages}"
        )
    return layout


def root_split(spec: ModelSpec) -> tuple[int, int]:
    """(embedding, final norm + LM head) parameters of the root. A tied head is counted
    again: the last stage holds its own copy of the embedding matrix."""
    embedding = min(spec.vocab * spec.hidden, spec.root_params)
    rest = spec.root_params - embedding
    if rest < spec.vocab * spec.hidden:
        rest += embedding
    return embedding, rest


def stage_spec(spec: ModelSpec, layout: StageLayout, stage: int) -> ModelSpec:
    """Stage ``stage``'s slice of the model: its layers, the embeddings on the first stage,
    the final norm and LM head on the last (one stage: the whole model)."""
    layers = spec.layers[slice(*layout.boundaries[stage : stage + 2])]
    last = stage == layout.stages - 1
    if layout.stages == 1:
        root = spec.root_params
    else:
        embedding, head = root_split(spec)
        root = (embedding if stage == 0 else 0) + (head if last else 0)
    return dataclasses.replace(
        spec,
        name=spec.name if layout.stages == 1 else f"{spec.name} stage {stage}",
        layers=layers,
        params=sum(layer.params for layer in layers) + root,
        root_params=root,
        has_head=last,
    )


def full_attention_counts(spec: ModelSpec, layout: StageLayout) -> list[int]:
    """Full-attention layers per stage (the layers whose K/V grows with the prompt, and
    every query reads: ``KindPlan.full_attention``)."""
    return [
        sum(spec.layers[i].kind.plan.full_attention for i in layout.layers_of(s))
        for s in range(layout.stages)
    ]


class InFlight:
    """What the schedules keep in flight on stage ``stage`` (``core.MemoryParts`` mixes it
    in): replay's pieces (``pieces.piece_memory``: up to ``graphs_in_flight`` piece graphs)
    and exact mode's sweep, 1F1B over prompt chunks (up to ``S - s``), each with its graph
    of this stage's layers and its hidden states to and from the neighbour stages. One
    stage: one microbatch, no neighbours."""

    spec: ModelSpec
    work: Workload
    stage: int
    act: Activations
    exact: bool
    cb: int

    @functools.cached_property
    def replay(self) -> PieceMemory:
        """Replay in pieces on this stage at its fullest (S > 1)."""
        return piece_memory(self.act, self.work, self.stage)

    def in_flight(self, microbatches: int) -> int:
        """Microbatches in flight on this stage under 1F1B: up to ``S - s`` (one stage: 1)."""
        return max(min(self.work.stages - self.stage, microbatches), 1)

    def links(self) -> int:
        """Neighbour stages this one receives hidden states from or sends them to."""
        return (self.stage > 0) + (self.stage < self.work.stages - 1)

    def sweep_chunks(self) -> int:
        return math.ceil(self.work.stored / self.work.chunk_size)

    def waiting_chunks(self) -> int:
        """Exact sweep: the graphs of the prompt chunks in flight besides the one in its
        backward (each of this stage's layers only)."""
        waiting = self.in_flight(self.sweep_chunks()) - 1
        if not (self.exact and waiting):
            return 0
        tokens = min(self.work.chunk_size, self.work.stored)
        return waiting * self.act.chunk_graph(tokens, self.work.stored - tokens)

    def stage_buffers(self) -> dict[str, int]:
        """Hidden states ``[tokens, hidden]`` between stages, per phase: one from (or to)
        each neighbour per microbatch in flight (replay: per piece held), and in a backward
        the gradient received and the one sent (0 with one stage)."""
        work, links = self.work, self.links()
        if not links:
            return dict.fromkeys(PHASES, 0)
        chunk = min(work.chunk_size, work.stored)
        per = self.cb * self.spec.hidden * links
        chunks = self.in_flight(self.sweep_chunks()) + 1 if self.exact else 0
        return {
            "prefill": per * chunk,
            "rollout": per * work.group,
            "replay": per * (self.replay.held + 1) * self.replay.tokens,
            "sweep": per * chunks * chunk,
            "optimizer": 0,
        }
