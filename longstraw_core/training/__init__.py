"""The trainer's mechanics for recipes: everything around the GRPO loop a user edits.

    import longstraw_core as ls
    from longstraw_core import training

    class Recipe(training.Session):
        def train_rollout(self, samples, indices):
            ...  # per prompt: prefill, rollout, rewards, advantages, grpo_step; then
            yield self.step_metrics(batch, rollouts, results, *self.optimizer_step(loss), first=True)

    def main(argv=None) -> Recipe:
        return training.main(Recipe, argv, default_config=CONFIG, description=__doc__)

- ``Session``: setup (accelerator, launch settings' outcome, sharding / pipeline topology,
  data scan, output directory, loading, reference policy, mixed precision, optimizer,
  resume), the step loop (data positions, eval, logging, checkpoints, stop signals),
  ``save_checkpoint`` and ``cleanup``; with ``StepBookkeeping``'s ``optimizer_step`` (clip,
  non-finite guard), ``step_metrics``, ``skip_rollout``, ``start_step`` / ``note_peak``,
  and the loop's helpers ``group``, ``prefill``, ``rollout`` (the group's G responses, TRL's
  sampling settings), ``score`` (TRL's reward call: a ``Rollout``), ``rollout_seed`` and
  ``sampling``.
- ``main``: the command line (``--config``, ``key=value`` overrides), config and memory-plan
  checks, one-line errors and exit codes.
- ``Rollout`` and ``state_bytes``: one scored group as ``step_metrics`` reads it.
- ``NonFiniteError``, ``any_rank``, ``RunConfig``, ``Sample``: what a loop also names.
"""

from longstraw_core.config import RunConfig
from longstraw_core.data.samples import Sample
from longstraw_core.distributed import any_rank
from longstraw_core.process.guard import NonFiniteError
from longstraw_core.training.main import main
from longstraw_core.training.session import Session
from longstraw_core.training.step import Rollout, StepBookkeeping, state_bytes

__all__ = [
    "NonFiniteError",
    "Rollout",
    "RunConfig",
    "Sample",
    "Session",
    "StepBookkeeping",
    "any_rank",
    "main",
    "state_bytes",
]
