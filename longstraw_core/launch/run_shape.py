"""The run's shape, said once when it starts (rank 0): what is running where.

Why: a run that did not start the way it was meant to looks like any other. ``accelerate
launch --num_processes 2`` on a CPU starts one process; a missing ``distributed.fsdp`` or a
default thread count changes the time per step many times over; nothing said so. The
block names the processes and their launcher, the pipeline stages x replicas, FSDP, the
device and dtypes, the threads per process (``threads``), the model and its layer kinds, the
step (prompt length, G, gradient mode, chunk), and what the planner expects of it per rank
(peak memory; seconds per step on a GPU it has a datasheet for), followed by a warning when
the launcher started fewer processes than asked (``launch_settings.one_process_of_many``)::

    run shape:
      processes  2 (torchrun), 2 on this node; pipeline stages x replicas 1 x 2; FSDP on
      device     cpu:0; weights float32, compute float32
      threads    1 per process (OMP_NUM_THREADS=1)
      model      tiny qwen3_5_text: 4 layers (3 deltanet, 1 gated_attention), 184.92K params; ...
      step       prompts up to 512 tokens, G=8 x up to 16 new tokens, gradient exact, ...
      planner    peak 7.57 MiB per rank (sweep phase; no budget set); time per step: ...

Everything is read from the config, the launch environment and the planner (the model on
``meta``): no weight, no collective, before anything loads.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from longstraw_core import plan
from longstraw_core.launch.settings import one_process_of_many
from longstraw_core.plan.calibration import datasheet
from longstraw_core.plan.units import human_bytes, human_count

if TYPE_CHECKING:
    from longstraw_core.config import RunConfig
    from longstraw_core.parallel.topology import RunTopology
    from longstraw_core.process.threads import ThreadChoice

HEADER = "run shape:"


def launcher(environ: Mapping[str, str]) -> str:
    """What started this process, as its environment tells."""
    accelerate = any(name.startswith("ACCELERATE_") for name in environ)
    if "TORCHELASTIC_RUN_ID" in environ:
        return "accelerate launch, torchrun" if accelerate else "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ:
        return "mpirun"
    return "accelerate launch" if accelerate else "python"


def block(
    cfg: RunConfig,
    topology: RunTopology,
    device: torch.device,
    threads: ThreadChoice,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The shape as printed: a header and one line per aspect, then any launcher warning."""
    environ = os.environ if environ is None else environ
    world = topology.replicas * topology.stages
    spec, work = plan.plan_for_config(cfg, gpus=world, device=device.type)
    rows = [
        ("processes", _processes(world, topology, environ)),
        ("device", _device(cfg, device)),
        ("threads", threads.describe()),
        ("model", _model(cfg, spec)),
        ("step", _step(cfg, work)),
        ("planner", _planner(spec, work, device)),
    ]
    lines = [HEADER, *(f"  {name:<10} {text}" for name, text in rows)]
    mismatch = one_process_of_many(environ) if world == 1 else None
    if mismatch:
        lines.append(f"warning: {mismatch}")
    return "\n".join(lines)


def _processes(world: int, topology: RunTopology, environ: Mapping[str, str]) -> str:
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    nodes = max(world // max(local, 1), 1)
    where = f"{local} on this node" + (f", {nodes} nodes" if nodes > 1 else "")
    return (
        f"{world} ({launcher(environ)}), {where}; pipeline stages x replicas "
        f"{topology.stages} x {topology.replicas}; FSDP {'on' if topology.fsdp else 'off'}"
    )


def _device(cfg: RunConfig, device: torch.device) -> str:
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    compute = "bfloat16" if cfg.distributed.mixed_precision == "bf16" else cfg.model.dtype
    weights = cfg.model.dtype + (
        f", {cfg.model.quantization} base" if cfg.model.quantization else ""
    )
    return f"{name}; weights {weights}, compute {compute}"


def _model(cfg: RunConfig, spec: plan.ModelSpec) -> str:
    kinds = Counter(layer.mixer for layer in spec.layers)
    layers = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    name = spec.name if spec.name.endswith(spec.model_type) else f"{spec.name} ({spec.model_type})"
    lora = cfg.lora
    training = f"LoRA r={lora.r}" if lora.enabled else "full fine-tune"
    return (
        f"{name}: {len(spec.layers)} layers ({layers}), {human_count(spec.params)} params; "
        f"{training}"
    )


def _step(cfg: RunConfig, work: plan.Workload) -> str:
    per_step = cfg.train.prompts_per_step
    return (
        f"prompts up to {work.prompt_tokens:,} tokens, G={work.group} x up to "
        f"{work.response_tokens} new tokens, gradient {work.gradient}, chunk "
        f"{work.chunk_size}, {per_step} prompt{'s' if per_step != 1 else ''} per replica and step"
    )


def _planner(spec: plan.ModelSpec, work: plan.Workload, device: torch.device) -> str:
    memory = plan.plan_memory(spec, work)
    budget = "no budget set" if memory.budget is None else f"budget {human_bytes(memory.budget)}"
    peak = f"peak {human_bytes(memory.peak)} per rank ({memory.peak_phase} phase; {budget})"
    return f"{peak}; time per step: {_time(spec, work, device)}"


def _time(spec: plan.ModelSpec, work: plan.Workload, device: torch.device) -> str:
    """The planner's seconds per step on this GPU's datasheet (MFU and bandwidth efficiency
    assumed), or why there is none."""
    if device.type != "cuda":
        return f"no model for {device.type.upper()}s (the planner times GPUs)"
    sheet = datasheet(torch.cuda.get_device_name(device))
    if sheet is None:
        return f"no datasheet for {torch.cuda.get_device_name(device)} (plan --time --tflops ...)"
    hardware = plan.Hardware(name=sheet.name, tflops=sheet.tflops, hbm_tbps=sheet.hbm_tbps)
    estimate = plan.estimate_time(spec, work, hardware)
    return (
        f"~{estimate.total:.3g} s on {sheet.name} (datasheet peaks, MFU {hardware.mfu:g} "
        "assumed; make gpu-check measures it)"
    )
