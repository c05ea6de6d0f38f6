"""The prompt's chunk when the run leaves it to the planner (``train.chunk_size: null``).

Why the planner picks it: exact mode's sweep recomputes one prompt chunk at a time through
every layer with autograd, and that chunk's graph grows with the chunk's tokens, not with
the prompt. SmolLM2-135M in float32 keeps about 1.4 MiB of graph a token: 5.6 GiB at 4096
tokens, against a prefix state of 0.3 GiB at 6K prompt tokens, so the step peaked at about
what a whole-sequence trainer with gradient checkpointing needs. A smaller chunk costs
time only through what each chunk pays once (kernel launches, every weight read once a
chunk, attention reading the stored prefix once a chunk, a recurrent checkpoint a chunk),
and that fades once a chunk holds a few hundred tokens: measured on SmolLM2 at 2K and 6K
prompt tokens, chunk 1024 was as fast as 4096 or faster, at 0.3x to 0.7x its peak.

The rule (``auto_chunk``): of the powers of two from ``CHUNKS[0]`` = 256 to
``CHUNKS[-1]`` = 8192, no larger than the first that holds the stored prompt in one chunk,
the largest whose planned step peak is at most ``1 + SLACK`` times the lowest peak any of
them gives. The lowest peak is what the step needs whatever the chunk (weights, gradients,
optimizer, prefix state and dS, a replayed branch's graph, the rollout's caches): a chunk
whose graph hides under it is free, and ``SLACK`` (a quarter) lets the sweep (or the
prefill, in detached mode) go a little past it for fewer, longer chunks, never to a
multiple of it: powers of two double the graph from one to the next, so without slack
the rule would often take half the chunk for a few percent of peak. With a memory budget
(``memory.gpu_mem``) only the chunks that fit count (none fits: the lowest peak, and
``check_fits`` names the fix).

Why not a share of the GPU's free memory: the point is the smallest peak, not merely one
that fits (an 80 GiB GPU would otherwise take 4096 for a 135M model), and the choice must be
the same on every rank (the sweep's collectives pair up chunk by chunk under FSDP), so it
is a function of the config alone, never of a device's free memory at start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longstraw_core.plan.core import MemoryPlan, compute_plan
from longstraw_core.plan.model import ModelSpec, Workload
from longstraw_core.plan.units import human_bytes

CHUNKS = tuple(2**k for k in range(8, 14))  # 256 .. 8192: the chunks auto_chunk chooses from
SLACK = 0.25  # the chosen chunk's peak is at most (1 + SLACK) x the leanest chunk's
SWEEP_GRAPH = "sweep chunk graph (transient)"  # core's line names
PREFILL_CHUNK = "prefill chunk (transient)"


@dataclass(frozen=True)
class ChunkChoice:
    """``auto_chunk``'s answer: the chunk, its plan, and what the alternatives would peak at."""

    chunk: int
    plan: MemoryPlan  # the step's plan at ``chunk``
    leanest: MemoryPlan  # the plan with the lowest peak of the chunks tried
    larger: MemoryPlan | None  # the next larger chunk's plan (None: ``chunk`` is the largest)
    one_chunk: bool  # the stored prompt fits in one chunk of ``chunk`` tokens

    @property
    def graph(self) -> int:
        """Device bytes of what one chunk holds: the sweep's graph (exact), else a prefill
        chunk's working set."""
        name = SWEEP_GRAPH if self.plan.work.gradient == "exact" else PREFILL_CHUNK
        return self.plan.line(name).device

    def reason(self) -> str:
        """Why this chunk, in words (the run's note): the graph, the peak, the leanest
        chunk's peak, and what the next larger chunk would peak at."""
        work = self.plan.work
        what = "a chunk's graph" if work.gradient == "exact" else "a prefill chunk"
        parts = [f"{what} ~{human_bytes(self.graph)}, planned peak {human_bytes(self.plan.peak)}"]
        if self.plan.budget is not None:
            parts[0] += f" of {human_bytes(self.plan.budget)}"
        if self.leanest.work.chunk_size != self.chunk:
            parts[0] += (
                f", within {SLACK:.0%} of the {human_bytes(self.leanest.peak)} at chunk "
                f"{self.leanest.work.chunk_size}"
            )
        if self.larger is not None:
            size, peak = self.larger.work.chunk_size, human_bytes(self.larger.peak)
            parts.append(f"chunk {size} would peak at {peak}")
        elif self.one_chunk:
            parts.append("the prompt fits one chunk")
        else:
            parts.append(f"{self.chunk} is the largest auto chunk")
        return "; ".join(parts)

    def note(self) -> str:
        """The line a run prints at start."""
        return (
            f"train.chunk_size: {self.chunk} (auto: {self.reason()}; set train.chunk_size to "
            "override)"
        )


def candidates(work: Workload) -> tuple[int, ...]:
    """The chunks ``auto_chunk`` tries for ``work``'s prompt: ``CHUNKS`` up to the first
    that holds the stored prompt in one chunk."""
    held = next((chunk for chunk in CHUNKS if chunk >= work.stored), CHUNKS[-1])
    return tuple(chunk for chunk in CHUNKS if chunk <= held)


def auto_chunk(spec: ModelSpec, work: Workload) -> ChunkChoice:
    """The chunk the run uses when ``train.chunk_size`` is null (the module's rule); the
    workload's own ``chunk_size`` is ignored."""
    tried = candidates(work)
    plans = [compute_plan(spec, dataclasses.replace(work, chunk_size=chunk)) for chunk in tried]
    fitting = [plan for plan in plans if plan.fits is not False]
    leanest = min(fitting or plans, key=lambda plan: (plan.peak, -plan.work.chunk_size))
    limit = leanest.peak * (1 + SLACK)
    chosen = max(
        (plan for plan in fitting if plan.peak <= limit),
        key=lambda plan: plan.work.chunk_size,
        default=leanest,  # none fits: the lowest peak, for check_fits to name a fix
    )
    index = plans.index(chosen)
    larger = plans[index + 1] if index + 1 < len(plans) else None
    return ChunkChoice(
        chosen.work.chunk_size,
        chosen,
        leanest,
        larger,
        one_chunk=chosen.work.chunk_size >= work.stored,
    )


def resolve_chunk(spec: ModelSpec, work: Workload) -> Workload:
    """``work`` with its chunk chosen by ``auto_chunk`` when it leaves it to the planner
    (``Workload.chunk_auto``, again after any other change); else ``work`` unchanged."""
    if not work.chunk_auto:
        return work
    return dataclasses.replace(work, chunk_size=auto_chunk(spec, work).chunk)
