"""``GenerationBatch``'s bookkeeping, without a model: shares, corrections, what waits.

Its gradients against TRL's trainer are in ``tests/trl/test_trl_reference.py``, across two ranks
in ``tests/distributed/test_distributed.py``; here the numbers it hands ``grpo_step``.
"""

from __future__ import annotations

import math

import pytest
import torch

import longstraw_core as ls
from longstraw_core.grpo.generation import Share, combine_group_metrics, scale_gradients
from longstraw_core.grpo.losses import loss_weights

GROUPS = [  # (response lengths, rewards)
    ([3, 5], [1.0, 0.0]),
    ([2, 2, 6], [0.5, 2.0, 0.0]),
]


def responses(lengths: list[int]) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=torch.long) for n in lengths]


def fill(batch: ls.GenerationBatch) -> list[Share | None]:
    return [
        batch.add(
            torch.zeros(4, dtype=torch.long), responses(lengths), rewards, [False] * len(lengths)
        )
        for lengths, rewards in GROUPS
    ]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_provisional_shares_times_the_correction_are_the_batch_weights(loss_type):
    config = ls.GRPOConfig(loss_type=loss_type, scale_rewards="batch")
    batch = ls.GenerationBatch(config, prompts=2)
    provisional = fill(batch)
    for k in range(2):
        batch.replay_kwargs(k, batch.advantages(k))  # what the replay used
        batch.record(k, ls.GRPOStepResult(**_result(loss=1.0)))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    factor = batch.finish([param])
    assert torch.equal(param.grad, torch.full((3,), 2.0 * factor))
    # Each group's weights x the share it replayed with x the correction: the batch's weights.
    lengths = [lengths for lengths, _ in GROUPS]
    batch_weights = loss_weights([n for g in lengths for n in g], None, config)
    scaled = [
        w * share.loss_scale * factor
        for g, share in zip(lengths, provisional, strict=True)
        for w in loss_weights(g, None, config)
    ]
    # ... with the advantages scaled by the first round's std, corrected to the step's.
    all_rewards = torch.tensor([r for _, rewards in GROUPS for r in rewards], dtype=torch.float64)
    step_std = float(all_rewards.std())
    first_std = float(torch.tensor(GROUPS[0][1]).double().std())
    assert provisional[0].reward_std == pytest.approx(first_std)
    assert batch.share(0).reward_std == pytest.approx(step_std)
    std_correction = (first_std + 1e-4) / (step_std + 1e-4)
    assert scaled == pytest.approx([w * std_correction for w in batch_weights], rel=1e-12)
    # The final shares are the batch's at once; later updates get them and the log-probs.
    final = [
        w * batch.share(k).loss_scale
        for k, g in enumerate(lengths)
        for w in loss_weights(g, None, config)
    ]
    assert final == pytest.approx(batch_weights, rel=1e-12)
    assert batch.step_loss() == pytest.approx(sum(s.loss_scale for s in provisional) * factor)
    kwargs = batch.replay_kwargs(1, batch.advantages(1))
    assert kwargs["loss_scale"] == batch.share(1).loss_scale and kwargs["old_logps"] == [None]


def test_one_prompt_needs_no_correction():
    batch = ls.GenerationBatch(ls.GRPOConfig(scale_rewards="batch"), prompts=1)
    share = batch.add(torch.zeros(4, dtype=torch.long), responses([3, 5]), [1.0, 0.0], [False] * 2)
    batch.replay_kwargs(0, batch.advantages(0))
    batch.record(0, ls.GRPOStepResult(**_result(loss=1.0)))
    assert batch.finish([]) == 1.0 and batch.share(0) == share


def test_batch_std_with_kl_makes_replays_wait_the_last_first():
    batch = ls.GenerationBatch(ls.GRPOConfig(scale_rewards="batch", beta=0.04), prompts=2)
    assert batch.defers_replay and fill(batch) == [None, None]
    with pytest.raises(RuntimeError, match="after finish"):
        batch.replay_kwargs(0, batch.advantages(0))
    assert batch.finish([]) == 1.0 and batch.waiting() == [1, 0]
    with pytest.raises(RuntimeError, match="once"):
        batch.finish([])
    with pytest.raises(RuntimeError, match="add called after"):
        batch.add(torch.zeros(4, dtype=torch.long), responses([1]), [0.0], [False])


def test_unscorable_step_gives_zero_advantages_as_trl():
    """Fewer than two scorable rewards in the whole step: TRL's std is NaN and its
    advantages 0; the correction then zeroes what the replays accumulated."""
    batch = ls.GenerationBatch(ls.GRPOConfig(scale_rewards="batch"), prompts=2)
    for k, rewards in enumerate(([math.nan, 1.0], [math.nan, math.nan])):
        share = batch.add(torch.zeros(2, dtype=torch.long), responses([2, 2]), rewards, [False] * 2)
        assert share.reward_std == 1.0  # a stand-in: one scorable reward has no std
        batch.replay_kwargs(k, batch.advantages(k))
        batch.record(k, ls.GRPOStepResult(**_result(loss=1.0)))
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    assert batch.finish([param]) == 0.0 and torch.equal(param.grad, torch.zeros(2))
    assert batch.share(0).reward_std == math.inf


def test_group_metrics_are_means_but_times_and_peaks():
    combined = combine_group_metrics(
        [
            {"entropy": 1.0, "replay_seconds": 2.0, "peak_memory_bytes": 5, "kl": math.nan},
            {"entropy": 3.0, "replay_seconds": 1.0, "peak_memory_bytes": 7},
        ]
    )
    assert math.isnan(combined.pop("kl"))  # no group has one
    assert combined == {"entropy": 2.0, "replay_seconds": 3.0, "peak_memory_bytes": 7}


def test_scale_gradients_leaves_parameters_without_one():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.ones(2)
    scale_gradients([a, b], 0.5)
    assert torch.equal(a.grad, torch.full((2,), 0.5)) and b.grad is None


def _result(loss: float) -> dict:
    """A GRPOStepResult's fields for bookkeeping (no model ran)."""
    zero = dict.fromkeys(
        ["group_reward_mean", "group_reward_std", "entropy", "completion_length_mean"], 0.0
    )
    counts = dict.fromkeys(
        ["prompt_tokens", "completion_tokens", "branches_replayed", "state_bytes",
         "state_grad_bytes", "attention_output_bytes", "peak_memory_bytes"], 0,
    )  # fmt: skip
    return {"loss": loss, "advantages": [], **zero, **counts, "logps": [None], "ref_logps": [None]}


def test_a_replay_takes_one_advantage_per_response():
    """``replay_kwargs`` carries the caller's advantages (so no replay goes without them);
    a list of another length is refused, naming both counts."""
    batch = ls.GenerationBatch(ls.GRPOConfig(scale_rewards="batch"), prompts=1)
    batch.add(torch.zeros(4, dtype=torch.long), responses([3, 5]), [1.0, 0.0], [False] * 2)
    assert batch.replay_kwargs(0, [0.5, -0.5])["advantages"] == [0.5, -0.5]
    with pytest.raises(ValueError, match="group 0: 3 advantages for 2 responses"):
        batch.replay_kwargs(0, [0.0, 0.0, 0.0])
