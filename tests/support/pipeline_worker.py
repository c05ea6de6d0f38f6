"""GRPO steps on pipeline stages (gloo CPU ranks), saved for comparison with one process.

Run by ``tests/pipeline/test_pipeline.py`` under torchrun::

    python -m torch.distributed.run --standalone --nproc_per_node 4 \\
        tests/support/pipeline_worker.py OUT_DIR STAGES CASE [CASE ...]

The world is ``STAGES`` stages x ``world / STAGES`` replicas; replica ``d`` trains group
``d`` of each step. For every case the ranks score a response before training (no grad),
take ``STEPS`` AdamW steps (grpo_step, gradients averaged over the replicas, clipped by the
whole model's norm), and rank 0 saves every stage's parameters, first-step gradients and
optimizer state under the whole model's names, with the losses and each rank's prefix-state
bytes. Cases marked ``checkpoint`` also save a checkpoint from the stages and load it into
a fresh staged model. ``train_reference`` is the same training in one process, on the whole model; the
test runs it and compares. The ``rollout`` case decodes greedily and with sampling
(``rollout-fsdp``: each stage sharded over the replicas, each replica its own prompt).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from distributed_worker import Group, random_groups
from rank_exit import leave_process_group_and_exit
from reference import with_lora
from torch.distributed.tensor import DTensor

import longstraw_core as ls
from longstraw_core import checkpoint
from longstraw_core.adapters import registry
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import PIPELINE
from longstraw_core.data.tokenizer import load_tokenizer
from longstraw_core.grpo.groups import group_loss_scales
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model
from longstraw_core.parallel.mesh import pipeline_mesh, replica_group, stage_adapter
from longstraw_core.pipeline import average_over_replicas, clip_grad_norm

CHUNK_SIZE = 8
STEPS = 2
LEARNING_RATE = 1e-3
MAX_GRAD_NORM = 0.5  # small enough to clip: the clip's norm must be the whole model's


DENSE_TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA_TARGETS = {"glm_moe_dsa": ["q_b_proj", "kv_b_proj", "o_proj"]}  # not the MoE experts


def _lora_targets(model_type: str) -> list[str]:
    """The few modules LoRA adapts here: ``LORA_TARGETS``, else the dense three if the model
    has them, else its family's defaults."""
    if model_type in LORA_TARGETS:
        return LORA_TARGETS[model_type]
    defaults = registry.default_lora_targets()[model_type]
    return DENSE_TARGETS if set(DENSE_TARGETS) <= set(defaults) else defaults


@dataclass(frozen=True)
class Case:
    model_type: str
    gradient: str
    lora: bool = False
    beta: float = 0.0
    starts: tuple[int, ...] | None = None  # each stage's first layer (None: balanced)
    keep_attention_outputs: bool = False
    activation_checkpointing: bool = False
    layers: int = 4
    offload: str | None = None  # "cpu": every record in host memory, streamed per layer
    checkpoint: bool = False  # save a staged checkpoint at the end and load it back
    fsdp: bool = False  # FSDP2 shards each stage over its replicas (which then average)
    temperature: float = 1.0  # GRPOConfig.temperature: the last stage's head divides by it
    pieces: int | None = None  # pieces per replayed branch (None: the schedule's choice)
    loss_masks: bool = False  # tool masks (TRL's tool_mask) inside the responses
    config: tuple[tuple[str, object], ...] = ()  # the tiny config's overrides (tiny_model)


WINDOW = 6
SLIDING_QWEN3 = (
    ("use_sliding_window", True),
    ("sliding_window", WINDOW),
    (
        "layer_types",
        ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
    ),
)
SLIDING_QWEN2 = (("use_sliding_window", True), ("sliding_window", WINDOW), ("max_window_layers", 1))

CASES = {
    "qwen3-detached": Case("qwen3", "detached"),
    "qwen3-exact": Case("qwen3", "exact", temperature=0.7),
    "qwen3-lora-exact": Case("qwen3", "exact", lora=True, checkpoint=True),
    "qwen3-lora-kl-detached": Case("qwen3", "detached", lora=True, beta=0.04, temperature=1.6),
    # Loss masks: every third token a tool's, replayed but out of the loss (last stage's).
    "qwen3-lora-kl-exact-masks": Case(
        "qwen3", "exact", lora=True, beta=0.04, loss_masks=True, starts=(0, 2)
    ),
    "qwen3-exact-kept-checkpointed": Case(
        "qwen3", "exact", keep_attention_outputs=True, activation_checkpointing=True
    ),
    "qwen3_5_text-detached": Case("qwen3_5_text", "detached"),
    "qwen3_5_text-exact": Case("qwen3_5_text", "exact"),
    "qwen3_5_text-lora-exact": Case("qwen3_5_text", "exact", lora=True, checkpoint=True),
    # Stage 1 starts at a layer that reuses layer 2's DSA selection: it crosses the boundary.
    "qwen3_5_text-exact-offloaded": Case("qwen3_5_text", "exact", offload="cpu"),
    # One piece per branch: one process's replay arithmetic, also where the model computes
    # in float32 inside (the delta rule, the MoE router), so the numbers match to 1e-6.
    "qwen3_5_text-exact-one-piece": Case("qwen3_5_text", "exact", pieces=1),
    "glm_moe_dsa-exact": Case("glm_moe_dsa", "exact", starts=(0, 3), pieces=1),
    "glm_moe_dsa-lora-detached": Case("glm_moe_dsa", "detached", lora=True),
    "glm_moe_dsa-exact-4": Case("glm_moe_dsa", "exact"),
    # FSDP2 across the replicas of each stage (S=2 x D=2): replicas pad with idle passes.
    "qwen3-exact-fsdp": Case("qwen3", "exact", fsdp=True),
    "qwen3_5_text-lora-exact-fsdp": Case(
        "qwen3_5_text", "exact", lora=True, fsdp=True, checkpoint=True
    ),
    "glm_moe_dsa-lora-kl-detached-fsdp": Case(
        "glm_moe_dsa", "detached", lora=True, beta=0.04, fsdp=True, temperature=0.7
    ),
    # Sliding-window layers (``kinds.window``) of width 6, shorter than a chunk (8): a fixed
    # window per layer on each stage, its chunk-start checkpoints in the exact sweep; qwen3
    # with full attention between window layers, qwen2 with its first layer full.
    "qwen3-sliding-exact": Case("qwen3", "exact", config=SLIDING_QWEN3),
    "qwen2-sliding-lora-detached": Case("qwen2", "detached", lora=True, config=SLIDING_QWEN2),
}
# Every other registered family (one declared since, or in a test): exact and LoRA-detached
# runs on S=2 (``test_pipeline.TOPOLOGIES[2, 2]`` runs every case).
for _type in probe_types(PIPELINE):
    if not any(case.model_type == _type for case in CASES.values()):
        CASES[f"{_type}-exact"] = Case(_type, "exact")
        CASES[f"{_type}-lora-detached"] = Case(_type, "detached", lora=True)


def step_groups(step: int, count: int) -> list[Group]:
    """The first ``count`` (1 or 2) groups of step ``step``: prompts of 2 to 5 chunks of 8
    (long enough for GLM's sparse DSA selection); one reward at the mean, and at step 1 a
    group of equal rewards, leave branches out of the replay."""
    shapes = [
        [(29, [5, 3, 7, 2], [1.0, 0.0, 0.4, 0.2]), (21, [4, 6], [0.0, 1.0])],
        [(37, [3, 5, 4], [0.2, 0.9, 0.0]), (10, [6, 2, 4], [0.5, 0.5, 0.5])],
    ][step]
    return random_groups(shapes, seed=100 + step)[:count]


def loss_masks(case: Case, group: Group) -> list[list[int]] | None:
    """The responses' loss masks for ``case.loss_masks``: 0 on every third token."""
    if not case.loss_masks:
        return None
    return [[int(t % 3 != 1) for t in range(len(r))] for r in group.responses]


def loss_tokens(case: Case, group: Group) -> list[int]:
    """What the step's token normaliser counts of each response: its masked-in tokens."""
    masks = loss_masks(case, group)
    return [len(r) for r in group.responses] if masks is None else [sum(m) for m in masks]


def build(case: Case) -> tuple[torch.nn.Module, ls.ModelAdapter]:
    """The tiny model of ``case`` in float64 (the same weights in every process)."""
    overrides = {
        key: list(value) if isinstance(value, tuple) else value for key, value in case.config
    }
    model = tiny_model(
        case.model_type, dtype=torch.float64, seed=0, num_hidden_layers=case.layers, **overrides
    )
    model.train()
    if case.lora:
        model = with_lora(model, _lora_targets(case.model_type), std=0.05, seed=1)
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = case.activation_checkpointing
    return model, adapter


def grpo_config(case: Case) -> ls.GRPOConfig:
    return ls.GRPOConfig(
        loss_type="dapo",
        gradient=case.gradient,
        beta=case.beta,
        epsilon=0.2,
        keep_attention_outputs=case.keep_attention_outputs,
        temperature=case.temperature,
    )


def probe_logps(adapter: ls.ModelAdapter, temperature: float) -> torch.Tensor:
    """No-grad log-probs of a response to step 0's first prompt, at ``temperature``."""
    group = step_groups(0, 1)[0]
    with torch.no_grad():
        state = adapter.prefill(group.prompt, chunk_size=CHUNK_SIZE)
        return adapter.score(state, group.responses[0], temperature=temperature)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=LEARNING_RATE, eps=1e-8, weight_decay=0.01)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, gathered whole when FSDP shards it (collective)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Parameters and AdamW state by parameter name (this stage's share, whole)."""
    state = {}
    for name, parameter in model.named_parameters():
        entry = {"value": whole(parameter)}
        for key, value in optimizer.state.get(parameter, {}).items():
            entry[key] = whole(value) if torch.is_tensor(value) else value
        state[name] = entry
    return state


def place(case: Case, adapter: ls.ModelAdapter, mesh) -> None:
    """Put ``adapter`` on its stage, and shard that over the replicas for FSDP cases."""
    stage_adapter(adapter, mesh, starts=case.starts, replay_pieces=case.pieces)
    if case.fsdp:
        shard_model(adapter, mesh=mesh["replica"], mixed_precision="fp32")


def train_reference(case: Case, replicas: int) -> dict:
    """One process, the whole model: the same steps over every replica's group."""
    model, adapter = build(case)
    logps = probe_logps(adapter, case.temperature)
    optimizer, config = optimizer_for(model), grpo_config(case)
    losses, first_grads = [], {}
    for step in range(STEPS):
        groups = step_groups(step, replicas)
        lengths = [loss_tokens(case, group) for group in groups]
        for group, scale in zip(groups, group_loss_scales(lengths, config), strict=True):
            result = ls.grpo_step(
                adapter, group.prompt, group.responses, group.rewards, config=config,
                chunk_size=CHUNK_SIZE, loss_scale=scale, loss_masks=loss_masks(case, group),
                ref_adapter=ls.lora_reference(adapter) if case.beta else None,
            )  # fmt: skip
            losses.append(result.loss)
        trainable = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        if step == 0:
            first_grads = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "logps": logps,
        "losses": losses,
        "grads": first_grads,
        "state": by_name(model, optimizer),
    }


def reload_staged(case: Case, mesh, directory: Path, saved: dict) -> bool:
    """A fresh staged model and optimizer loaded from ``directory`` hold exactly ``saved``
    (this rank's ``by_name`` after training)."""
    model, adapter = build(case)
    place(case, adapter, mesh)
    optimizer = optimizer_for(model)
    checkpoint.load_checkpoint(directory, model, optimizer, restore_rng=False)
    loaded = by_name(model, optimizer)
    return loaded.keys() == saved.keys() and all(
        torch.equal(loaded[name][key], value)
        if torch.is_tensor(value)
        else loaded[name][key] == value
        for name, entry in saved.items()
        for key, value in entry.items()
    )


def train_staged(case: Case, stages: int, out: Path | None = None) -> dict:
    """This rank's stage of the same training; returns what rank 0 saves (on every rank)."""
    mesh = pipeline_mesh(stages)
    replicas, replica = mesh.size(0), mesh.get_local_rank(0)
    model, adapter = build(case)
    place(case, adapter, mesh)
    logps = probe_logps(adapter, case.temperature)
    adapter.release_parameters()  # FSDP: the sharded parameters, for the optimizer to hold
    optimizer, config = optimizer_for(model), grpo_config(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses, first_grads, state_bytes = [], {}, 0
    for step in range(STEPS):
        group = step_groups(step, replicas)[replica]
        (scale,) = group_loss_scales([loss_tokens(case, group)], config, group=replica_group(mesh))
        state = adapter.prefill(
            group.prompt, chunk_size=CHUNK_SIZE, offload=case.offload, **config.prefill_options()
        )
        state_bytes = max(state_bytes, state.nbytes())
        result = ls.grpo_step(
            adapter, group.prompt, group.responses, group.rewards, config=config, state=state,
            chunk_size=CHUNK_SIZE, loss_scale=scale, loss_masks=loss_masks(case, group),
            ref_adapter=ls.lora_reference(adapter) if case.beta else None,
        )  # fmt: skip
        losses.append((replica, step, result.loss))
        if case.fsdp:  # FSDP averaged over the replicas; each rank holds a shard
            clip_grad_norm(trainable, MAX_GRAD_NORM, dist.group.WORLD)
        else:
            average_over_replicas(trainable, replica_group(mesh))
            clip_grad_norm(trainable, MAX_GRAD_NORM, mesh.get_group(1))
        if step == 0:
            first_grads = {
                n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine = {
        "logps": logps, "losses": losses, "grads": first_grads,
        "state": by_name(model, optimizer), "state_bytes": state_bytes,
        "layers": list(adapter.owned_layers()),
    }  # fmt: skip
    if case.checkpoint and out is not None:  # the stages write one whole-model checkpoint
        saved = checkpoint.save_checkpoint(out, STEPS, model, optimizer, data_position=STEPS)
        mine["reloaded"] = reload_staged(case, mesh, saved, mine["state"])
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return merge(everyone, replicas)


def merge(parts: list[dict], replicas: int) -> dict:
    """Every stage's share under the whole model's names (replica 0's stages: replicas are
    equal after the gradient average, which the test checks through ``replica_states``)."""
    stages = len(parts) // replicas
    first = parts[:stages]
    merged = {
        "logps": [part["logps"] for part in parts],
        "losses": sorted({loss for part in parts for loss in part["losses"]}),
        "grads": {k: v for part in first for k, v in part["grads"].items()},
        "state": {k: v for part in first for k, v in part["state"].items()},
        "state_bytes": [part["state_bytes"] for part in parts],
        "layers": [part["layers"] for part in parts],
        "reloaded": [part.get("reloaded") for part in parts],
        "replica_states": [
            {
                k: v
                for part in parts[d * stages : (d + 1) * stages]
                for k, v in part["state"].items()
            }
            for d in range(replicas)
        ],
    }
    return merged


STOP_STRINGS = [chr(c) for c in range(ord("a"), ord("z") + 1)]  # any lower-case letter


class ScriptedTurns:
    """An agent's environment in miniature: every branch's first ended turn is answered with
    ``reply``, ready only ``row + 2`` calls of ``ended_turns`` later (``rollout``'s
    ``TurnHandler``): branches wait different numbers of steps, on stages and on one process
    alike, and the responses must not depend on it."""

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.answered, self.due, self.calls = reply, set(), {}, 0

    def begin_turns(self, turns: dict[int, list[int]]) -> None:
        for row in turns:
            answer = [] if row in self.answered else self.reply
            self.answered.add(row)
            self.due[row] = (self.calls + row + 2, answer)

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        self.calls += 1
        if wait and self.due:
            self.calls = max(self.calls, min(due for due, _ in self.due.values()))
        ready = {row: answer for row, (due, answer) in self.due.items() if due <= self.calls}
        for row in ready:
            del self.due[row]
        return ready


def rollouts(adapter: ls.ModelAdapter, prompt: torch.Tensor) -> dict:
    """Greedy and sampled rollouts of ``prompt`` (the sampled ones end at varied lengths)."""
    state = adapter.prefill(prompt, chunk_size=CHUNK_SIZE)
    greedy = ls.rollout(adapter, state, num_generations=2, max_new_tokens=10, temperature=0)
    sampled = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=10, eos_token_ids=list(range(0, 512, 5)),
        seed=7,
    )  # fmt: skip
    # The generation options on the last stage: the repetition penalty reads the prompt every
    # stage holds, and every stage checks the stop strings on the tokens it receives.
    options = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=10, seed=7, top_k=40, min_p=0.05,
        repetition_penalty=1.3, stop_strings=STOP_STRINGS, tokenizer=load_tokenizer(None),
    )  # fmt: skip
    # An agent's turns: on stages the last stage, which samples, feeds the replies.
    turns = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=12, eos_token_ids=list(range(0, 512, 5)),
        seed=7, turns=ScriptedTurns([300, 301, 5]),
    )  # fmt: skip
    return {
        "turns": [r.tolist() for r in turns.responses],
        "turns_masks": [m.tolist() for m in turns.loss_masks],
        "turns_logps": [lp.tolist() for lp in turns.logps],
        "greedy": [r.tolist() for r in greedy.responses],
        "sampled": [r.tolist() for r in sampled.responses],
        "sampled_logps": [lp.tolist() for lp in sampled.logps],
        "options": [r.tolist() for r in options.responses],
        "options_logps": [lp.tolist() for lp in options.logps],
        "options_truncated": options.truncated,
    }


def rollout_case(stages: int, fsdp: bool = False) -> dict:
    """Rollouts of a tiny qwen3 on the stages. With ``fsdp``, each stage is sharded over the
    replicas and replica ``d`` decodes its own prompt (``step_groups(0, D)[d]``): the
    replicas stay in step until the last branch of any of them ends. Returns each replica's."""
    mesh = pipeline_mesh(stages)
    case = Case("qwen3", "detached", fsdp=fsdp)
    _, adapter = build(case)
    place(case, adapter, mesh)
    replicas, replica = mesh.size(0), mesh.get_local_rank(0)
    mine = rollouts(adapter, step_groups(0, replicas)[replica].prompt)
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"replicas": everyone[::stages]}


def main(out_dir: str, stages: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    # A transfer or collective that no other rank joins fails after two minutes, not thirty.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out = Path(out_dir)
    for name in names:
        run = f"{name}-S{stages}-W{dist.get_world_size()}"
        if name.startswith("rollout"):
            result = rollout_case(stages, fsdp=name == "rollout-fsdp")
        else:
            result = train_staged(CASES[name], stages, out / f"checkpoint-{run}")
        if dist.get_rank() == 0:
            torch.save(result, out / f"{run}.pt")
    leave_process_group_and_exit()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
