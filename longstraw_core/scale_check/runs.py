"""The paper's configurations as dry runs, and their comparison with the planner.

Why: each configuration's stages are run one at a time (``stage_run.run_stage``, in stage
order: a stage receives what the previous one sent) and each stage's tracked peak is set
beside the planner's prediction for that stage (``plan.pipeline_plan``, with the same
layout, on the CPU kernels the fake run executes) and beside the GPU budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from longstraw_core.config import load_config
from longstraw_core.plan import pipeline_plan
from longstraw_core.plan.chunking import resolve_chunk
from longstraw_core.plan.model import ModelSpec
from longstraw_core.plan.sources import preset_config, workload_from_config
from longstraw_core.plan.stages import layout_for
from longstraw_core.scale_check.stage_run import run_stage

TOLERANCE = 0.10  # the target: each stage's tracked peak within 10% of the planner's


@dataclass(frozen=True)
class DryRun:
    """One configuration: a run config, the preset whose dimensions it uses, and changes
    (``overrides``: config keys; ``model``: transformers config fields, e.g. fewer layers)."""

    name: str
    config: str
    preset: str
    overrides: tuple[str, ...] = ()
    model: tuple[tuple[str, Any], ...] = ()
    rollout_tokens: int = 4


QWEN = "configs/qwen36/27b_lora_grpo_8stages.yaml"
GLM = "configs/glm52/lora_grpo_32stages.yaml"
GPT_OSS_20B = "configs/gpt_oss/20b_lora_grpo_2stages.yaml"
PAPER: tuple[DryRun, ...] = (
    DryRun("qwen36-27b-lora-2.1M", QWEN, "Qwen3.6-27B"),
    # exact mode at 4.46M needs 16 stages (dS alone is 64 GiB a stage): the paper's stress
    # run, like all of the paper's, is detached
    DryRun(
        "qwen36-27b-lora-4.46M",
        QWEN,
        "Qwen3.6-27B",
        ("data.prompt_tokens=4460000", "grpo.gradient=detached"),
    ),
    DryRun("qwen36-27b-qlora-2.1M", QWEN, "Qwen3.6-27B", ("model.quantization=nf4",)),
    DryRun("glm52-lora-2.1M", GLM, "GLM-5.2"),
    # 2 stages of 80 GiB: 129,024 + 2,048 = 131,072 positions, gpt-oss' longest context
    DryRun("gpt-oss-20b-lora-128K", GPT_OSS_20B, "gpt-oss-20b"),
)


@dataclass
class StageRow:
    """One stage: tracked and planned peaks (bytes), and how they compare."""

    stage: int
    layers: list[int]
    tracked: int
    planned: int
    tracked_phases: dict[str, int]
    planned_phases: dict[str, int]
    seconds: float
    params: int  # tracked bytes of its parameters (and 4-bit weights' state)

    @property
    def error(self) -> float:
        return (self.tracked - self.planned) / self.planned


def _prepare(run: DryRun) -> tuple[Any, Any, ModelSpec, Any, Any]:
    """``run``'s config, transformers config, spec, workload and stage layout."""
    cfg = load_config(run.config, ["model.path=" + run.preset, *run.overrides], check_paths=False)
    config = preset_config(run.preset)
    for key, value in run.model:
        setattr(config, key, value)
    positions = cfg.data.prompt_tokens + cfg.rollout.max_new_tokens
    config.max_position_embeddings = max(config.max_position_embeddings, positions)
    spec = ModelSpec.from_config(config, run.name, _dtype(cfg.model.dtype))
    work = resolve_chunk(
        spec, workload_from_config(cfg, device="cuda", model_type=config.model_type)
    )
    cfg.train.chunk_size = work.chunk_size  # train.chunk_size: null: the planner's choice
    layout = layout_for(spec, work)
    # the dry run's rewards give every branch an advantage: all G replay
    starts = tuple(layout.boundaries[:-1])
    work = dataclasses.replace(work, stage_starts=starts, replay_branches=work.group)
    return cfg, config, spec, work, layout


def worst_stages(run: DryRun) -> list[int]:
    """The first stage of each kind (the same layers, the same ends: embeddings, head):
    the kind's worst. A pipeline's earlier stages run more forwards ahead (stage ``s`` of
    ``S`` holds up to ``P + min(P, 3)(S - 1 - s)`` replay pieces, ``S - s`` sweep chunks),
    so among stages of one kind the first holds the most; the planner counts the same
    (``pieces.most_held``, ``waiting_chunks``)."""
    _, _, spec, _, layout = _prepare(run)
    first: dict[str, int] = {}
    for stage in range(layout.stages):
        first.setdefault(_kind(spec, layout, stage), stage)
    return sorted(first.values())


def run_config(
    run: DryRun, stages: Sequence[int] | None = None, say: Callable[[str], object] | None = None
) -> dict[str, Any]:
    """Stages ``stages`` of ``run`` (None: every one), each run at its own place in the
    pipeline; ``say`` gets a line per phase of each stage run. A stage receives what its
    schedule's plan says the others send, so each runs alone."""
    cfg, config, spec, work, layout = _prepare(run)
    plan = pipeline_plan(spec, work)
    wanted = range(layout.stages) if stages is None else sorted(stages)
    rows = []
    for stage in wanted:
        result = run_stage(cfg, config, layout, stage, rollout_tokens=run.rollout_tokens, say=say)
        planned = plan.stage_plans[stage]
        rows.append(StageRow(stage, list(layout.layers_of(stage)), result.peak,
                             planned.peak, result.phases, dict(planned.phases),
                             result.seconds, result.params_bytes))  # fmt: skip
    budget = work.budget
    return {
        "name": run.name,
        "config": run.config,
        "overrides": list(run.overrides),
        "prompt_tokens": cfg.data.prompt_tokens,
        "group": cfg.rollout.num_generations,
        "response_tokens": cfg.rollout.max_new_tokens,
        "rollout_tokens": run.rollout_tokens,
        "chunk_size": cfg.train.chunk_size,
        "stages": layout.stages,
        "budget": budget,
        "rows": [dataclasses.asdict(row) | {"error": row.error} for row in rows],
        "within_plan": all(abs(row.error) <= TOLERANCE for row in rows),
        "within_budget": budget is None or all(row.tracked <= budget for row in rows),
    }


def _kind(spec: ModelSpec, layout: Any, stage: int) -> str:
    """What decides a stage's work: its layers' specs, and whether it holds the embeddings
    (first) or the head (last)."""
    layers = [spec.layers[i] for i in layout.layers_of(stage)]
    return repr((layers, stage == 0, stage == layout.stages - 1))


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def table(result: dict[str, Any]) -> str:
    """A text table of one run: per stage, tracked and planned peaks (GiB) and the error."""
    gib = 2**30
    lines = [
        f"{result['name']}: {result['prompt_tokens']:,} positions, G={result['group']}, "
        f"{result['stages']} stages, budget {result['budget'] / gib:.1f} GiB",
        f"{'stage':>5} {'layers':>9} {'tracked GiB':>12} {'planned GiB':>12} {'error':>7} "
        f"{'peak phase':>10} {'s':>7}",
    ]
    for row in result["rows"]:
        phases = row["tracked_phases"]
        lines.append(
            f"{row['stage']:>5} {row['layers'][0]:>4}-{row['layers'][-1]:<4} "
            f"{row['tracked'] / gib:>12.2f} {row['planned'] / gib:>12.2f} "
            f"{row['error']:>+7.1%} {max(phases, key=phases.get):>10} {row['seconds']:>7.0f}"
        )
    return "\n".join(lines)
