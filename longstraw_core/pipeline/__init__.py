"""Pipeline stages: one prompt's layers, weights and prefix state spread over S ranks.

- ``layout``: which layers each stage owns (contiguous, balanced blocks);
- ``transport``: hidden states and their gradients between neighbouring stages;
- ``schedule``: the 1F1B schedule of the passes with autograd, and the forward-only one;
- ``stage``: an adapter cut down to its stage (``stage_model``);
- ``mesh``: the world as stages x replicas (``pipeline_mesh``, ``stage_adapter``);
- ``gradients``: averaging over replicas, clipping by the whole model's norm;
- ``topology``: what a recipe's rank does (its replica's prompt, its stage; ``RunTopology``).

The adapter's passes on a stage are in ``model_adapters.staged``.
"""

from longstraw_core.pipeline.gradients import average_over_replicas, clip_grad_norm
from longstraw_core.pipeline.layout import (
    StageLayout,
    StageLayoutError,
    balanced_boundaries,
    check_stage_count,
)
from longstraw_core.pipeline.mesh import (
    default_layout,
    pipeline_mesh,
    replica_group,
    stage_adapter,
    stage_link,
)
from longstraw_core.pipeline.stage import OnAnotherStage, Stage, stage_model
from longstraw_core.pipeline.topology import RunTopology
from longstraw_core.pipeline.transport import StageLink

__all__ = [
    "OnAnotherStage",
    "RunTopology",
    "Stage",
    "StageLayout",
    "StageLayoutError",
    "StageLink",
    "average_over_replicas",
    "balanced_boundaries",
    "check_stage_count",
    "clip_grad_norm",
    "default_layout",
    "pipeline_mesh",
    "replica_group",
    "stage_adapter",
    "stage_link",
    "stage_model",
]
