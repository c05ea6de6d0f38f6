"""How long each phase of one GRPO step takes on a stated GPU: a roofline per stage, pipelined.

Why: memory decides whether a step runs; time decides whether it is worth running. The
estimate shows where a step's time goes (prefill's quadratic attention, rollout's reads of
the whole prefix state per generated token, the pipeline's bubbles) before anything runs.

Per stage and phase the work is a roofline: the largest of its FLOPs over ``flops x mfu``,
its HBM bytes over ``hbm x bandwidth_efficiency``, and its host traffic (offloaded state)
over ``pcie x bandwidth_efficiency``; a 4-bit (QLoRA) base adds its dequantization, a
memory-bound kernel of its own before each matmul (``Work.dequant``), to that. The stages then
combine as each phase's schedule does: its programs (``longstraw_core.pipeline.schedule``,
what the ranks run) are played under NCCL's rules (``pipeline.simulate``) with each compute
costing its stage's roofline and each message a hop, so the pipeline's bubbles are those of
the real op order:

- prefill: ``K`` prompt chunks forward through ``S`` stages (``forward_orders``);
- rollout: ``min(G, S)`` micro-groups around the ring of stages (``ring_program``): each
  micro-group's decode step reads the stage's weights and the prefix state once;
- replay: ``G`` branches of ``P`` pieces (``replay_orders``): each piece reads the weights
  and the prefix state once, its FLOPs are its share of the branch's;
- exact sweep: ``K`` chunks, last first, 1F1B (``replay_orders`` with one piece each);
- optimizer: AdamW over the slowest stage's trainable parameters (memory-bound), and the
  gradients' all-reduce over ``D`` replicas.

Passes longer than ``SIMULATED`` microbatches or decode steps are simulated at that length
and extended by the steady state's period.

Hidden states crossing stages are counted per phase (bytes); in the simulation each message
takes a hop (latency plus its bytes over the link), which the schedule overlaps with compute
where its op order lets it. Pure: ``estimate_time`` reads a spec, a workload and a
``Hardware`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from longstraw_core.pipeline.layout import StageLayout
from longstraw_core.pipeline.schedule import (
    MAX_OPEN_SENDS,
    Compute,
    Message,
    Ring,
    Step,
    forward_orders,
    micro_groups,
    programs,
    replay_orders,
    ring_program,
)
from longstraw_core.pipeline.simulate import simulate
from longstraw_core.plan.flops import head_flops
from longstraw_core.plan.model import ModelSpec, Workload
from longstraw_core.plan.pieces import pieces_of
from longstraw_core.plan.roofline import NF4_FUSED_ROWS, Hardware, StageCosts, Work
from longstraw_core.plan.stages import layout_for
from longstraw_core.plan.units import FP32, dtype_bytes
from longstraw_core.tensors.quantization import nf4_bytes

ADAM_ACCESSES = 7  # AdamW reads parameter, gradient and both moments and writes three back
# Microbatches (or decode steps) a pass is simulated with at most: a longer one is extended
# by its steady state's period (``StepModel.scheduled``).
SIMULATED = 48
INT64 = 8


@dataclass(frozen=True)
class PhaseTime:
    """One phase of the step: its seconds and what bounds them, its FLOPs (all stages of one
    group), the bytes crossing stages and PCIe, and what the stages exchange."""

    name: str
    seconds: float
    bound: str
    flops: float
    link_bytes: float
    pcie_bytes: float
    note: str


@dataclass(frozen=True)
class TimeEstimate:
    """The phases of one step of one stage group (``D`` replicas run theirs side by side)."""

    spec: ModelSpec
    work: Workload
    hardware: Hardware
    layout: StageLayout
    phases: tuple[PhaseTime, ...]

    @property
    def total(self) -> float:
        return sum(phase.seconds for phase in self.phases)

    def phase(self, name: str) -> PhaseTime:
        return next(phase for phase in self.phases if phase.name == name)


def estimate_time(
    spec: ModelSpec, work: Workload, hardware: Hardware | None = None
) -> TimeEstimate:
    """Seconds per phase of one GRPO step of ``work`` on ``spec`` on ``hardware``."""
    hw = hardware or Hardware()
    layout = layout_for(spec, work)
    model = StepModel(spec, work, hw, layout)
    phases = [model.prefill(), model.rollout(), model.replay()]
    if work.gradient == "exact":
        phases.append(model.sweep())
    phases.append(model.optimizer())
    return TimeEstimate(spec, work, hw, layout, tuple(phases))


class StepModel(StageCosts):
    """The per-stage work of each phase (``roofline.StageCosts``), and the schedules that
    combine the stages."""

    # --- the schedules ------------------------------------------------------------------------

    def chunks(self) -> int:
        return max(math.ceil(self.work.stored / self.work.chunk_size), 1)

    def pieces(self) -> int:
        """Pieces per replayed branch when all ``G`` replay (``plan.pieces.pieces_of``)."""
        return pieces_of(self.work)

    def scheduled(
        self,
        build: Callable[[int], list[list[Step]]],
        count: int,
        cost: Callable[[Compute], float],
        size: Callable[[Message], float],
    ) -> float:
        """Seconds of the stages' programs ``build(count)`` (``count`` microbatches or decode
        steps) played under NCCL's rules (``simulate``) with ``cost`` per compute and a hop
        of ``size`` bytes per message. A long pass is played at ``SIMULATED`` and half that,
        and extended by its steady state's period (a pipeline's steps cost alike once full)."""

        def play(n: int) -> float:
            return simulate(build(n), cost, lambda m: self.hw.hop(size(m))).makespan

        if count <= SIMULATED:
            return play(count)
        shorter, longer = play(SIMULATED // 2), play(SIMULATED)
        return longer + (count - SIMULATED) * (longer - shorter) / (SIMULATED - SIMULATED // 2)

    def bound(self, works: list[Work], hop: float) -> str:
        """What bounds a pass: the slowest stage's resource, or the link when a hop between
        stages takes longer than any stage's share."""
        seconds, bound = max(work.seconds(self.hw) for work in works)
        return "link" if self.stages > 1 and hop > seconds else bound

    # --- the phases ---------------------------------------------------------------------------

    def prefill(self) -> PhaseTime:
        work, n, chunks = self.work, self.work.stored, self.chunks()
        chunk = min(work.chunk_size, n)
        works = []
        for s in range(self.stages):
            flops = self.forward(s, n, 0, head=False).total / chunks
            # weights once per chunk; the state written once and read once per chunk (about
            # half of it on average): a lower bound (the kernels tile it)
            hbm = self.weight_bytes(s) + self.state_bytes(s, n, False) * (1 / chunks + 1 / 2)
            pcie = self.state_bytes(s, n, True) * (1 / chunks + 1 / 2)
            works.append(Work(flops, hbm, pcie, self.dequant(s, 1, chunk)))
        size = chunk * self.spec.hidden * self.cb
        seconds = self.scheduled(
            lambda k: programs(forward_orders(self.stages, k), max_open_sends=MAX_OPEN_SENDS),
            chunks,
            lambda c: works[c.stage].seconds(self.hw)[0],
            lambda _: size,
        )
        link = (self.stages - 1) * n * self.spec.hidden * self.cb
        note = (
            f"{chunks} chunks of {chunk}, no autograd; each stage writes its own layers' "
            "state; stage s -> s+1: each chunk's hidden states (chunk x hidden)"
        )
        flops = sum(w.flops for w in works) * chunks
        pcie = sum(w.pcie for w in works) * chunks
        return PhaseTime("prefill", seconds, self.bound(works, self.hw.hop(size)), flops, link,
                         pcie, note)  # fmt: skip

    def rollout(self) -> PhaseTime:
        work, hw = self.work, self.hw
        group, new, n = work.group, work.response_tokens, work.stored
        context = n + new / 2  # the mean decode step
        rows = micro_groups(group, self.stages)
        size = group / len(rows)  # branches a micro-group decodes (on average)
        ticks = []
        for s in range(self.stages):
            forward = self.forward(s, new, n, head=True).total * size / new
            hbm, host = self.decode_reads(s, context, math.ceil(size))
            weights = self.weight_bytes(s, math.ceil(size))
            if size <= NF4_FUSED_ROWS:  # the fused 4-bit kernel reads the codes, not a copy
                weights -= self.quantized(s) * self.cb - nf4_bytes(self.quantized(s))
            ticks.append(Work(forward, hbm + weights, host, self.dequant(s, 1, size)))
        hidden = size * self.spec.hidden * self.cb
        seconds = self.scheduled(
            lambda steps: ring_program(
                Ring(self.stages, len(rows), steps, check_every=work.stop_check_every)
            ),
            new,
            lambda c: ticks[c.stage].seconds(hw)[0],
            lambda m: hidden if m.key[0] == "H" else size * INT64,
        )
        note = (
            f"{new} steps of G={group}: {len(rows)} micro-group(s) of {group / len(rows):g} "
            "around the ring of stages (stage s on one while s-1 is on the next); stage "
            "s -> s+1: a micro-group's hidden states, the last stage's tokens back to stage 0"
        )
        link = new * (self.stages - 1) * group * self.spec.hidden * self.cb
        flops = sum(t.flops for t in ticks) * len(rows) * new
        pcie = sum(t.pcie for t in ticks) * len(rows) * new
        bound = self.bound(ticks, hw.hop(hidden))
        return PhaseTime("rollout", seconds, bound, flops, link, pcie, note)

    def replay(self) -> PhaseTime:
        work, n, tokens = self.work, self.work.stored, self.work.response_tokens
        group, pieces = work.group, self.pieces()
        piece = tokens / pieces
        forwards, backwards = [], []
        for s in range(self.stages):
            # each piece attends over the prefix and its branch's earlier pieces: the whole
            # branch's FLOPs over P pieces, but every piece reads the weights and the prefix
            forward = self.forward(s, tokens, n, head=True)
            backward = self.backward(forward)
            if work.activation_checkpointing:
                backward += forward.total  # each layer recomputed in its backward
            elif self.last(s):
                backward += head_flops(self.spec, tokens).total  # the head is recomputed
            passes = 2 if work.activation_checkpointing else 1  # the backward's weight reads
            state, host = self.state_bytes(s, n, False), self.state_bytes(s, n, True)
            weights = self.weight_bytes(s)
            forwards.append(Work(forward.total / pieces, weights + state, host,
                                 self.dequant(s, 1, piece)))  # fmt: skip
            backwards.append(Work(backward / pieces, passes * weights + state, host,
                                  self.dequant(s, passes, piece)))  # fmt: skip
        size = piece * self.spec.hidden * self.cb
        seconds = self.scheduled(
            lambda g: programs(replay_orders(self.stages, [pieces] * g), MAX_OPEN_SENDS),
            group,
            lambda c: (forwards if c.kind == "F" else backwards)[c.stage].seconds(self.hw)[0],
            lambda _: size,
        )
        link = 2 * (self.stages - 1) * group * tokens * self.spec.hidden * self.cb
        note = (
            f"G={group} branches of {tokens} tokens in {pieces} piece(s) each: forwards in "
            "order, a branch's backwards last piece first; stage s -> s+1: a piece's hidden "
            "states, s+1 -> s: their gradients; the loss on the last stage"
        )
        total = group * pieces
        flops = sum(f.flops + b.flops for f, b in zip(forwards, backwards, strict=True)) * total
        pcie = sum(f.pcie + b.pcie for f, b in zip(forwards, backwards, strict=True)) * total
        bound = self.bound([*forwards, *backwards], self.hw.hop(size))
        return PhaseTime("replay", seconds, bound, flops, link, pcie, note)

    def sweep(self) -> PhaseTime:
        work, n, chunks = self.work, self.work.stored, self.chunks()
        chunk = min(work.chunk_size, n)
        forwards, backwards = [], []
        for s in range(self.stages):
            forward = self.forward(s, n, 0, head=False)
            recompute = forward
            if work.keep_attention_outputs:
                recompute = self.without_attention(s, n, 0)
            backward = self.backward(forward)
            if work.activation_checkpointing:
                backward += recompute.total
            passes = 2 if work.activation_checkpointing else 1
            # per chunk: the prefix's state read in forward and backward and its dS read and
            # written (half the prompt on average, twice each)
            state = self.state_bytes(s, n, False) + self.grad_bytes(s, n, False)
            host = self.state_bytes(s, n, True) + self.grad_bytes(s, n, True)
            forwards.append(Work(recompute.total / chunks, self.weight_bytes(s) + state / 2,
                                 host / 2, self.dequant(s, 1, chunk)))  # fmt: skip
            backwards.append(Work(backward / chunks, passes * self.weight_bytes(s) + state / 2,
                                  host / 2, self.dequant(s, passes, chunk)))  # fmt: skip
        size = chunk * self.spec.hidden * self.cb
        seconds = self.scheduled(
            lambda k: programs(replay_orders(self.stages, [1] * k), MAX_OPEN_SENDS),
            chunks,
            lambda c: (forwards if c.kind == "F" else backwards)[c.stage].seconds(self.hw)[0],
            lambda _: size,
        )
        link = 2 * (self.stages - 1) * n * self.spec.hidden * self.cb
        note = (
            f"{chunks} chunks in reverse, recomputed with autograd and backpropagated, 1F1B; "
            "stage s -> s+1: a chunk's hidden states, s+1 -> s: their gradients; dS stays local"
        )
        flops = sum(f.flops + b.flops for f, b in zip(forwards, backwards, strict=True)) * chunks
        pcie = sum(f.pcie + b.pcie for f, b in zip(forwards, backwards, strict=True)) * chunks
        bound = self.bound([*forwards, *backwards], self.hw.hop(size))
        return PhaseTime("sweep", seconds, bound, flops, link, pcie, note)

    def optimizer(self) -> PhaseTime:
        work, hw = self.work, self.hw
        size = FP32 if work.lora_rank else dtype_bytes(work.param_dtype)
        shards = work.shards
        slowest = max(self.trainable(s) for s in range(self.stages))
        seconds = ADAM_ACCESSES * size * slowest / shards / hw.hbm_rate
        link, replicas = 0.0, work.replicas
        if replicas > 1:
            link = 2 * (replicas - 1) / replicas * slowest * size  # ring all-reduce
            seconds += link / hw.link_rate
        note = (
            f"AdamW over the largest stage's trainable parameters; gradients all-reduced "
            f"over {replicas} replica(s)"
        )
        return PhaseTime("optimizer", seconds, "HBM", 0.0, link, 0.0, note)
