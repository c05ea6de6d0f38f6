"""torch.distributed as every multi-rank path uses it: small collectives a run agrees through
(``collectives``: the largest value, any flag, every rank's rows, float64 sums, the metrics
combined over the ranks) and what a run of several processes needs to start and end
(``processes``: the shared-model check, the groups' timeout, a gloo group for objects, a
finished rank's exit). No model and no GRPO here: FSDP, the stage x replica mesh and each
rank's part are ``longstraw_core.parallel``'s (its docstring tells how a sharded step runs);
the step's groups over the ranks are ``longstraw_core.grpo.groups``'."""

from longstraw_core.distributed.collectives import (
    any_rank,
    gather_rows,
    max_over_ranks,
    ranks_where,
    reduce_metrics,
    sum_over_ranks,
)
from longstraw_core.distributed.processes import (
    cpu_group,
    exit_ranks,
    group_timeout,
    process_group_kwargs,
    require_sharding,
    world_timeout,
)

__all__ = [
    "any_rank",
    "cpu_group",
    "exit_ranks",
    "gather_rows",
    "group_timeout",
    "max_over_ranks",
    "process_group_kwargs",
    "ranks_where",
    "reduce_metrics",
    "require_sharding",
    "sum_over_ranks",
    "world_timeout",
]
