"""What to change when a step does not fit, and the check the recipes run before loading.

Built on the pure ``core``: every fix it tries is a ``compute_plan`` of a changed workload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from longstraw_core.kinds.registry import kind, kinds
from longstraw_core.offload import OffloadPolicy, placement_fields
from longstraw_core.plan.chunking import auto_chunk
from longstraw_core.plan.core import MemoryPlan, compute_plan
from longstraw_core.plan.model import ModelSpec, Workload
from longstraw_core.plan.sources import plan_for_config
from longstraw_core.plan.units import human_bytes

CHUNK_CHOICES = tuple(2**k for k in range(8, 17))  # 256 .. 65536: the chunks advice tries


class MemoryPlanError(RuntimeError):
    """The predicted peak does not fit the budget; the message says what to change."""

    def __init__(self, message: str, plan: MemoryPlan) -> None:
        super().__init__(message)
        self.plan = plan


@dataclass(frozen=True)
class Fix:
    """A change that makes the step fit, with its config keys and the plan it gives."""

    label: str
    keys: str
    plan: MemoryPlan


def plan_memory(spec: ModelSpec, work: Workload) -> MemoryPlan:
    """Predict the per-rank memory of one GRPO step of ``work`` on ``spec``, with advice."""
    plan = compute_plan(spec, work)
    plan.advice = advice_for(plan)
    return plan


def advice_for(plan: MemoryPlan) -> list[str]:
    """What to change: the largest chunk that fits, offload when the state does not fit;
    first, the chunk the planner chose and why (``train.chunk_size: null``)."""
    work = plan.work
    advice = [auto_chunk(plan.spec, work).note()] if work.chunk_auto else []
    if plan.budget is None:
        return [
            *advice,
            "no GPU memory budget (memory.gpu_mem / --gpu-mem): nothing to check against",
        ]
    if plan.cpu_bytes:
        ranks = min(work.gpus, 8)
        advice.append(
            f"CPU memory for the offloaded state: {human_bytes(plan.cpu_bytes)} per rank, "
            f"{human_bytes(plan.cpu_bytes * ranks)} for {ranks} ranks on a node"
        )
    advice += _rollout_streaming_advice(plan)
    if plan.fits:
        chunk = None if work.chunk_auto else largest_chunk(plan.spec, work)
        if chunk is not None:
            advice.append(
                f"train.chunk_size={chunk} is the largest chunk that fits (configured: "
                f"{work.chunk_size}; larger chunks mean fewer prefill passes)"
            )
        advice += _keep_outputs_advice(plan)
        return advice
    fixes = fixes_for(plan)
    if fixes:
        advice += [f"{fix.label}: {fix.keys} (peak {human_bytes(fix.plan.peak)})" for fix in fixes]
    else:
        advice.append(_no_fix(plan))
    return advice


def _keep_outputs_advice(plan: MemoryPlan) -> list[str]:
    """Exact mode with room to spare: say that keeping the attention outputs fits too (the
    sweep then skips its attention forward), and what it costs."""
    work = plan.work
    if work.gradient != "exact" or work.keep_attention_outputs:
        return []
    trial = compute_plan(plan.spec, dataclasses.replace(work, keep_attention_outputs=True))
    lines = [line for line in trial.lines if line.name == "kept attention outputs"]
    if not lines or not trial.fits:
        return []
    (kept,) = lines
    where = f"{human_bytes(kept.device)} kept"
    if kept.cpu:
        where = f"{human_bytes(kept.cpu)} kept in CPU memory"
    return [
        f"grpo.keep_attention_outputs=true also fits (peak {human_bytes(trial.peak)}; {where}): "
        "the sweep skips its attention forward"
    ]


def _rollout_streaming_advice(plan: MemoryPlan) -> list[str]:
    """With offloaded state, every decode step streams it to the GPU: say how much, since
    that traffic, not compute, then sets the rollout's pace."""
    work = plan.work
    if not (work.rollout and work.offload is not None and work.offload.active):
        return []
    spec = plan.stage_plans[plan.stage].spec if plan.per_stage else plan.spec  # its stage's
    per_step = sum(
        layer.state_at(work.stored) for layer in spec.layers if work.offloads(layer.record)
    )
    if not per_step:
        return []
    return [
        f"rollout: every decode step streams the offloaded state to the GPU, {human_bytes(per_step)} "
        f"a step, {human_bytes(per_step * work.response_tokens)} for {work.response_tokens} new "
        "tokens (host-to-device bandwidth sets the rollout's pace)"
    ]


def largest_chunk(spec: ModelSpec, work: Workload) -> int | None:
    """The largest power-of-two chunk (256 .. 65536, at most the prompt) that fits."""
    ceiling = max(CHUNK_CHOICES[0], work.stored)
    for chunk in sorted(CHUNK_CHOICES, reverse=True):
        if chunk > ceiling and chunk != CHUNK_CHOICES[0]:
            continue
        if compute_plan(spec, dataclasses.replace(work, chunk_size=chunk)).fits:
            return chunk
    return None


def _offload_options(spec: ModelSpec, work: Workload) -> list[tuple[OffloadPolicy, str]]:
    """(offload policy, where exact mode's checkpoints go) to try, least disruptive first:
    the growing state's layer types to CPU streaming two layers, the recurrent
    checkpoints to CPU too, one streamed layer, then every layer type."""
    base = work.offload or OffloadPolicy()
    growing = {layer.record for layer in spec.layers if layer.state_per_token}
    changes = {kind(name).offload: "cpu" for name in sorted(growing)}
    checkpoints = work.gradient == "exact" and any(layer.checkpoint for layer in spec.layers)
    options = [(base.replace(**changes, resident_layers=2), work.checkpoints)]
    if checkpoints:
        options.append((options[0][0], "cpu"))
    last = "cpu" if checkpoints else work.checkpoints
    options.append((base.replace(**changes, resident_layers=1), last))
    options.append((OffloadPolicy.cpu(resident_layers=1), last))
    return [option for option in options if _offloads_more(option, work)]


def _offloads_more(option: tuple[OffloadPolicy, str], work: Workload) -> bool:
    """Whether ``option`` keeps less on the device than the workload already does."""
    policy, checkpoints = option
    current = work.offload or OffloadPolicy()
    if any(getattr(policy, name) != "cpu" for name in current.offloaded_fields()):
        return False
    if checkpoints != "cpu" and work.checkpoints == "cpu":
        return False
    if current.active and policy.resident_layers > current.resident_layers:
        return False
    return (policy, checkpoints) != (work.offload, work.checkpoints)


def fixes_for(plan: MemoryPlan) -> list[Fix]:
    """Changes that make ``plan`` fit: dropping the kept attention outputs, a smaller chunk,
    offload, or both (best first)."""
    spec, work = plan.spec, plan.work
    fixes = []
    if work.keep_attention_outputs and work.gradient == "exact":
        trial = dataclasses.replace(work, keep_attention_outputs=False)
        fixed = compute_plan(spec, trial)
        if fixed.fits:
            saves = human_bytes(plan.peak - fixed.peak)
            label = f"do not keep attention outputs (saves {saves}; a slower sweep)"
            fixes.append(Fix(label, "grpo.keep_attention_outputs=false", fixed))
    chunk = largest_chunk(spec, work)
    if chunk is not None and chunk < work.chunk_size:
        fixed = compute_plan(spec, dataclasses.replace(work, chunk_size=chunk))
        saves = human_bytes(plan.peak - fixed.peak)
        label = f"set train.chunk_size={chunk} (saves {saves})"
        fixes.append(Fix(label, f"train.chunk_size={chunk}", fixed))
    for policy, checkpoints in _offload_options(spec, work):
        trial = dataclasses.replace(work, offload=policy, checkpoints=checkpoints)
        keys = offload_keys(policy)
        if checkpoints != work.checkpoints:
            keys += f" grpo.recurrent_checkpoints={checkpoints}"
        fixed = compute_plan(spec, trial)
        if not fixed.fits:
            chunk = largest_chunk(spec, trial)
            if chunk is None or (fixes and chunk <= fixes[0].plan.work.chunk_size):
                continue  # no better than changing the chunk alone
            trial = dataclasses.replace(trial, chunk_size=chunk)
            fixed = compute_plan(spec, trial)
            keys += f" train.chunk_size={chunk}"
        what = "offload the prefix state" if _all_cpu(policy) else _offloaded_state(policy)
        saves = human_bytes(plan.peak - fixed.peak)
        fixes.append(Fix(f"{what} to CPU (saves {saves})", keys, fixed))
        break
    if not work.activation_checkpointing:
        fixes += _checkpointing_fix(plan)
    if plan.rollout_gathered and work.rollout_gather == "once":  # auto decides it alone
        fixed = compute_plan(spec, dataclasses.replace(work, rollout_gather="per_step"))
        if fixed.fits:
            label = "gather the layers at every decode step, not once a rollout (a slower rollout)"
            fixes.append(Fix(label, "distributed.rollout_gather=per_step", fixed))
    if work.stages > 1:
        fixes += _stages_fix(plan)
    return fixes


def _stages_fix(plan: MemoryPlan) -> list[Fix]:
    """More pipeline stages (and GPUs: as many replicas), so each rank holds fewer layers:
    the fewest that fit, with the largest chunk that fits if the chunk alone does not."""
    spec, work = plan.spec, plan.work
    layers = len(spec.layers)
    counts = sorted({*(work.stages * 2**k for k in range(1, 8)), layers})
    for stages in (count for count in counts if work.stages < count <= layers):
        trial = dataclasses.replace(
            work, stages=stages, gpus=stages * work.replicas, stage_starts=None
        )
        fixed = compute_plan(spec, trial)
        keys = f"distributed.pipeline_stages={stages}"
        if not fixed.fits:
            chunk = largest_chunk(spec, trial)
            if chunk is None:
                continue
            fixed = compute_plan(spec, dataclasses.replace(trial, chunk_size=chunk))
            keys += f" train.chunk_size={chunk}"
        label = f"spread each prompt over {stages} stages ({trial.gpus} GPUs)"
        return [Fix(label, keys, fixed)]
    return []


def _checkpointing_fix(plan: MemoryPlan) -> list[Fix]:
    """Activation checkpointing, with the first of its own fixes when it needs one."""
    trial = dataclasses.replace(plan.work, activation_checkpointing=True)
    fixed = compute_plan(plan.spec, trial)
    keys = "train.activation_checkpointing=true"
    if not fixed.fits:
        more = fixes_for(fixed)
        if not more:
            return []
        fixed, keys = more[0].plan, f"{keys} {more[0].keys}"
    saves = human_bytes(plan.peak - fixed.peak)
    label = f"checkpoint each decoder layer's activations (saves {saves})"
    return [Fix(label, keys, fixed)]


def _all_cpu(policy: OffloadPolicy) -> bool:
    return len(policy.offloaded_fields()) == len(placement_fields())


def _offloaded_state(policy: OffloadPolicy) -> str:
    """What an offload fix moves, in words: the last kind (by name) the policy offloads
    that the advice names (``KindPlan.offload_label``), else the first one named."""
    named = [k for k in kinds() if k.plan.offload_label is not None]
    offloaded = [k for k in named if policy.offloads(k.offload)]
    return f"offload {(offloaded or named[:1])[-1].plan.offload_label}"


def offload_keys(policy: OffloadPolicy) -> str:
    keys = [f"offload.{name}=cpu" for name in policy.offloaded_fields()]
    return " ".join([*keys, f"offload.resident_layers={policy.resident_layers}"])


def _no_fix(plan: MemoryPlan) -> str:
    """Nothing in chunking or offload fits: say what dominates, how far the prompt (or the
    responses) may go, and what else would help."""
    spec, work = plan.spec, plan.work
    best = dataclasses.replace(
        work,
        offload=OffloadPolicy.cpu(resident_layers=1),
        checkpoints="cpu",
        chunk_size=CHUNK_CHOICES[0],
    )
    floor = compute_plan(spec, dataclasses.replace(best, prompt_tokens=2))
    parts = []
    if floor.fits:
        longest = _longest(spec, best, "prompt_tokens")
        parts.append(f"at most {longest:,} prompt tokens fit (state offloaded, chunk 256)")
    else:
        top = sorted(floor.lines, key=lambda line: -line.device)[:3]
        named = ", ".join(f"{line.name} {human_bytes(line.device)}" for line in top)
        parts.append(f"even a 2-token prompt needs {human_bytes(floor.peak)} per GPU ({named})")
    shorter = dataclasses.replace(best, response_tokens=1)
    if compute_plan(spec, shorter).fits:
        longest = _longest(spec, best, "response_tokens")
        parts.append(f"or rollout.max_new_tokens={longest} with the whole prompt (offloaded)")
    if not work.lora_rank:
        parts.append("LoRA (lora.enabled=true) trains far fewer parameters")
    if work.fsdp:
        parts.append("more GPUs shard parameters, gradients and optimizer further")
    else:
        parts.append("distributed.fsdp=true shards parameters, gradients and optimizer")
    return "no chunk size or offload fits; " + "; ".join(parts)


def _longest(spec: ModelSpec, work: Workload, name: str) -> int:
    """The largest value of ``work.<name>`` (prompt or response tokens) that fits."""
    low, high = 1, max(getattr(work, name), 2)
    if compute_plan(spec, dataclasses.replace(work, **{name: high})).fits:
        return high
    while high - low > max(1, low // 1000):
        middle = (low + high) // 2
        trial = dataclasses.replace(work, **{name: middle})
        if compute_plan(spec, trial).fits:
            low = middle
        else:
            high = middle
    return low


def check_fits(
    cfg: Any,
    prompt_tokens: int | None = None,
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    *,
    group: int | None = None,
    offload: OffloadPolicy | str | dict | None = None,
) -> MemoryPlan:
    """The plan of ``cfg``'s step; raises ``MemoryPlanError`` naming a fix if it won't fit.

    No budget (``gpu_mem`` and ``memory.gpu_mem`` unset, e.g. a CPU run) or
    ``memory.check=false``: the plan is returned unchecked. Recipes call this before
    loading weights.
    """
    spec, work = plan_for_config(
        cfg, prompt_tokens, gpus=gpus, gpu_mem=gpu_mem, group=group, offload=offload
    )
    plan = plan_memory(spec, work)
    memory = getattr(cfg, "memory", None)
    if plan.fits is False and getattr(memory, "check", True):
        raise MemoryPlanError(error_message(plan), plan)
    return plan


def rollout_gathers_once(cfg: Any) -> tuple[bool, str | None]:
    """Whether a sharded rollout gathers each layer once for the whole rollout
    (``distributed.rollout_gather``), and, when ``auto`` decided against it, why: the plan
    with the layers gathered for the rollout does not fit the budget (no budget: once)."""
    setting = _rollout_gather(cfg)
    if setting != "auto":
        return setting == "once", None
    spec, work = plan_for_config(cfg)
    if not work.fsdp or compute_plan(spec, work).rollout_gathered:
        return True, None
    once = compute_plan(spec, dataclasses.replace(work, rollout_gather="once"))
    return False, (
        f"rollout gathers the layers at every decode step: gathering them once for the "
        f"rollout needs {human_bytes(once.peak)} per GPU ({once.peak_phase} phase) > "
        f"{human_bytes(once.budget)} budget; distributed.rollout_gather=once forces it"
    )


def _rollout_gather(cfg: Any) -> str:
    return getattr(getattr(cfg, "distributed", None), "rollout_gather", "auto")


def error_message(plan: MemoryPlan) -> str:
    """Why ``plan`` does not fit, and its fixes (or what else would help)."""
    work = plan.work
    head = (
        f"predicted {human_bytes(plan.peak)} per GPU ({plan.peak_phase} phase) > "
        f"{human_bytes(plan.budget)} budget ({human_bytes(work.budget)} x (1 - memory.headroom "
        f"{work.headroom:g})) for {work.prompt_tokens:,} prompt tokens, G={work.group}, "
        f"{work.gpus} GPU(s)"
    )
    if work.stages > 1:
        head += f" as {work.stages} pipeline stages (worst: stage {plan.stage})"
    fixes = fixes_for(plan)
    if fixes:
        return head + ": " + " or ".join(f"{fix.label}: {fix.keys}" for fix in fixes)
    return head + ": " + _no_fix(plan)
