"""Dry runs at real dimensions: one GRPO step per pipeline stage on fake tensors.

``python -m longstraw_core.scale_check`` (``make scale-check``) runs each paper
configuration (``runs.PAPER``) stage by stage on ``FakeTensorMode`` tensors (shapes and
dtypes, no memory), through the recipe's real passes, with ``memory.LiveTensorMemory``
recording each stage's peak, and compares it with the planner's prediction for that stage
and with the GPU budget. Modules: ``link`` (a ``StageLink`` with nobody on the other end),
``stage_run`` (one stage's step), ``runs`` (configurations, comparison, tables), ``cli``.
"""

from longstraw_core.scale_check.runs import PAPER, DryRun, run_config, table
from longstraw_core.scale_check.stage_run import StageResult, run_stage

__all__ = ["PAPER", "DryRun", "StageResult", "run_config", "run_stage", "table"]
