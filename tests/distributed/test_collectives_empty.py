"""Every collective helper with an empty input on one rank, against one process.

``multiprocess``: two CPU ranks (gloo, under the NCCL-rules harness) run
``collectives_worker.py``: clipping over two stages where rank 1 holds parameters without
gradients (every reward of its groups equal with ``beta=0``), no parameters, or neither rank a
gradient; averaging over two replicas where one holds no gradient; the small collectives,
object gathers and checkpoint waits with an empty list, an empty dict, no groups or zero rows.
Each equals one process over both ranks' inputs, and every tensor a helper hands a collective
has one dtype and element count on both ranks, is never empty (NCCL would be handed nothing
to move), and lives on the device its group needs (``collective_device``: the current GPU
under NCCL): the rules NCCL holds a GPU run to, checked on every call.

In-process: the device and dtype the clip reduces in depend on the group alone.
"""

from __future__ import annotations

import math

import collectives_worker as worker
import pytest
import torch
import torch.distributed as dist
from launch import SUPPORT, torchrun_ok

from longstraw_core.checkpoint import ranks
from longstraw_core.distributed import gather_rows, reduce_metrics, sum_over_ranks
from longstraw_core.grpo.groups import group_loss_scales, step_reward_std
from longstraw_core.pipeline.gradients import SQUARES_DTYPE, clip_grad_norm, reduction_device
from longstraw_core.schema.grpo import GRPOConfig

# The clip's norm: float32 gradients' squares are summed in float32 (n <= 16 terms: relative
# error <= 16 * 2**-24 ~ 1e-6, plus the sqrt's and the coefficient's roundings); torch's
# reference rounds its float32 norm once more. 1e-5 leaves room for those and fails any rank's
# share missing (O(1)).
CLIP_RTOL = 1e-5


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory) -> list[dict]:
    """Both ranks' results and tap logs, from one torchrun."""
    out = tmp_path_factory.mktemp("collectives")
    torchrun_ok(SUPPORT / "collectives_worker.py", str(out), ranks=worker.RANKS)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(worker.RANKS)]


@pytest.mark.multiprocess
def test_every_tensor_on_a_collective_agrees_across_ranks_and_lives_on_its_groups_device(
    ranks_run,
):
    logs = [run["tap"] for run in ranks_run]
    assert len(logs[0]) == len(logs[1]) > 0
    for call, other in zip(*logs, strict=True):
        if call["name"] == "helper":
            assert call == other
            continue
        assert {k: v for k, v in call.items() if k != "device"} == {
            k: v for k, v in other.items() if k != "device"
        }, (call, other)
        if call["dtype"] is not None:  # a tensor collective (object ones carry no tensor)
            assert call["numel"] > 0, call
            assert call["device"] == other["device"] == call["needs"], (call, other)
    calls = _by_helper(logs[0])
    for case in worker.CLIP_CASES:  # one float64 scalar, whatever the rank holds
        assert calls[f"clip/{case}"] == [("all_reduce", str(SQUARES_DTYPE), 1)]
    assert [name for name, _, _ in calls["average/rank1-no-grads"]] == ["all_reduce"] * 3
    assert calls["average/no-params"] == []


def _by_helper(log: list[dict]) -> dict[str, list[tuple]]:
    """Each helper's calls in the tap's log: ``(collective, dtype, element count)``."""
    calls: dict[str, list[tuple]] = {}
    for call in log:
        if call["name"] == "helper":
            current = calls.setdefault(call["helper"], [])
        else:
            current.append((call["name"], call["dtype"], call["numel"]))
    return calls


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", worker.CLIP_CASES)
def test_clipping_with_a_rank_without_gradients_equals_one_process(ranks_run, case):
    """One process holding both stages' parameters, rank 0's gradients, clipped by torch."""
    stages = [worker.stage_parameters(rank, case) for rank in range(worker.RANKS)]
    everything = [p for stage in stages for p in stage]
    expected = torch.nn.utils.clip_grad_norm_(everything, worker.MAX_NORM)
    for rank, stage in enumerate(stages):
        total, grads = ranks_run[rank]["results"][f"clip/{case}"]
        assert total.dtype == SQUARES_DTYPE
        torch.testing.assert_close(total, expected.to(total.dtype), rtol=CLIP_RTOL, atol=0)
        assert len(grads) == len(stage)
        for grad, parameter in zip(grads, stage, strict=True):
            if parameter.grad is None:
                assert grad is None
            else:
                torch.testing.assert_close(grad, parameter.grad, rtol=CLIP_RTOL, atol=0)
    if case != "no-grads-anywhere":
        assert expected > worker.MAX_NORM  # the clip scaled
    else:
        assert float(expected) == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", worker.AVERAGE_CASES)
def test_averaging_with_a_replica_without_gradients_equals_one_process(ranks_run, case):
    """The mean over both replicas' gradients, a missing one counted as zeros (exact: adding
    zero and halving round nothing); a parameter no replica has a gradient for keeps None."""
    replicas = [worker.replica_parameters(rank, case) for rank in range(worker.RANKS)]
    for rank in range(worker.RANKS):
        grads = ranks_run[rank]["results"][f"average/{case}"]
        for index, grad in enumerate(grads):
            mine = [p[index].grad for p in replicas if p[index].grad is not None]
            if not mine:
                assert grad is None
                continue
            expected = sum(mine, torch.zeros_like(mine[0])) / worker.RANKS
            assert grad.dtype == replicas[0][index].dtype
            assert torch.equal(grad, expected)


@pytest.mark.multiprocess
def test_the_small_collectives_with_empty_inputs_equal_one_process(ranks_run):
    both = range(worker.RANKS)
    config = GRPOConfig()
    every_length = [group for rank in both for group in worker.lengths(rank)]
    one_process_scales = group_loss_scales(every_length, config)  # no process group here
    for rank in both:
        got = ranks_run[rank]["results"]
        assert got["sum/empty"] == ([], worker.RANKS)
        assert got["sum/values"] == ([sum(float(r) for r in both), 0.5 * worker.RANKS], 2)
        assert got["max"] == 3 * (worker.RANKS - 1)
        assert got["any"] == (True, False)
        assert got["gather_rows"] == (gather_rows([r for k in both for r in worker.rows(k)]), [])
        combined, empty = got["reduce_metrics"]
        assert empty == {}
        assert combined.keys() == reduce_metrics(worker.metrics(0)).keys()
        assert combined["x"] == 1.5 and combined["z"] == 2.0 and math.isnan(combined["y"])
        # FSDP averages over the ranks: each group's share times the world size.
        mine = one_process_scales[: len(worker.lengths(rank))] if rank == 0 else []
        assert got["loss_scales"] == pytest.approx([worker.RANKS * s for s in mine], rel=1e-12)
        for zero_rows, std in zip((False, True), got["reward_std"], strict=True):
            every = [r for k in both for r in worker.rewards(k, zero_rows)]
            assert std == pytest.approx(step_reward_std(every), rel=1e-12)
        assert got["checkpoint"] == (["mine", None], "written", None)
        assert got["fsdp"] == (4, (True, False))
    assert sum_over_ranks([]) == ([], 1)  # one process: no collective either


def test_the_clip_reduces_on_the_groups_device_whatever_a_rank_holds(tmp_path):
    """Without a group the sum stays with the parameters; with a gloo group (of any size,
    whatever the parameters) it is on the CPU, with or without gradients; its dtype is one
    constant. (NCCL's branch, a CUDA device, runs in ``make gpu-check``.)"""
    assert torch.float64 == SQUARES_DTYPE
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    assert reduction_device(meta, None) == torch.device("meta")
    assert reduction_device([], None) == torch.device("cpu")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert reduction_device(meta, dist.group.WORLD) == torch.device("cpu")
        assert reduction_device([], dist.group.WORLD) == torch.device("cpu")
        no_grads = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
        total = clip_grad_norm(no_grads, 1.0, dist.group.WORLD)
        assert total.item() == 0.0
        assert (total.dtype, total.device) == (SQUARES_DTYPE, torch.device("cpu"))
        assert ranks.gather([]) == [[]]
    finally:
        dist.destroy_process_group()
