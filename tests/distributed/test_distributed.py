"""FSDP2 sharding (``longstraw_core.distributed``) against one unsharded process.

- ``multiprocess``: torchrun starts two CPU ranks (gloo) on ``distributed_worker.py``; each
  step's two groups go one to each rank, and they differ in prompt chunks, group size and
  contributing branches. The first step's gradients and the parameters after two AdamW steps
  equal one process running both groups on an unsharded copy; sampled rollouts equal too.
- In-process, a world of one rank: ``shard_model`` engages FSDP (parameters become DTensors,
  layers gather and reduce through their registered methods) and changes no gradient; bf16
  mixed precision computes in bf16.
- The step's normalisation: ``group_loss_scales`` make several groups' ``grpo_step`` equal
  TRL's loss over all their responses as one batch.
"""

from __future__ import annotations

import math
from itertools import chain
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
from launch import SUPPORT, torchrun_ok
from reference import (
    assert_grads_close,
    detached_reference_logps,
    hand_advantages,
    pad_rows,
    parameter_grads,
    step_grads,
    trl_group_loss,
)
from torch.distributed.tensor import DTensor

import longstraw_core as ls
from longstraw_core.distributed import reduce_metrics
from longstraw_core.grpo.groups import group_loss_scales, spread_groups
from longstraw_core.grpo.losses import loss_weights
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model
from longstraw_core.parallel.topology import RunTopology
from longstraw_core.rewards import reward_metrics
from longstraw_core.schema.grpo import LOSS_TYPES

TRAINING_CASES = list(worker.CASES)


# --- two ranks under torchrun ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> Path:
    """Every worker case on two ranks, once; the directory of their results."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun_ok(
        SUPPORT / "distributed_worker.py", str(out), *TRAINING_CASES, "rollout",
        "rollout-gathers", "generation-batch", "batch-metrics",
    )  # fmt: skip
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", TRAINING_CASES)
def test_two_ranks_train_like_one_process(sharded_runs, name):
    case = worker.CASES[name]
    model, adapter = worker.build(case)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads, metrics = worker.train(model, adapter, case, worker.step_groups)
    sharded = torch.load(sharded_runs / f"{name}.pt")
    worker.assert_like_one_process(sharded, model, grads, metrics, initial)


@pytest.mark.multiprocess
def test_two_ranks_roll_out_in_step(sharded_runs):
    """Each rank samples its own group; the one that finishes first keeps decoding (masked)
    until the other is done, and its responses are those of an unsharded model."""
    sharded = torch.load(sharded_runs / "rollout.pt")
    alone = []
    for rank in range(2):
        _, adapter = worker.build(worker.Case("qwen3", "detached"))
        alone.append(worker.rollout_group(adapter, rank))
    assert [rank["responses"] for rank in sharded] == [rank["responses"] for rank in alone]
    assert alone[0]["steps"] != alone[1]["steps"]  # the ranks would stop at different steps
    assert sharded[0]["steps"] == sharded[1]["steps"] == max(rank["steps"] for rank in alone)


@pytest.mark.multiprocess
def test_a_sharded_rollout_gathers_the_model_once(sharded_runs):
    """Gathering once per rollout (the default), the number of FSDP all-gathers does not
    grow with the tokens generated; at every decode step it does. Both decode the same
    tokens."""
    for rank in torch.load(sharded_runs / "rollout-gathers.pt"):
        counts, responses = rank["counts"], rank["responses"]
        assert counts[True, 3] == counts[True, 9] > 0
        assert counts[False, 9] > counts[False, 3] > counts[True, 9]
        assert responses[True, 3] == responses[False, 3]
        assert responses[True, 9] == responses[False, 9]


@pytest.mark.multiprocess
def test_two_ranks_of_two_groups_step_like_one_process_of_four(sharded_runs):
    """``GenerationBatch`` across ranks: the token normaliser and the reward std
    (``scale_rewards="batch"``) span every rank's groups, so two ranks of two groups give one
    process's gradient, loss and advantages over all four."""
    ranks = torch.load(sharded_runs / "generation-batch.pt")
    model, adapter = worker.build(worker.Case("qwen3", "exact"))
    alone = worker.train_generation(model, adapter, worker.generation_groups())
    assert_grads_close(ranks[0]["grads"], alone["grads"], rtol=1e-5)
    assert sum(rank["loss"] for rank in ranks) / 2 == pytest.approx(alone["loss"], rel=1e-5)
    advantages = [a for rank in ranks for group in rank["advantages"] for a in group]
    assert advantages == pytest.approx([a for g in alone["advantages"] for a in g], rel=1e-12)
    # The first round's normaliser and std were not the step's: finish corrected them.
    assert all(rank["factor"] != 1.0 for rank in ranks) and alone["factor"] != 1.0


@pytest.mark.multiprocess
def test_a_steps_reward_and_completion_metrics_are_the_whole_batchs(sharded_runs):
    """TRL logs a step's reward and completion statistics over its whole gathered batch: two
    ranks' metrics equal one process's over the union of their groups (not the mean of each
    rank's), and every rank logs the same."""
    ranks = torch.load(sharded_runs / "batch-metrics.pt")
    groups = [g for rank in worker.batch_metric_groups() for g in rank]
    scored, shapes = [r for r, _ in groups], [c for _, c in groups]
    want = {
        "rewards": reward_metrics(scored, "group"),
        "rewards-batch": reward_metrics(scored, "batch"),
        "completions": RunTopology(replicas=1, replica=0).completion_metrics(shapes),
    }
    for rank in ranks:
        assert rank.keys() == want.keys()
        for key, metrics in want.items():
            assert rank[key] == pytest.approx(metrics, nan_ok=True), key
    # a constant group counts as zero std within groups, not within the batch
    assert want["rewards"]["frac_reward_zero_std"] == pytest.approx(3 / 9)
    assert want["rewards-batch"]["frac_reward_zero_std"] == 0.0


# --- a world of one rank, in this process ---------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("gradient", ["detached", "exact"])
def test_sharding_changes_no_gradient(world_of_one, model_type, gradient):
    case = worker.Case(model_type, gradient)
    group = worker.step_groups(0)[0]
    config = worker.grpo_config(case)
    plain_model, plain = worker.build(case)
    model, adapter = worker.build(case)
    assert shard_model(adapter, mixed_precision="auto") is adapter
    assert isinstance(next(model.parameters()), DTensor)

    with torch.no_grad():
        plain_state = plain.prefill(group.prompt, chunk_size=worker.CHUNK_SIZE)
        state = adapter.prefill(group.prompt, chunk_size=worker.CHUNK_SIZE)
        for response in group.responses:
            assert torch.equal(adapter.score(state, response), plain.score(plain_state, response))
    args = (group.prompt, group.responses, group.rewards)
    kwargs = {"config": config, "chunk_size": worker.CHUNK_SIZE}
    expected_metrics, expected = step_grads(plain_model, plain, *args, **kwargs)
    metrics, grads = step_grads(model, adapter, *args, **kwargs)
    grads = {name: grad.full_tensor() for name, grad in grads.items()}
    assert_grads_close(grads, expected, rtol=0.0)
    assert metrics.loss == expected_metrics.loss


def test_a_step_ending_without_backward_leaves_no_stale_weights(world_of_one):
    """A group whose rewards are all equal runs no backward; FSDP would still hold the root's
    and the last layer's gathered weights from its prefill, stale after the optimizer step
    (``grpo_step`` releases them)."""
    case = worker.Case("qwen3", "detached")
    trained, equal_rewards = worker.step_groups(0)[0], worker.step_groups(1)[0]
    runs = []
    for sharded in (False, True):
        model, adapter = worker.build(case)
        if sharded:
            shard_model(adapter)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for group in (trained, equal_rewards):
            ls.grpo_step(adapter, group.prompt, group.responses, group.rewards, chunk_size=8)
        optimizer.step()
        args = (trained.prompt, trained.responses, trained.rewards)
        runs.append(step_grads(model, adapter, *args, chunk_size=8, config=ls.GRPOConfig())[1])
    plain, sharded = runs
    assert_grads_close({n: g.full_tensor() for n, g in sharded.items()}, plain, rtol=1e-6)


def test_bf16_mixed_precision_computes_in_bf16(world_of_one):
    case = worker.Case("qwen3", "exact")
    group = worker.step_groups(0)[0]
    config = worker.grpo_config(case)
    args = (group.prompt, group.responses, group.rewards)
    kwargs = {"config": config, "chunk_size": worker.CHUNK_SIZE}
    full_model, full = worker.build(case)
    _, expected = step_grads(full_model, full, *args, **kwargs)
    model, adapter = worker.build(case)
    shard_model(adapter, mixed_precision="bf16")

    assert adapter.dtype == torch.bfloat16
    assert adapter.prefill(group.prompt).layers[0].keys.dtype == torch.bfloat16
    _, grads = step_grads(model, adapter, *args, **kwargs)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32  # sharded parameters and their gradients stay fp32
        similarity = torch.cosine_similarity(
            grad.full_tensor().flatten(), expected[name].flatten(), 0
        )
        assert similarity > 0.99, name


def test_shard_model_refuses_misuse(world_of_one):
    _, adapter = worker.build(worker.Case("qwen3", "detached"))
    with pytest.raises(ValueError, match="mixed_precision"):
        shard_model(adapter, mixed_precision="fp16")
    shard_model(adapter)
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(adapter)


def test_metrics_reduce_over_the_ranks_that_report_them(world_of_one):
    metrics = {"loss": 0.5, "entropy": float("nan"), "advantages": [1.0], "replayed": 3}
    reduced = reduce_metrics(metrics, op="sum")
    assert list(reduced) == ["loss", "entropy", "replayed"]  # lists are dropped
    assert reduced["loss"] == 0.5 and reduced["replayed"] == 3.0
    assert math.isnan(reduced["entropy"])  # no rank reported one


def test_shard_model_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    _, adapter = worker.build(worker.Case("qwen3", "detached"))
    with pytest.raises(RuntimeError, match="process group"):
        shard_model(adapter)
    assert reduce_metrics({"loss": 1.0, "advantages": [0.5]}) == {"loss": 1.0}


# --- the step's normalisation ---------------------------------------------------------------------


def test_spread_groups_gives_every_rank_the_same_number():
    groups = list("abcdef")
    spread = [spread_groups(groups, rank, 3) for rank in range(3)]
    assert spread == [["a", "d"], ["b", "e"], ["c", "f"]]
    with pytest.raises(ValueError, match="multiple of the world size"):
        spread_groups(groups, 0, 4)


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_loss_scales_weight_groups_as_one_batch(loss_type, mask_truncated):
    """Each group's own weights times its scale are the weights of the step's batch."""
    config = ls.GRPOConfig(
        loss_type=loss_type, max_completion_length=16, mask_truncated_completions=mask_truncated,
        epsilon_high=5.0 if loss_type == "cispo" else None,
    )  # fmt: skip
    lengths = [[5, 3, 16], [4, 6], [16, 16]]
    truncated = [[False, False, True], [False, False], [True, True]]
    scales = group_loss_scales(lengths, config, truncated)
    batch = loss_weights(list(chain(*lengths)), list(chain(*truncated)), config)
    scaled = [
        weight * scale
        for group, flags, scale in zip(lengths, truncated, scales, strict=True)
        for weight in loss_weights(group, flags, config)
    ]
    assert scaled == pytest.approx(batch, rel=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_groups_of_one_step_equal_trl_over_all_their_responses(loss_type):
    """Two groups (different prompts) with their loss scales accumulate the gradient of TRL's
    loss over the step's whole batch (advantages within each group)."""
    model = tiny_model("qwen3", dtype=torch.float64, seed=0)
    adapter = ls.adapt(model)
    config = ls.GRPOConfig(loss_type=loss_type, max_completion_length=16)
    groups = worker.step_groups(0)
    lengths = [[len(r) for r in group.responses] for group in groups]

    logps, advantages = [], []
    for group in groups:
        logps += [detached_reference_logps(model, group.prompt, r) for r in group.responses]
        advantages.append(hand_advantages(group.rewards))
    padded, mask = pad_rows(logps)
    loss, _ = trl_group_loss(padded, padded.detach(), None, torch.cat(advantages), mask, config)
    expected = parameter_grads(model, loss)

    model.zero_grad(set_to_none=True)
    for group, scale in zip(groups, group_loss_scales(lengths, config), strict=True):
        ls.grpo_step(
            adapter, group.prompt, group.responses, group.rewards, config=config,
            chunk_size=worker.CHUNK_SIZE, loss_scale=scale,
        )  # fmt: skip
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert_grads_close(grads, expected, rtol=1e-9)
