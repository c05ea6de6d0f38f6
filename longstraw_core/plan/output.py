"""The plan as a rich table, plain text or markdown."""

from __future__ import annotations

from typing import Any

from longstraw_core.kinds.registry import kinds
from longstraw_core.plan.advice import offload_keys
from longstraw_core.plan.calibration import describe_sources
from longstraw_core.plan.core import MemoryPlan
from longstraw_core.plan.model import LOAD, Workload
from longstraw_core.plan.pieces import pieces_of
from longstraw_core.plan.roofline import NF4_FUSED_ROWS
from longstraw_core.plan.stages import full_attention_counts
from longstraw_core.plan.timing import TimeEstimate
from longstraw_core.plan.units import dtype_bytes, dtype_name, human_bytes, human_count


def assumptions(plan: MemoryPlan) -> list[str]:
    """What the numbers assume, in words (printed under every table)."""
    work, spec = plan.work, plan.spec
    sharded = (
        f"FSDP2 over {work.gpus} GPUs shards parameters, gradients and AdamW moments; "
        "the prefix state, dS and activations are per rank (each rank holds its own group)"
        if work.fsdp
        else "one process: nothing sharded"
    )
    if work.stages > 1:
        sharded = _stage_note(work)
    kernels = (
        "CUDA kernels: flash-attn (16-bit, equal head dims; MLA's latent uses the torch loop), "
        "flash-linear-attention for Gated DeltaNet"
        if work.device == "cuda"
        else "CPU kernels: PyTorch's fused attention for float32, the torch loops otherwise"
    )
    tuning = (
        f"LoRA r={work.lora_rank} on {', '.join(work.lora_targets)} (adapters fp32)"
        if work.lora_rank
        else "full fine-tuning"
    )
    if work.quantization is not None:
        tuning += f", decoder linears in {work.quantization.upper()} (QLoRA)"
    return [
        f"model: {spec.name} ({spec.model_type}), {human_count(spec.params)} parameters in "
        f"{dtype_name(dtype_bytes(work.param_dtype))}; layers compute and keep their state in "
        f"{dtype_name(dtype_bytes(work.compute_dtype))}; {tuning}",
        sharded,
        f"gradient={work.gradient}; {_checkpointing_note(work)}; logits in float32, in chunks of "
        f"at most {_head_chunk_elements():,} (recomputed in backward)",
        kernels,
        "AdamW moments in the trainable parameters' dtype; counted: tensor memory only "
        "(no CUDA context, NCCL buffers, fragmentation: that is what memory.headroom is for)",
    ]


def _stage_note(work: Workload) -> str:
    fsdp = (
        f"FSDP2 shards each stage's parameters, gradients and moments over its {work.replicas} "
        "replicas"
        if work.fsdp and work.replicas > 1
        else "nothing sharded (one replica: no FSDP)"
    )
    return (
        f"{work.stages} pipeline stages x {work.replicas} data-parallel replica(s) = "
        f"{work.stages * work.replicas} GPUs: a rank holds its stage's layers (weights, "
        "prefix state, dS, checkpoints, activations), the embeddings on stage 0, the final "
        "norm and LM head on the last; stage s holds up to P + min(P, 3)(S - 1 - s) replay "
        f"pieces (P={pieces_of(work)} for G={work.group}) and S - s prompt chunks (exact sweep); "
        f"{fsdp}"
    )


def _head_chunk_elements() -> int:
    from longstraw_core.adapters.lm_head import HEAD_CHUNK_ELEMENTS

    return HEAD_CHUNK_ELEMENTS


def _checkpointing_note(work: Workload) -> str:
    if work.activation_checkpointing:
        return (
            "activation checkpointing per decoder layer (a branch, or a recomputed chunk, keeps "
            "each layer's input; backward recomputes one layer at a time)"
        )
    return (
        "no activation checkpointing inside a branch (the whole branch graph is kept until "
        "its backward)"
    )


def table_rows(plan: MemoryPlan) -> list[tuple[str, str, str, str]]:
    """The plan as (what, device, CPU, note) rows: pieces, phase peaks, the verdict."""
    rows = [
        (line.name, human_bytes(line.device), human_bytes(line.cpu) if line.cpu else "", line.note)
        for line in plan.lines
    ]
    rows += [
        (f"peak in {name}", human_bytes(value), _load_host(plan, name), "")
        for name, value in plan.phases.items()
    ]
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no budget given"}[plan.fits]
    rows.append(
        (
            f"predicted peak per GPU ({plan.peak_phase})",
            human_bytes(plan.peak),
            human_bytes(plan.cpu_bytes),
            f"budget {human_bytes(plan.budget)}: {verdict}",
        )
    )
    return rows


def _load_host(plan: MemoryPlan, phase: str) -> str:
    """The CPU column of the load phase: one tensor at a time (``loading``)."""
    return human_bytes(plan.load_host) if phase == LOAD and plan.load_host else ""


def _title(plan: MemoryPlan) -> str:
    work = plan.work
    offload = ""
    if work.offload is not None and work.offload.active:
        offload = ", offload " + offload_keys(work.offload).replace("offload.", "")
    checkpointing = ", activation checkpointing" if work.activation_checkpointing else ""
    title = (
        f"{plan.spec.name}: {work.prompt_tokens:,} prompt tokens, G={work.group}, "
        f"{work.response_tokens} response tokens, chunk {work.chunk_size}"
        f"{' (auto)' if work.chunk_auto else ''}, "
        f"{work.gradient}{checkpointing}, {work.gpus} GPU(s){offload}"
    )
    if plan.layout is not None and work.stages > 1:
        layers = plan.layout.layers_of(plan.stage)
        title += (
            f", {work.stages} stages x {work.replicas} replica(s); worst stage {plan.stage} "
            f"(layers {layers.start}-{layers.stop - 1})"
        )
    return title


def stage_rows(plan: MemoryPlan) -> list[tuple[str, ...]]:
    """One row per stage: its layers, what it holds, its peak and its phase."""
    if plan.layout is None:
        return []
    attention = full_attention_counts(plan.spec, plan.layout)
    rows = []
    for stage in plan.stage_plans:
        layers = plan.layout.layers_of(stage.stage)
        state = sum(line.device for line in stage.lines if line.name.startswith("prefix state"))
        grads = sum(line.device for line in stage.lines if line.name == "dS (exact)")
        rows.append(
            (
                str(stage.stage),
                f"{layers.start}-{layers.stop - 1}",
                str(attention[stage.stage]),
                human_bytes(stage.line("parameters").device),
                human_bytes(state),
                human_bytes(grads) if grads else "",
                human_bytes(stage.peak),
                stage.peak_phase,
            )
        )
    return rows


STAGE_HEADER = ("stage", "layers", "full attn", "parameters", "prefix state", "dS", "peak", "in")


def render_stages_text(plan: MemoryPlan) -> str:
    """The per-stage table as aligned text (empty with one stage)."""
    rows = stage_rows(plan)
    if not rows:
        return ""
    return _aligned([STAGE_HEADER, *rows], "per stage")


def render_stages_markdown(plan: MemoryPlan) -> str:
    rows = stage_rows(plan)
    if not rows:
        return ""
    lines = ["| " + " | ".join(STAGE_HEADER) + " |", "|" + "---|" * len(STAGE_HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


TIME_HEADER = ("phase", "seconds", "share", "bound", "PFLOP", "between stages", "PCIe")


def time_rows(estimate: TimeEstimate) -> list[tuple[str, ...]]:
    """Phase -> seconds (and what bounds it, its FLOPs and traffic), then the total."""
    total = estimate.total
    rows = [
        (
            phase.name,
            f"{phase.seconds:,.1f}",
            f"{phase.seconds / total:.1%}" if total else "-",
            phase.bound,
            f"{phase.flops / 1e15:,.1f}",
            f"{phase.link_bytes / 1e9:,.1f} GB" if phase.link_bytes else "",
            f"{phase.pcie_bytes / 1e9:,.0f} GB" if phase.pcie_bytes else "",
        )
        for phase in estimate.phases
    ]
    flops = sum(phase.flops for phase in estimate.phases)
    rows.append(("step", f"{total:,.1f}", "100.0%", "", f"{flops / 1e15:,.1f}", "", ""))
    return rows


def time_assumptions(estimate: TimeEstimate) -> list[str]:
    """What the time estimate assumes, in words (printed under its table)."""
    work = estimate.work
    return [
        estimate.hardware.describe(),
        f"values: {describe_sources(estimate.hardware)}",
        time_kernels(estimate),
        f"one stage group of {estimate.layout.stages} GPU(s) training one prompt "
        f"({work.replicas} replica(s) run theirs side by side); stages "
        f"{estimate.layout.describe()}",
        "per stage a roofline (the slowest of FLOPs, HBM bytes, PCIe bytes); each phase's "
        "schedule played under NCCL's rules with those costs and a hop per message "
        "(pipeline.simulate): prefill's chunks forward, rollout's micro-groups around the "
        "ring of stages, replay's pieces and the sweep's chunks (1F1B), bubbles included",
        "FLOPs from shapes: 2 x active parameters per token, causal attention 4 x heads x "
        "head_dim per query-key pair, MLA absorbed over its top-k, the DSA indexer over every "
        f"earlier key; backward: input gradients (weight gradients too: "
        f"{'yes' if not work.lora_rank else 'no, LoRA'}), attention 2.5x its forward",
        "not counted: kernel launches and Python, rewards and sampling, FSDP gathers, "
        "checkpoint I/O, the reference model (beta = 0), imbalance between MoE experts",
    ]


def time_kernels(estimate: TimeEstimate) -> str:
    """Which kernels the estimate's one MFU stands for (what make gpu-check checks ran)."""
    records = {layer.record for layer in estimate.spec.layers}
    if estimate.work.device == "cuda":
        kernels = [kind.plan.cuda_kernels for kind in kinds() if kind.name in records]
    else:
        kernels = ["CPU kernels: PyTorch's fused attention for float32, the torch loops otherwise"]
    if estimate.work.quantization is not None:
        kernels.append(
            f"{estimate.work.quantization.upper()} weights dequantized by bitsandbytes before "
            f"each matmul of more than {NF4_FUSED_ROWS} rows and in every backward (HBM bytes, "
            "added to the roofline)"
        )
    return f"kernels (all at the one MFU): {'; '.join(kernels)}"


def render_time_text(estimate: TimeEstimate) -> str:
    head = f"time per step ({estimate.hardware.name}, {estimate.layout.stages} stage(s))"
    out = [_aligned([TIME_HEADER, *time_rows(estimate)], head)]
    out += [f"phase {p.name}: {p.note}" for p in estimate.phases]
    out += [f"assumes: {line}" for line in time_assumptions(estimate)]
    return "\n".join(out)


def _aligned(rows: list[tuple[str, ...]], title: str) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [title]
    for row in rows:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def render_text(plan: MemoryPlan) -> str:
    """Plain aligned text (used when ``rich`` is missing, and in logs)."""
    rows = [("", "device", "CPU", ""), *table_rows(plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = [_title(plan)]
    for row in rows:
        out.append(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}")
    stages = render_stages_text(plan)
    out += [stages] if stages else []
    out += [f"advice: {line}" for line in plan.advice]
    out += [f"assumes: {line}" for line in assumptions(plan)]
    return "\n".join(out)


def render_markdown(plan: MemoryPlan) -> str:
    lines = [f"**{_title(plan)}**", "", "| | device | CPU | note |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows(plan)]
    lines.append("")
    stages = render_stages_markdown(plan)
    lines += [stages, ""] if stages else []
    lines += [f"- advice: {line}" for line in plan.advice]
    return "\n".join(lines)


def print_plan(plan: MemoryPlan) -> None:
    """The table with ``rich`` when installed, plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_text(plan))
        return
    table = Table(title=_title(plan), title_justify="left")
    for name, justify in (("", "left"), ("device", "right"), ("CPU", "right"), ("", "left")):
        table.add_column(name, justify=justify)
    rows = table_rows(plan)
    for index, row in enumerate(rows):
        style = "bold" if index == len(rows) - 1 else None
        table.add_row(*row, style=style, end_section=index == len(plan.lines) - 1)
    console = Console(width=max(120, Console().width))
    console.print(table)
    _print_rows(console, STAGE_HEADER, stage_rows(plan), "per stage")
    for line in plan.advice:
        console.print(f"advice: {line}")
    for line in assumptions(plan):
        console.print(f"[dim]assumes: {line}[/dim]")


def print_time(estimate: TimeEstimate) -> None:
    """The time estimate's table with ``rich`` when installed, plain text otherwise."""
    try:
        from rich.console import Console
    except ImportError:
        print(render_time_text(estimate))
        return
    console = Console(width=max(120, Console().width))
    title = f"time per step ({estimate.hardware.name}, {estimate.layout.stages} stage(s))"
    _print_rows(console, TIME_HEADER, time_rows(estimate), title)
    for phase in estimate.phases:
        console.print(f"phase {phase.name}: {phase.note}")
    for line in time_assumptions(estimate):
        console.print(f"[dim]assumes: {line}[/dim]")


def _print_rows(
    console: Any, header: tuple[str, ...], rows: list[tuple[str, ...]], title: str
) -> None:
    if not rows:
        return
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
