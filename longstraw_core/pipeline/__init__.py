"""Pipeline stages: one prompt's layers, weights and prefix state spread over S ranks.

- ``layout``: which layers each stage owns (contiguous, balanced blocks);
- ``schedule``: each pass as every stage's program of computes and fused exchanges, in one
  order per pair of stages (prefill forward, rollout's ring of micro-groups, replay's
  pieces, the sweep's 1F1B);
- ``simulate``: programs played under NCCL's point-to-point rules (liveness, idle share,
  the planner's time);
- ``runner``: a stage's program run with real transfers;
- ``transport``: the exchanges (``batch_isend_irecv``, shapes from the plan, no tags);
- ``stage``: what an adapter on a stage knows of its place (``Stage``), the stand-ins for
  the layers it does not hold;
- ``gradients``: averaging over replicas, clipping by the whole model's norm.

Nothing here knows adapters: an adapter is cut down to its stage by
``longstraw_core.adapters.stage_cut.stage_model``, and the world as stages x replicas
(``longstraw_core.parallel.mesh``) and what a recipe's rank does
(``longstraw_core.parallel.topology``) read the run config and the planner, above both.

The adapter's passes on a stage are in ``longstraw_core.adapters.staged_forward`` (no
autograd) and ``longstraw_core.adapters.staged_backward`` (replay, exact sweep).
"""

from longstraw_core.pipeline.gradients import average_over_replicas, clip_grad_norm
from longstraw_core.pipeline.layout import (
    StageLayout,
    StageLayoutError,
    balanced_boundaries,
    check_stage_count,
)
from longstraw_core.pipeline.stage import OnAnotherStage, Stage
from longstraw_core.pipeline.transport import StageLink

__all__ = [
    "OnAnotherStage",
    "Stage",
    "StageLayout",
    "StageLayoutError",
    "StageLink",
    "average_over_replicas",
    "balanced_boundaries",
    "check_stage_count",
    "clip_grad_norm",
]
