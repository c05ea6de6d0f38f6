"""Pipeline stages: one prompt's layers, weights and prefix state spread over S ranks.

``layout``: which layers each stage owns. The runtime (stage groups, point-to-point
transfers, the schedules of each phase) builds on it.
"""

from longstraw_core.pipeline.layout import (
    StageLayout,
    StageLayoutError,
    balanced_boundaries,
    check_stage_count,
)

__all__ = ["StageLayout", "StageLayoutError", "balanced_boundaries", "check_stage_count"]
