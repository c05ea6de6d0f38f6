"""``python -m longstraw_core.plan``: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longstraw_core.adapters import registry
from longstraw_core.offload import OffloadPolicy, placement_fields
from longstraw_core.plan.advice import error_message, plan_memory
from longstraw_core.plan.calibration import (
    DEFAULT_GPU_CHECK_JSON,
    FIELDS,
    Calibration,
    load_calibration,
    resolve_hardware,
)
from longstraw_core.plan.chunking import resolve_chunk
from longstraw_core.plan.core import MemoryPlan
from longstraw_core.plan.output import print_plan, print_time, render_markdown
from longstraw_core.plan.roofline import Hardware
from longstraw_core.plan.sources import (
    PRESET_LORA_TARGETS,
    Scenario,
    plan_for_config,
    scenario_workload,
    spec_for_preset,
)
from longstraw_core.plan.timing import estimate_time

_H20 = Hardware()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m longstraw_core.plan",
        description="Predict the per-GPU memory of one LongStraw GRPO step (no weights loaded).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="a run config (YAML); key=value overrides follow")
    source.add_argument("--preset", choices=sorted(registry.presets()), help="a paper-scale preset")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.chunk_size=2048")
    parser.add_argument("--prompt-tokens", type=int, help="default: data.prompt_tokens")
    parser.add_argument("--group", type=int, help="G; default: rollout.num_generations")
    parser.add_argument("--response-tokens", type=int, help="default: rollout.max_new_tokens")
    parser.add_argument(
        "--chunk-size",
        type=_chunk_arg,
        help="tokens a prompt chunk holds, or auto: the planner's choice (default: "
        "train.chunk_size, auto when null; 8192 for a preset)",
    )
    parser.add_argument("--gradient", choices=("detached", "exact"))
    parser.add_argument("--gpus", type=int, help="ranks (FSDP shards over them)")
    parser.add_argument("--gpu-mem", help="memory per GPU, e.g. 96GiB or 80GB")
    parser.add_argument("--headroom", type=float, help="fraction of --gpu-mem kept free")
    parser.add_argument(
        "--offload",
        action="append",
        default=[],
        metavar="KIND=cpu",
        help="attention=cpu, recurrent=cpu, latent=cpu or all=cpu (repeatable)",
    )
    parser.add_argument("--resident-layers", type=int, help="offloaded layers on the GPU at once")
    parser.add_argument("--lora-rank", type=int, help="preset: LoRA rank (0: full fine-tuning)")
    parser.add_argument(
        "--quantization", choices=("nf4",), help="4-bit decoder linears (QLoRA; needs LoRA)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="which kernels to model")
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="recompute each decoder layer in backward (default: train.activation_checkpointing"
        ", off for a preset)",
    )
    parser.add_argument(
        "--keep-attention-outputs",
        action=argparse.BooleanOptionalAction,
        help="exact mode keeps the prefill's attention outputs for its sweep (default: "
        "grpo.keep_attention_outputs, off for a preset)",
    )
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    stages = parser.add_argument_group("pipeline stages (one prompt over several GPUs)")
    stages.add_argument(
        "--stages",
        type=int,
        help="pipeline stages S: each rank of a stage group holds its layers' weights and "
        "prefix state; GPUs = S x replicas (default: distributed.pipeline_stages, or 1)",
    )
    stages.add_argument(
        "--stage-starts",
        help="each stage's first layer, e.g. 0,8,16 (default: distributed.stage_starts, or "
        "the balanced layout)",
    )
    stages.add_argument(
        "--replay-pieces",
        type=int,
        help="pieces each replayed branch is cut into on S > 1 stages (default: "
        "distributed.replay_pieces, or the schedule's choice: S=8, G=8: 5)",
    )
    timing = parser.add_argument_group(
        "time estimate (printed with --time, and always with S > 1); a flag given wins over "
        "--calibration, which wins over the defaults (an H20)"
    )
    timing.add_argument("--time", action="store_true", help="print seconds per phase")
    timing.add_argument(
        "--calibration",
        help=f"make gpu-check's JSON ({DEFAULT_GPU_CHECK_JSON}: measured MFU and bandwidth "
        "efficiency) or a YAML/JSON of the figures below, e.g. {mfu: 0.3}",
    )
    timing.add_argument("--gpu-name", help=f"default: {_H20.name}")
    timing.add_argument("--tflops", type=float, help="dense bf16 TFLOP/s (H20: 148)")
    timing.add_argument("--hbm-tbps", type=float, help="TB/s (H20: 4.0)")
    timing.add_argument("--link-gbps", type=float, help="GB/s between stages (NVLink: 900)")
    timing.add_argument("--pcie-gbps", type=float, help="GB/s host <-> GPU (PCIe 5: 64)")
    timing.add_argument("--mfu", type=float, help=f"fraction of the FLOP peak (default {_H20.mfu})")
    timing.add_argument(
        "--bandwidth-efficiency",
        type=float,
        help=f"fraction of the bandwidth peaks (default {_H20.bandwidth_efficiency})",
    )
    timing.add_argument(
        "--link-latency-us",
        type=float,
        help=f"microseconds a message between stages (default {_H20.latency_us:g})",
    )
    return parser


def _chunk_arg(text: str) -> int | str:
    """``--chunk-size``: a positive int, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive int or auto")
    return value


def hardware_from(
    args: argparse.Namespace,
    calibration: Calibration | None = None,
    model_type: str | None = None,
) -> Hardware:
    """The GPU the time estimate assumes: the flags given, else ``calibration``'s figures
    (for ``model_type``'s family), else an H20's defaults; each value's source recorded."""
    given = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in FIELDS.items()}
    return resolve_hardware(given, calibration, model_type)


def _stage_starts(args: argparse.Namespace) -> tuple[int, ...] | None:
    if not args.stage_starts:
        return None
    try:
        return tuple(int(part) for part in args.stage_starts.split(","))
    except ValueError:
        raise ValueError(
            f"--stage-starts {args.stage_starts!r}: comma-separated layer indices, e.g. 0,8,16"
        ) from None


def _offload_arg(args: argparse.Namespace) -> OffloadPolicy | None:
    if not args.offload and args.resident_layers is None:
        return None
    fields: dict[str, Any] = {}
    for item in args.offload:
        kind, _, place = item.partition("=")
        kinds = placement_fields() if kind == "all" else (kind,)
        for name in kinds:
            fields[name] = place or "cpu"
    if args.resident_layers is not None:
        fields["resident_layers"] = args.resident_layers
    return OffloadPolicy.parse(fields)


def _cli_plan(args: argparse.Namespace) -> MemoryPlan:
    offload = _offload_arg(args)
    if args.preset:
        scenario = Scenario(
            args.preset,
            args.prompt_tokens or 131072,
            args.gpus or args.stages or 1,
            args.gpu_mem or "96GiB",
            32 if args.lora_rank is None else args.lora_rank,
            PRESET_LORA_TARGETS[args.preset],
            args.stages or 1,
        )
        work = scenario_workload(scenario, args.group or 8, args.gradient or "exact")
        if args.gpu_mem is None:
            work = dataclasses.replace(work, budget=None)
        spec = spec_for_preset(args.preset, work.compute_dtype)
    else:
        from longstraw_core.config import load_config

        overrides = list(args.overrides)
        if args.gradient:
            overrides.append(f"grpo.gradient={args.gradient}")
        if args.chunk_size:
            chunk = "null" if args.chunk_size == "auto" else args.chunk_size
            overrides.append(f"train.chunk_size={chunk}")
        cfg = load_config(args.config, overrides, check_paths=False)
        spec, work = plan_for_config(
            cfg,
            args.prompt_tokens,
            group=args.group,
            gpus=args.gpus,
            gpu_mem=args.gpu_mem,
            offload=offload,
            device=args.device,
            stages=args.stages,
        )
    changes: dict[str, Any] = {}
    if args.stage_starts:
        changes["stage_starts"] = _stage_starts(args)
    if args.replay_pieces is not None:
        changes["replay_pieces"] = args.replay_pieces
    if args.response_tokens:
        changes["response_tokens"] = args.response_tokens
    if args.chunk_size == "auto":
        changes["chunk_auto"] = True
    elif args.chunk_size:
        changes["chunk_size"], changes["chunk_auto"] = args.chunk_size, False
    if args.headroom is not None:
        changes["headroom"] = args.headroom
    if offload is not None:
        changes["offload"] = offload
    if args.device:
        changes["device"] = args.device
    if args.activation_checkpointing is not None:
        changes["activation_checkpointing"] = args.activation_checkpointing
    if args.keep_attention_outputs is not None:
        changes["keep_attention_outputs"] = args.keep_attention_outputs
    if args.quantization:
        changes["quantization"] = args.quantization
    # auto: chosen again for the workload as changed (another chunk may suit it better)
    return plan_memory(spec, resolve_chunk(spec, dataclasses.replace(work, **changes)))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; exit 1 with the fix named when it does not fit the budget."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if not args.config and not args.preset:
        parser.error("give --config PATH or --preset NAME")
    try:
        # read before any planning: a bad file is named before the model is built
        calibration = load_calibration(args.calibration) if args.calibration else None
        plan = _cli_plan(args)
    except (ValueError, OSError) as exc:
        hint = ""
        if "model.path" in str(exc) or isinstance(exc, OSError):
            hint = (
                f" (no weights are needed: a checkpoint's config.json, or a preset: "
                f"model.path={' / '.join(registry.presets())} or --preset)"
            )
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    print_plan(plan)
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(plan) + "\n")
    if args.time or args.calibration or plan.work.stages > 1:
        hardware = hardware_from(args, calibration, plan.spec.model_type)
        print_time(estimate_time(plan.spec, plan.work, hardware))
    if plan.fits is False:
        print(f"error: {error_message(plan)}", file=sys.stderr)
        return 1
    return 0
