"""The plan as a rich table, plain text or markdown."""

from __future__ import annotations

from longstraw_core.plan.advice import offload_keys
from longstraw_core.plan.core import MemoryPlan
from longstraw_core.plan.model import Workload
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


def _head_chunk_elements() -> int:
    from model_adapters.base import HEAD_CHUNK_ELEMENTS

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
    rows += [(f"peak in {name}", human_bytes(value), "", "") for name, value in plan.phases.items()]
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


def _title(plan: MemoryPlan) -> str:
    work = plan.work
    offload = ""
    if work.offload is not None and work.offload.active:
        offload = ", offload " + offload_keys(work.offload).replace("offload.", "")
    checkpointing = ", activation checkpointing" if work.activation_checkpointing else ""
    return (
        f"{plan.spec.name}: {work.prompt_tokens:,} prompt tokens, G={work.group}, "
        f"{work.response_tokens} response tokens, chunk {work.chunk_size}, "
        f"{work.gradient}{checkpointing}, {work.gpus} GPU(s){offload}"
    )


def render_text(plan: MemoryPlan) -> str:
    """Plain aligned text (used when ``rich`` is missing, and in logs)."""
    rows = [("", "device", "CPU", ""), *table_rows(plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = [_title(plan)]
    for row in rows:
        out.append(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}")
    out += [f"advice: {line}" for line in plan.advice]
    out += [f"assumes: {line}" for line in assumptions(plan)]
    return "\n".join(out)


def render_markdown(plan: MemoryPlan) -> str:
    lines = [f"**{_title(plan)}**", "", "| | device | CPU | note |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows(plan)]
    lines.append("")
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
    for line in plan.advice:
        console.print(f"advice: {line}")
    for line in assumptions(plan):
        console.print(f"[dim]assumes: {line}[/dim]")
