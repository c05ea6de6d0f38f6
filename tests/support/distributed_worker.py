"""Two GRPO optimizer steps on a tiny model sharded over the ranks (FSDP2, gloo on CPU).

Run by ``tests/distributed/test_distributed.py`` under torchrun::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/support/distributed_worker.py OUT_DIR CASE [CASE ...]

Each step has two groups that differ in prompt length (so in prefill and sweep chunks), in
group size and in the number of branches that contribute (a zero advantage is skipped), so
the ranks only stay in step through the padding of ``ModelAdapter.in_step``. Rank ``r`` takes
group ``r``. Rank 0 writes the first step's gradients, the parameters after the two steps
(gathered whole) and the last step's metrics summed over the ranks to ``OUT_DIR/CASE.pt``;
the test compares them with one process running every group on an unsharded copy. The
``rollout`` case decodes one group per rank (ranks stop at different steps) and writes the
responses. The ``generation-batch`` case takes two groups per rank into one step through
``GenerationBatch`` (``scale_rewards="batch"``, ``dapo``): its loss normaliser and reward std
span both ranks, and the gradient equals one process running all four groups.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_exit import leave_process_group_and_exit
from reference import with_lora

import longstraw_core as ls
from longstraw_core.distributed import reduce_metrics
from longstraw_core.grpo.groups import group_loss_scales, spread_groups
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model
from longstraw_core.parallel.topology import RunTopology
from longstraw_core.rewards import RewardResult

CHUNK_SIZE = 8
STEPS = 2
LEARNING_RATE = 1e-3
ADAM_EPS = 1e-5  # see ``train``


@dataclass(frozen=True)
class Case:
    model_type: str
    gradient: str
    loss_type: str = "dapo"
    lora: bool = False
    beta: float = 0.0  # > 0: the KL term, against the LoRA model with its adapters off
    reshard_after_forward: bool = True
    keep_attention_outputs: bool = False


CASES = {
    "qwen3-detached": Case("qwen3", "detached"),
    "qwen3-exact": Case("qwen3", "exact"),
    "qwen3-exact-grpo": Case("qwen3", "exact", loss_type="grpo"),
    "qwen3-lora-exact": Case("qwen3", "exact", lora=True),
    "qwen3-lora-kl-detached": Case("qwen3", "detached", lora=True, beta=0.04),
    "qwen3_5_text-detached": Case("qwen3_5_text", "detached"),
    "qwen3_5_text-exact": Case("qwen3_5_text", "exact"),
    "qwen3_5_text-exact-gathered": Case("qwen3_5_text", "exact", reshard_after_forward=False),
    "glm_moe_dsa-exact": Case("glm_moe_dsa", "exact"),
    "qwen3-exact-kept-outputs": Case("qwen3", "exact", keep_attention_outputs=True),
}


@dataclass(frozen=True)
class Group:
    prompt: torch.Tensor
    responses: list[torch.Tensor]
    rewards: list[float]


def step_groups(step: int) -> list[Group]:
    """The two groups of optimizer step ``step`` (rank ``r`` of two takes group ``r``).

    Prompt lengths give 4 and 2 chunks of 8 (step 0), 2 and 5 (step 1). Without a KL term
    the groups replay 3 and 2 branches (step 0; one reward at the mean has no advantage),
    then none and 3 (step 1: equal rewards), so rank 0 only pads the replay, yet sweeps.
    """
    shapes = [
        [(29, [5, 3, 7, 2], [1.0, 0.0, 0.4, 0.2]), (13, [4, 6], [0.0, 1.0])],
        [(10, [6, 2, 4], [0.5, 0.5, 0.5]), (37, [3, 5, 4], [0.2, 0.9, 0.0])],
    ][step]
    return random_groups(shapes, seed=100 + step)


def random_groups(
    shapes: list[tuple[int, list[int], list[float]]], seed: int, vocab: int = 512
) -> list[Group]:
    """Groups of random token ids: ``(prompt length, response lengths, rewards)`` each."""
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for prompt_length, lengths, rewards in shapes:
        prompt = torch.randint(0, vocab, (prompt_length,), generator=generator)
        responses = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        groups.append(Group(prompt, responses, rewards))
    return groups


def generation_groups() -> list[Group]:
    """One step's four groups (rank ``r`` of two takes groups ``2r`` and ``2r + 1``): their
    token counts and reward spreads differ, so the first round's normaliser and std are not
    the step's, and one group's equal rewards leave it nothing to replay."""
    shapes = [
        (21, [5, 3, 7], [1.0, 0.0, 0.5]),
        (12, [2, 6], [0.3, 0.3]),
        (17, [4, 1, 6, 2], [0.0, 2.0, 0.5, 1.0]),
        (9, [8, 3], [1.0, 0.0]),
    ]
    return random_groups(shapes, seed=7)


GENERATION_CONFIG = ls.GRPOConfig(loss_type="dapo", scale_rewards="batch", gradient="exact")


def train_generation(
    model: torch.nn.Module, adapter: ls.ModelAdapter, groups: list[Group]
) -> dict[str, Any]:
    """The recipes' step over ``groups`` (this rank's): each replayed after its prefill with
    the provisional shares, then ``finish``. Returns the whole gradients (a collective when
    sharded), this rank's part of the loss, its groups' advantages and the correction."""
    config = GENERATION_CONFIG
    batch = ls.GenerationBatch(config, len(groups))
    for k, group in enumerate(groups):
        state = adapter.prefill(group.prompt, chunk_size=CHUNK_SIZE, **config.prefill_options())
        flags = [False] * len(group.responses)
        if batch.add(group.prompt, group.responses, group.rewards, flags) is not None:
            result = ls.grpo_step(
                adapter, group.prompt, group.responses, group.rewards, config=config,
                state=state, chunk_size=CHUNK_SIZE,
                **batch.replay_kwargs(k, batch.advantages(k)),
            )  # fmt: skip
            batch.record(k, result)
    batch.finish(model.parameters())
    return {
        "grads": full_tensors(model, grads=True),
        "loss": batch.step_loss(),
        "advantages": [batch.advantages(k) for k in range(len(groups))],
        "factor": batch.gradient_factor,
    }


def batch_metric_groups() -> list[list[tuple[RewardResult, tuple]]]:
    """Each of two ranks' groups of a step: scored rewards (a NaN row, a constant group) and
    their (prompt tokens, lengths, truncation flags)."""
    nan = float("nan")

    def group(rewards: list[float], lengths: list[int], prompt: int) -> tuple:
        per_func = [[r, nan if math.isnan(r) else 2 * r] for r in rewards]
        scored = RewardResult(["a", "b"], rewards, per_func, prompts=["long " * 9] * 3)
        return scored, (prompt, lengths, [n == 4 for n in lengths])

    return [
        [group([1.0, nan, 0.0], [4, 2, 3], 7), group([0.5, 0.5, 0.5], [1, 4, 4], 5)],
        [group([0.0, 1.0, 1.0], [2, 2, 4], 9)],
    ]


def build(case: Case) -> tuple[torch.nn.Module, ls.ModelAdapter]:
    """The tiny model of ``case`` (float32, same weights in every process) and its adapter."""
    model = tiny_model(case.model_type, seed=0).train()
    if case.lora:
        model = with_lora(model, ["q_proj", "v_proj", "down_proj"], std=0.05, seed=1)
    return model, ls.adapt(model)


def grpo_config(case: Case) -> ls.GRPOConfig:
    return ls.GRPOConfig(
        loss_type=case.loss_type,
        gradient=case.gradient,
        beta=case.beta,
        epsilon=0.2,
        keep_attention_outputs=case.keep_attention_outputs,
    )


def train(
    model: torch.nn.Module,
    adapter: ls.ModelAdapter,
    case: Case,
    groups_of_step,
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """``STEPS`` AdamW steps; each runs ``groups_of_step(step)`` with their loss scales.

    Returns the first step's gradients (whole; a collective when sharded) and the metrics.
    AdamW is blind to a common scale of the gradients, so those are compared too.
    """
    config = grpo_config(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # eps bounds how much AdamW magnifies float32 rounding in tiny gradient entries: an error
    # d in a gradient moves the update by at most lr * d / eps.
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, eps=ADAM_EPS, weight_decay=0.01)
    metrics, first_grads = [], {}
    for step in range(STEPS):
        groups = groups_of_step(step)
        lengths = [[len(r) for r in group.responses] for group in groups]
        for group, scale in zip(groups, group_loss_scales(lengths, config), strict=True):
            group_metrics = ls.grpo_step(
                adapter,
                group.prompt,
                group.responses,
                group.rewards,
                config=config,
                chunk_size=CHUNK_SIZE,
                loss_scale=scale,
                ref_adapter=ls.lora_reference(adapter) if case.beta else None,
            )
            metrics.append(group_metrics.metrics())
        if step == 0:
            first_grads = full_tensors(model, grads=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first_grads, metrics


def full_tensors(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every trainable parameter (or its gradient) whole: a collective when sharded."""
    full = {}
    for name, parameter in model.named_parameters():
        if grads and not parameter.requires_grad:
            continue
        data = parameter.grad if grads else parameter.detach()
        if data is None:  # never used with autograd (GLM's DSA indexer)
            continue
        full[name] = (data.full_tensor() if hasattr(data, "full_tensor") else data).clone()
    return full


def rollout_group(adapter: ls.ModelAdapter, rank: int) -> dict[str, list]:
    """Sampled responses to rank ``rank``'s prompt; many EOS ids end branches early, at
    different steps on each rank (alone, rank 0 stops at its check after step 24, rank 1
    at step 21's: a stop check every 3 steps)."""
    prompt = step_groups(0)[rank].prompt
    state = adapter.prefill(prompt, chunk_size=CHUNK_SIZE)
    out = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=24, eos_token_ids=list(range(0, 512, 6)),
        seed=rank, stop_check_every=3,
    )  # fmt: skip
    return {"responses": [r.tolist() for r in out.responses], "steps": out.stats["steps"]}


def rollout_gathers(adapter: ls.ModelAdapter, rank: int) -> dict[str, Any]:
    """FSDP all-gathers per rollout (counted by the profiler's ``FSDP::all_gather`` ranges)
    for 3 and 9 new tokens, gathering once per rollout and at every decode step, and the
    responses of each."""
    state = adapter.prefill(step_groups(0)[rank].prompt, chunk_size=CHUNK_SIZE)
    counts, responses = {}, {}
    for once in (True, False):
        for tokens in (3, 9):
            adapter.release_parameters()  # every rollout starts from the shards
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = ls.rollout(adapter, state, num_generations=2, max_new_tokens=tokens,
                                 seed=rank, gather_parameters=once)  # fmt: skip
            names = [event.name for event in prof.events()]
            counts[once, tokens] = sum(name.split(" (")[0] == "FSDP::all_gather" for name in names)
            responses[once, tokens] = [r.tolist() for r in out.responses]
    return {"counts": counts, "responses": responses}


def assert_like_one_process(
    sharded: dict,
    model: torch.nn.Module,
    grads: dict[str, torch.Tensor],
    metrics: list[dict[str, float]],
    initial: dict[str, torch.Tensor] | None = None,
) -> None:
    """A two-rank run's saved results (``main``) equal one process's ``train`` over the same
    groups: gradients, parameters, and the last step's metrics summed over the ranks. With
    the ``initial`` parameters, also that trained parameters moved and frozen ones did not."""
    from reference import assert_grads_close

    assert_grads_close(sharded["grads"], grads, rtol=1e-5)
    # A gradient error d moves an AdamW update by at most lr d / eps (``train``). d: the
    # round-off of the same float32 sums at every step, measured at the first (<= 1.2e-7
    # here; at least half an ulp of the largest entry, as the first step may round alike and
    # the second not), twice that for margin, over STEPS steps; plus the weights' float32
    # rounding. (1e-5 flat before: 4.1e-6 measured, so one CPU's rounding from failing.)
    f32 = torch.finfo(torch.float32).eps
    largest = max(float(g.abs().max()) for g in grads.values())
    error = max(float((sharded["grads"][n] - g).abs().max()) for n, g in grads.items())
    error = max(error, f32 / 2 * largest)
    for name, parameter in model.named_parameters():
        expected, got = parameter.detach(), sharded["parameters"][name]
        bound = 2 * STEPS * LEARNING_RATE * error / ADAM_EPS
        bound += 2 * f32 * float(expected.abs().max())
        assert float((got - expected).abs().max()) <= bound, (name, bound)
        if initial is None:
            continue
        moved = (expected - initial[name]).abs().max()
        if name in grads:  # trained: moved far more than the tolerance
            assert moved > 1e-4, name
        else:  # frozen (LoRA's base weights, GLM's DSA indexer): untouched
            assert moved == 0, name
    for key in ("branches_replayed", "completion_tokens"):  # one group per rank
        assert sharded["reduced"][key] == sum(m[key] for m in metrics[-2:]), key
    extremes = sharded["extremes"]
    assert extremes["completion_tokens"] == min(m["completion_tokens"] for m in metrics[-2:])
    assert extremes["branches_replayed"] == max(m["branches_replayed"] for m in metrics[-2:])
    assert extremes["loss"] == sharded["reduced"]["loss"]  # the others: op


def save_gathered(result: object, path: Path) -> None:
    """Every rank's ``result``, in rank order, saved by rank 0 at ``path``."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        torch.save(gathered, path)


def main(out_dir: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    # A collective that no other rank joins fails after a minute instead of half an hour.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    for name in names:
        if name in ("rollout", "rollout-gathers"):
            model, adapter = build(Case("qwen3", "detached"))
            shard_model(adapter)
            rollouts = rollout_group if name == "rollout" else rollout_gathers
            result = rollouts(adapter, rank)
            save_gathered(result, out / f"{name}.pt")
            continue
        if name == "batch-metrics":
            topology = RunTopology(replicas=world_size, replica=rank)
            mine = batch_metric_groups()[rank]
            result = {
                "rewards": topology.reward_metrics([r for r, _ in mine], "group"),
                "rewards-batch": topology.reward_metrics([r for r, _ in mine], "batch"),
                "completions": topology.completion_metrics([c for _, c in mine]),
            }
            save_gathered(result, out / f"{name}.pt")
            continue
        if name == "generation-batch":
            model, adapter = build(Case("qwen3", "exact"))
            shard_model(adapter)
            mine = generation_groups()[2 * rank : 2 * rank + 2]
            save_gathered(train_generation(model, adapter, mine), out / f"{name}.pt")
            continue
        case = CASES[name]
        model, adapter = build(case)
        shard_model(adapter, reshard_after_forward=case.reshard_after_forward)
        grads, metrics = train(
            model, adapter, case, lambda step: spread_groups(step_groups(step), rank, world_size)
        )
        reduced = reduce_metrics(metrics[-1], op="sum")
        # Per-key ops (TRL's minima and maxima over ranks), in the same one gather.
        extremes = reduce_metrics(
            metrics[-1], op="sum", ops={"completion_tokens": "min", "branches_replayed": "max"}
        )
        parameters = full_tensors(model)
        if rank == 0:
            result = {"parameters": parameters, "grads": grads, "reduced": reduced}
            result["extremes"] = extremes
            torch.save(result, out / f"{name}.pt")
    leave_process_group_and_exit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
