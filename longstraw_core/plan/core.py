"""The plan: every memory line of one GRPO step per rank, and the peak of each phase.

Pure: a plan from a model spec and a workload, nothing else (no advice, no printing);
``advice`` builds on it. With pipeline stages (``Workload.stages > 1``) every stage gets its
own plan (its layers' weights and state, its share of the root, the replay pieces and sweep
chunks in flight on it) and the plan is the worst stage's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from longstraw_core.pipeline.layout import StageLayout
from longstraw_core.plan.activations import Activations
from longstraw_core.plan.model import LOAD, PHASES, ModelSpec, Workload
from longstraw_core.plan.stages import InFlight, layout_for, stage_spec
from longstraw_core.plan.units import FP32, INT64, dtype_bytes, dtype_name
from longstraw_core.plan.weights import WeightParts


@dataclass(frozen=True)
class Line:
    """One row of the plan: bytes per rank on the device and in CPU memory."""

    name: str
    device: int
    cpu: int = 0
    note: str = ""


@dataclass
class MemoryPlan:
    """The predicted memory of one GRPO step, per rank: rows, phase peaks, and the advice
    ``advice.plan_memory`` adds (empty from ``compute_plan``). With stages: the rows and
    peaks of stage ``stage`` (the worst), every stage's own plan in ``per_stage``."""

    spec: ModelSpec
    work: Workload
    lines: list[Line]
    phases: dict[str, int]
    advice: list[str] = field(default_factory=list)
    layout: StageLayout | None = None  # the stages' layers (None: one stage)
    stage: int = 0
    per_stage: tuple[MemoryPlan, ...] = ()
    rollout_gathered: bool = False  # FSDP: the layers gathered once for the whole rollout
    load_host: int = 0  # host bytes while loading (``MemoryParts.load_host``)

    @property
    def stage_plans(self) -> tuple[MemoryPlan, ...]:
        """Every stage's plan (one stage: this plan)."""
        return self.per_stage or (self,)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def cpu_bytes(self) -> int:
        return sum(line.cpu for line in self.lines)

    @property
    def budget(self) -> int | None:
        return self.work.usable

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the budget (None: no budget known)."""
        return None if self.budget is None else self.peak <= self.budget

    def line(self, name: str) -> Line:
        return next(line for line in self.lines if line.name == name)


def compute_plan(spec: ModelSpec, work: Workload) -> MemoryPlan:
    """Predict the per-rank memory of one GRPO step of ``work`` on ``spec`` (no advice);
    with stages, the worst stage's (``pipeline_plan``)."""
    _check_workload(work)
    if work.stages > 1:
        return pipeline_plan(spec, work)
    parts = MemoryParts(spec, work)
    return MemoryPlan(
        spec, work, parts.lines(), parts.phases(),
        rollout_gathered=parts.rollout_once, load_host=parts.load_host(),
    )  # fmt: skip


def pipeline_plan(spec: ModelSpec, work: Workload) -> MemoryPlan:
    """Every stage's plan, each on its slice of the model (``stages.stage_spec``), and the
    worst stage's as the plan. FSDP shards a stage over its replicas: with one replica it
    is off (nothing to shard). One stage: the same rows and peaks as today's plan."""
    _check_workload(work)
    layout = layout_for(spec, work)
    inner = work
    if work.stages > 1 and work.replicas == 1 and work.fsdp:
        inner = dataclasses.replace(work, fsdp=False)
    plans = []
    for stage in range(layout.stages):
        sub = stage_spec(spec, layout, stage)
        parts = MemoryParts(sub, inner, stage=stage)
        plan = MemoryPlan(sub, inner, parts.lines(), parts.phases(), [], layout, stage)
        plans.append(
            dataclasses.replace(
                plan, rollout_gathered=parts.rollout_once, load_host=parts.load_host()
            )
        )
    worst = max(plans, key=lambda plan: plan.peak)
    per_stage = tuple(plans)
    return MemoryPlan(
        spec, work, worst.lines, worst.phases, [], layout, worst.stage, per_stage,
        rollout_gathered=all(plan.rollout_gathered for plan in plans),  # one decision a run
        load_host=max(plan.load_host for plan in plans),
    )  # fmt: skip


def _check_workload(work: Workload) -> None:
    if work.prompt_tokens < 2:
        raise ValueError(f"prompt_tokens={work.prompt_tokens}: a prompt has at least 2 tokens")
    if work.chunk_size is None:
        raise ValueError("chunk_size=None: choose it first (plan.resolve_chunk)")
    for name in ("group", "response_tokens", "chunk_size", "gpus", "stages"):
        if getattr(work, name) < 1:
            raise ValueError(f"{name}={getattr(work, name)}: must be at least 1")
    if work.replay_pieces is not None and work.replay_pieces < 1:
        raise ValueError(f"replay_pieces={work.replay_pieces}: must be at least 1 (None: auto)")
    if work.replay_branches is not None and not 1 <= work.replay_branches <= work.group:
        raise ValueError(f"replay_branches={work.replay_branches}: between 1 and the group")
    if work.gradient not in ("detached", "exact"):
        raise ValueError(f"gradient={work.gradient!r}: 'detached' or 'exact'")
    if work.device not in ("cuda", "cpu"):
        raise ValueError(f"device={work.device!r}: 'cuda' or 'cpu' (which kernels to model)")


class MemoryParts(WeightParts, InFlight):
    """The pieces of the step's memory on one rank, and the phases that add them up
    (``stage``: which pipeline stage of ``work.stages`` ``spec``, its slice, is)."""

    def __init__(self, spec: ModelSpec, work: Workload, stage: int = 0) -> None:
        self.spec, self.work, self.stage = spec, work, stage
        self.act = Activations(spec, work)
        self.cb = dtype_bytes(work.compute_dtype)
        self.pb = dtype_bytes(work.param_dtype)
        self.exact = work.gradient == "exact"

    # --- state, dS, checkpoints ---------------------------------------------------------------

    def state_split(self, kind: str, grad: bool = False) -> tuple[int, int]:
        """(device, cpu) bytes of ``kind`` records holding the stored prompt (``grad``:
        exact mode's ``dS`` of them)."""
        device = cpu = 0
        for layer in self.spec.layers:
            if layer.record != kind:
                continue
            stored = self.work.stored
            size = layer.grad_at(stored) if grad else layer.state_at(stored)
            if self.work.offloads(kind):
                cpu += size
            else:
                device += size
        return device, cpu

    def kinds(self) -> list[str]:
        return list(dict.fromkeys(layer.record for layer in self.spec.layers))

    def checkpoints(self) -> tuple[int, int]:
        if not self.exact:
            return 0, 0
        work = self.work
        device = cpu = 0
        for layer in self.spec.layers:  # the kinds that keep checkpoints (recurrent, window)
            size = layer.kind.plan.checkpoints_bytes(layer, work.stored, work.chunk_size)
            if work.checkpoints == "cpu" or work.offloads(layer.record):
                cpu += size  # an offloaded record keeps them beside it
            else:
                device += size
        return device, cpu

    def kept_outputs(self) -> tuple[int, int]:
        """(device, cpu) bytes of the attention outputs and log-sum-exps prefill keeps for
        the sweep (``keep_attention_outputs``): every full-attention layer but the last,
        which only writes its state (``KindPlan.kept_output_bytes``). They live where the
        layer's state lives."""
        if not (self.exact and self.work.keep_attention_outputs):
            return 0, 0
        lse = max(self.cb, FP32)  # the kernels' accumulation dtype
        device = cpu = 0
        for layer in self.act.split_last()[0]:
            size = layer.kind.plan.kept_output_bytes(self.act, layer, lse) * self.work.stored
            if self.work.offloads(layer.record):
                cpu += size
            else:
                device += size
        return device, cpu

    def streamed(self, position: int) -> int:
        """Offloaded layers copied to the device during a pass reading ``position`` rows:
        at most ``offload.resident_layers`` of them at once."""
        offloaded = [
            layer.state_at(position)
            for layer in self.spec.layers
            if self.work.offloads(layer.record)
        ]
        if not offloaded:
            return 0
        keep = min(self.work.offload.resident_layers, len(offloaded))
        return sum(sorted(offloaded)[-keep:])

    # --- FSDP ---------------------------------------------------------------------------------

    @functools.cached_property
    def rollout_once(self) -> bool:
        """Whether FSDP gathers the layers once for the whole rollout
        (``distributed.rollout_gather``): ``once``; ``per_step`` not; ``auto`` once when
        that fits the budget (or no budget is known), else at every decode step."""
        work = self.work
        if not (work.fsdp and work.rollout) or work.rollout_gather == "per_step":
            return False
        if work.rollout_gather == "once" or work.usable is None:
            return True
        return max(self._phases(rollout_once=True).values()) <= work.usable

    # --- transients ---------------------------------------------------------------------------

    def prefill_transient(self) -> int:
        """One chunk through the layers without autograd: the residual stream and the widest
        layer's working set, at the last chunk (the longest prefix)."""
        work = self.work
        tokens = min(work.chunk_size, work.stored)
        prefix = max(work.stored - tokens, 0)
        layers, last = self.act.split_last()
        working = max(
            (self.act.forward_working(layer, tokens, prefix) for layer in layers),
            default=0,
        )
        if last is not None:
            working = max(working, self.act.state_only_working(last, tokens, prefix))
        return tokens * self.cb * self.spec.hidden + working

    def branch_transient(self) -> int:
        """One replayed branch: its graph, then the head's logits or a layer's backward. On
        stages: the piece in its backward (``pieces.piece_memory``)."""
        if self.work.stages > 1:
            return self.replay.piece
        return self.act.branch_peak(self.work.response_tokens)

    def sweep_transient(self) -> int:
        """Exact mode's recompute of the last chunk (the longest prefix) with autograd: its
        graph, the dS slices handed to backward with it, and a layer's backward."""
        if not self.exact:
            return 0
        work = self.work
        tokens = min(work.chunk_size, work.stored)
        start = work.stored - tokens
        produced = sum(
            layer.grad_per_token * tokens * self.cb // FP32 + layer.grad_fixed * self.cb // FP32
            for layer in self.spec.layers
        )
        if work.activation_checkpointing:
            return produced + self.act.checkpointed_chunk_peak(tokens, start)
        graph = self.act.chunk_graph(tokens, start)
        layers, last = self.act.split_last()
        working = max(
            (
                max(
                    self.act.backward_working(layer, tokens, start),
                    self.act.kernel_forward_scratch(layer, tokens, start),
                )
                for layer in layers
            ),
            default=0,
        )
        last_working = 0
        if last is not None:
            last_working = self.act.state_only_working(last, tokens, start)
            if last.kind.plan.state_only_backward:  # the key/value projections only
                last_working = max(last_working, self.act.weight_grad_scratch(last))
        return graph + produced + max(working, last_working)

    def rollout_transient(self) -> int:
        """Rollout: the G branches' own caches and one decoding step's logits."""
        work = self.work
        group, new = work.group, work.response_tokens
        caches = sum(group * layer.kind.plan.branch_bytes(layer, new) for layer in self.spec.layers)
        logits = 3 * group * self.spec.vocab * FP32 if self.spec.has_head else 0
        step = max(self.act.decode_scratch(layer, group, work.stored) for layer in self.spec.layers)
        tokens = 2 * group * new * INT64  # sampled tokens, behaviour log-probs
        return caches + logits + step + tokens

    # --- pipeline stages ------------------------------------------------------------------

    def pipeline_lines(self) -> list[Line]:
        work, replay = self.work, self.replay
        note = f"{replay.held - 1} more pieces of {replay.branches} branch(es) x P={replay.pieces} "
        note += "wait for their backward (stage s holds up to P + min(P, 3)(S - 1 - s))"
        if replay.branches < work.group:
            note += f"; the worst count of the G={work.group} branches replayed"
        lines = [Line("in-flight replay piece graphs", replay.waiting, note=note)]
        note = "K/V, latent, DeltaNet states (with the conv input their window views) "
        note += "later pieces read, and their gradients"
        lines.append(Line("replay piece leaves", replay.written, note=note))
        if self.exact:
            chunks = self.in_flight(self.sweep_chunks())
            note = f"{chunks - 1} more prompt chunks of {self.sweep_chunks()} wait for backward"
            name = "in-flight sweep chunk graphs (1F1B)"
            lines.append(Line(name, self.waiting_chunks(), note=note))
        buffers = self.stage_buffers()
        phase = max(buffers, key=buffers.__getitem__)
        note = f"hidden states (tokens x hidden) to/from {self.links()} neighbour(s), largest in {phase}"
        lines.append(Line("stage hidden-state buffers", buffers[phase], note=note))
        return lines

    # --- the table and the phases ---------------------------------------------------------

    def lines(self) -> list[Line]:
        work = self.work
        lines = [
            Line("parameters", self.parameters(), note=self._param_note()),
            Line("gradients", self.gradients(), note=f"{dtype_name(self.state_bytes)}"),
            Line("optimizer (AdamW)", self.optimizer(), note="2 moments"),
        ]
        if self.reference():
            lines.append(Line("reference model", self.reference(), note="beta > 0, frozen"))
        for kind in self.kinds():
            device, cpu = self.state_split(kind)
            count = sum(layer.record == kind for layer in self.spec.layers)
            lines.append(Line(f"prefix state: {kind}", device, cpu, f"{count} layers"))
        if self.exact:
            grad_device = grad_cpu = 0
            for kind in self.kinds():
                device, cpu = self.state_split(kind, grad=True)
                grad_device, grad_cpu = grad_device + device, grad_cpu + cpu
            lines.append(Line("dS (exact)", grad_device, grad_cpu, "float32, like the state"))
            device, cpu = self.checkpoints()
            if device or cpu:
                lines.append(Line("recurrent checkpoints", device, cpu, "one per chunk start"))
            device, cpu = self.kept_outputs()
            if device or cpu:
                note = "keep_attention_outputs: the sweep skips the attention forward"
                lines.append(Line("kept attention outputs", device, cpu, note))
        lines.append(Line("prompt ids", 2 * INT64 * work.prompt_tokens))
        if work.offload is not None and work.offload.active:
            lines.append(
                Line(
                    "streamed offloaded layers",
                    self.streamed(work.stored),
                    note=f"resident_layers={work.offload.resident_layers}",
                )
            )
        if work.fsdp:
            lines.append(Line("FSDP gathered parameters", self.gathered(), note="during passes"))
            lines.append(Line("FSDP unsharded gradients", self.unsharded_grads(), note="backward"))
            if self.rollout_once:
                gathered = self.gathered_in_rollout(once=True)
                note = "distributed.rollout_gather"
                lines.append(Line("FSDP parameters gathered for rollout", gathered, note=note))
        if self.working_weights:
            note = "trained parameters, prefill to optimizer step"
            lines.append(Line("bf16 working weights", self.working_copy(), note=note))
            note = "one backward's, then added into the fp32 gradients"
            lines.append(
                Line("bf16 working gradients (transient)", self.working_grads(), note=note)
            )
        if work.quantization is not None:
            note = f"the largest 4-bit linear in {dtype_name(self.cb)}, during each pass"
            lines.append(Line("NF4 dequantized weight (transient)", self.dequantized(), note=note))
        lines += [
            Line("prefill chunk (transient)", self.prefill_transient(), note="no autograd"),
            Line(self._branch_name(), self.branch_transient(), note=self._branch_note()),
        ]
        if self.exact:
            note = "layers checkpointed" if work.activation_checkpointing else ""
            lines.append(Line("sweep chunk graph (transient)", self.sweep_transient(), note=note))
        if work.rollout:
            lines.append(Line("rollout caches + step (transient)", self.rollout_transient()))
        lines.append(Line("optimizer step (transient)", self.optimizer_transient()))
        if work.stages > 1:
            lines += self.pipeline_lines()
        return lines

    def phases(self) -> dict[str, int]:
        """Peak device bytes of each phase of the step (recipe order)."""
        return self._phases(self.rollout_once)

    def _phases(self, rollout_once: bool) -> dict[str, int]:
        work = self.work
        state_device = sum(self.state_split(kind)[0] for kind in self.kinds())
        grad_device = 0
        if self.exact:
            grad_device = sum(self.state_split(kind, grad=True)[0] for kind in self.kinds())
        base = (
            self.parameters() + self.optimizer() + self.reference() + 2 * INT64 * work.prompt_tokens
        )
        base += state_device + self.checkpoints()[0] + self.kept_outputs()[0]
        chunk = min(work.chunk_size, work.stored)
        backward = grad_device + self.gradients() + self.gathered() + self.unsharded_grads()
        backward += self.working_grads()
        # The phases that run the layers (working weights: on their compute-dtype copies).
        passes = base + self.dequantized() + self.working_copy()
        phases = {
            "prefill": passes
            + self.gathered()
            + self.streamed(work.stored - chunk)
            + self.prefill_transient(),
            "replay": passes + backward + self.streamed(work.stored) + self.branch_transient(),
        }
        if work.rollout:
            phases["rollout"] = (
                passes
                + self.gathered_in_rollout(rollout_once)
                + self.streamed(work.stored)
                + self.rollout_transient()
            )
        if self.exact:
            phases["sweep"] = (
                passes + backward + self.streamed(work.stored - chunk) + self.sweep_transient()
            )
        phases["optimizer"] = base + self.gradients() + self.optimizer_transient()
        if work.stages > 1:
            buffers = self.stage_buffers()
            phases = {name: value + buffers[name] for name, value in phases.items()}
            phases["replay"] += self.replay.waiting + self.replay.written
            if "sweep" in phases:
                phases["sweep"] += self.waiting_chunks()
        # Loading (longstraw_core.models.sharded_loading): the rank's own share, allocated and read in place
        # (and the frozen reference model's, loaded after it).
        phases[LOAD] = self.parameters() + self.reference()
        return {name: phases[name] for name in (LOAD, *PHASES) if name in phases}

    def _branch_name(self) -> str:
        if self.work.stages > 1:
            return "one replay piece (transient)"
        return "one branch graph (transient)"

    def _branch_note(self) -> str:
        tokens = self.work.response_tokens
        note = f"{tokens} tokens"
        if self.work.stages > 1:
            tokens, pieces = self.replay.tokens, self.replay.pieces
            note = f"{tokens} of a branch's {self.work.response_tokens} tokens (P={pieces})"
        if self.spec.has_head:
            rows, vocab = self.act.head_rows(tokens), self.spec.vocab
            if rows < tokens:
                note += f", logits [{rows}, {vocab}] fp32 per chunk"
            else:
                note += f", logits [T, {vocab}] fp32"
        return note + (", layers checkpointed" if self.work.activation_checkpointing else "")
