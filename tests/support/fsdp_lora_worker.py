"""A LoRA rollout on a bfloat16 base sharded over two ranks (FSDP2, gloo on CPU).

Run by ``tests/distributed/test_fsdp_lora.py`` under torchrun::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/support/fsdp_lora_worker.py OUT_DIR

For each tiny family with LoRA on its recipe's default targets (peft keeps the adapters
float32 over the bfloat16 base, as ``model.dtype: bfloat16`` runs) and each mixed-precision
policy, each rank prefills its own prompt and samples a group, gathering once per rollout
(the default). Rank 0 writes, for every rank: the FSDP2 all-gathers each pass of the rollout
made (counted as they run: ``AllGathers``), the dtypes LoRA computed in per layer, the
modules sharded apart from their layer, and the sampled responses and log-probs. Then one
exact-mode ``grpo_step`` per rank on the Qwen3.6 toy (rank ``r`` takes group ``r`` of
``distributed_worker.step_groups(0)``) under each policy: the LoRA gradients, whole.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed_worker import Case as StepCase
from distributed_worker import full_tensors, grpo_config, step_groups
from rank_exit import leave_process_group_and_exit
from reference import with_lora
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.grpo.groups import group_loss_scales, spread_groups
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model

FAMILIES = ("qwen3_5_text", "glm_moe_dsa")
POLICIES = ("bf16", "fp32")
CHUNK_SIZE = 8
NEW_TOKENS = 6
# Per FSDP2 all-gather: the op packing the unit's shards into one buffer, then the process
# group's all-gather (``_fsdp_collectives.foreach_all_gather``, torch 2.13).
ALL_GATHER_OPS = ("fsdp.all_gather_copy_in", "c10d._allgather_base_")


class AllGathers(TorchDispatchMode):
    """Counts the all-gather ops dispatched while it is active (it changes nothing: every
    op runs as it would)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: tuple, args: tuple = (), kwargs: Any = None
    ) -> Any:
        name = str(func.overloadpacket)
        if name in ALL_GATHER_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def build(model_type: str) -> tuple[torch.nn.Module, ls.ModelAdapter]:
    """The tiny ``model_type`` in bfloat16 with LoRA (float32, peft's default) on the default
    targets; the same weights in every process."""
    model = tiny_model(model_type, dtype=torch.bfloat16, seed=0).train()
    targets = list(registry.default_lora_targets()[model_type])
    model = with_lora(model, targets, std=0.05, seed=1)
    return model, ls.adapt(model)


def prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, 512, (13 + 6 * rank,), generator=torch.Generator().manual_seed(rank))


def record_lora_dtypes(model: torch.nn.Module) -> dict[int, set[tuple[str, str]]]:
    """Hooks on every LoRA A and B: per decoder layer, the (input, weight) dtypes of their
    forwards (the weight as the forward sees it: gathered, and cast by the policy)."""
    seen: dict[int, set[tuple[str, str]]] = {}
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)\..*\.lora_[AB]\.default$", name)
        if match is None:
            continue
        index = int(match.group(1))

        def hook(module: torch.nn.Module, args: tuple, index: int = index) -> None:
            seen.setdefault(index, set()).add((str(args[0].dtype), str(module.weight.dtype)))

        module.register_forward_pre_hook(hook)
    return seen


def counted_passes(adapter: ls.ModelAdapter, counter: AllGathers) -> list[int]:
    """The FSDP2 all-gathers of each outermost pass ``adapter`` runs from now on."""
    run_model: Callable[[Callable[[], Any]], Any] = adapter.parallel.run_model
    passes: list[int] = []
    depth = [0]

    def counting(fn: Callable[[], Any]) -> Any:
        before = counter.counts["fsdp.all_gather_copy_in"]
        depth[0] += 1
        try:
            return run_model(fn)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                passes.append(counter.counts["fsdp.all_gather_copy_in"] - before)

    adapter.parallel.run_model = counting
    return passes


def run(model_type: str, policy: str, rank: int) -> dict[str, Any]:
    model, adapter = build(model_type)
    dtypes = record_lora_dtypes(model)
    shard_model(adapter, mixed_precision=policy)
    counter = AllGathers()
    state = adapter.prefill(prompt(rank), chunk_size=CHUNK_SIZE)
    adapter.release_parameters()
    dtypes.clear()  # the rollout's own LoRA forwards
    passes = counted_passes(adapter, counter)
    with counter:
        out = ls.rollout(adapter, state, num_generations=2, max_new_tokens=NEW_TOKENS, seed=rank)
    return {
        "passes": passes,
        "ops": dict(counter.counts),
        "lora_dtypes": {index: sorted(pairs) for index, pairs in dtypes.items()},
        "apart": sum(len(inner) for inner in adapter.parallel.layers.values()),
        "responses": [r.tolist() for r in out.responses],
        "logps": [logp.clone() for logp in out.logps],
    }


STEP_CASE = StepCase("qwen3_5_text", "exact", lora=True)


def step(policy: str, rank: int) -> dict[str, torch.Tensor]:
    """One sharded ``grpo_step`` of this rank's group; the whole LoRA gradients (collective)."""
    model, adapter = build(STEP_CASE.model_type)
    shard_model(adapter, mixed_precision=policy)
    config = grpo_config(STEP_CASE)
    (group,) = spread_groups(step_groups(0), rank, dist.get_world_size())
    (scale,) = group_loss_scales([[len(r) for r in group.responses]], config)
    ls.grpo_step(
        adapter, group.prompt, group.responses, group.rewards, config=config,
        chunk_size=CHUNK_SIZE, loss_scale=scale,
    )  # fmt: skip
    return full_tensors(model, grads=True)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results = {
        (model_type, policy): run(model_type, policy, rank)
        for model_type in FAMILIES
        for policy in POLICIES
    }
    for policy in POLICIES:
        results["step", policy] = step(policy, rank)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, Path(out_dir) / "fsdp-lora.pt")
    leave_process_group_and_exit()


if __name__ == "__main__":
    main(sys.argv[1])
