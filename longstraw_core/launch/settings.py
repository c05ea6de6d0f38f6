"""What ``accelerate launch`` hands a recipe: each setting honoured or refused at start.

``accelerate launch`` (with ``--config_file``, or the default file ``accelerate config``
writes) turns its config into environment variables of every process it starts
(``accelerate/commands/launch.py`` -> ``accelerate/utils/launch.py``:
``prepare_simple_launcher_cmd_env``, ``prepare_multi_gpu_env``, ``prepare_deepspeed_cmd_env``).
``Accelerator()`` reads them (``accelerator.py``, ``state.py``) and applies them to what
``accelerator.prepare`` is given: autocast, an FSDP or DeepSpeed wrapper, ``torch.compile``,
gradient accumulation. The recipes never call ``prepare``: LongStraw shards the model itself
(FSDP2 per decoder layer, pipeline stages) and drives every pass, so those settings would be
read and silently do nothing. ``honour`` maps each one onto the run config or refuses it,
before any weight loads, naming the accelerate setting, why, and the LongStraw key to use:

- ``mixed_precision: bf16`` -> ``distributed.mixed_precision=bf16`` (bf16 compute over float32
  master weights; already so when ``model.dtype`` is bfloat16); ``fp16`` / ``fp8``: refused;
- ``gradient_accumulation_steps: N`` -> ``train.prompts_per_step=N`` (a micro-batch is one
  prompt's group per replica); refused when the run config sets another value;
- ``distributed_type: FSDP`` (``ACCELERATE_USE_FSDP`` and ``FSDP_*``), ``DEEPSPEED``,
  ``MEGATRON_LM``, ``parallelism_config``, a dynamo backend: refused, each with the run
  config keys that do the same in LongStraw;
- what the launcher itself does (processes, machines, GPU ids, ports, ``use_cpu``,
  ``num_cpu_threads_per_process``, ``debug``, CPU affinity) needs nothing from the recipe,
  except one trap ``one_process_of_many`` names: ``accelerate launch --num_processes N``
  without ``--multi_gpu`` or a config that starts several (any CPU run without one) starts
  the script once, as one process, and says nothing.

Values are parsed with accelerate's own helpers, as ``Accelerator()`` parses them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from accelerate.utils import parse_choice_from_env, parse_flag_from_env

from longstraw_core.config import ConfigError, RunConfig, validate

# FSDP_* settings of an accelerate fsdp_config and the run config key that does the same.
FSDP_EQUIVALENTS = {
    "FSDP_RESHARD_AFTER_FORWARD": "distributed.reshard_after_forward",
    "FSDP_ACTIVATION_CHECKPOINTING": "train.activation_checkpointing",
}
SHARD_YOURSELF = (
    "LongStraw shards the model itself (FSDP2 per decoder layer, or pipeline stages) and "
    "never hands it to accelerate.prepare, so accelerate's wrapper would never be applied: "
    "use distributed.fsdp=true (and/or distributed.pipeline_stages) in the run config and "
    "distributed_type: MULTI_GPU in the accelerate config"
)


class LaunchSettingsError(ConfigError):
    """accelerate settings LongStraw cannot honour; the message lists every one of them."""

    def __init__(self, refusals: list[str]) -> None:
        listed = "\n".join(f"  - {line}" for line in refusals)
        super().__init__(
            "accelerate",
            "the accelerate launch config sets what LongStraw would otherwise ignore "
            f"silently:\n{listed}",
        )
        self.refusals = refusals


@dataclass
class Resolution:
    """What ``resolve`` decided: the run config to use, notes on what was mapped, refusals."""

    cfg: RunConfig
    notes: list[str] = dataclasses.field(default_factory=list)
    refusals: list[str] = dataclasses.field(default_factory=list)


def resolve(cfg: RunConfig) -> Resolution:
    """Read what accelerate passed this process (its environment) against ``cfg``."""
    result = Resolution(cfg)
    _mixed_precision(result)
    _sharding_plugins(result)
    _gradient_accumulation(result)
    _dynamo(result)
    return result


def honour(cfg: RunConfig, *, rank: int | None = None) -> RunConfig:
    """``cfg`` with accelerate's settings applied, or ``LaunchSettingsError`` (a
    ``ConfigError``) listing every setting refused. Call it right after loading the config,
    before the memory plan and before any weight loads. Rank 0 (``RANK``) prints what was
    mapped."""
    result = resolve(cfg)
    if result.refusals:
        raise LaunchSettingsError(result.refusals)
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank == 0:
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
    return result.cfg


def _mixed_precision(result: Resolution) -> None:
    precision = parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no").lower()
    setting = f"mixed_precision: {precision} (ACCELERATE_MIXED_PRECISION={precision})"
    if precision == "no":
        return
    if precision in ("fp16", "fp8"):
        result.refusals.append(
            f"{setting}: LongStraw computes in bf16 or float32 only (no fp16 loss scaling, no "
            "fp8 kernels); use mixed_precision: bf16 (or 'no' with "
            "distributed.mixed_precision=bf16 in the run config)"
        )
        return
    if precision != "bf16":
        result.refusals.append(f"{setting}: not a precision LongStraw knows; use bf16 or 'no'")
        return
    cfg = result.cfg
    dtype = cfg.model.dtype
    if dtype == "bfloat16" or cfg.distributed.mixed_precision == "bf16":
        result.notes.append(
            f"accelerate {setting}: the run computes in bf16 already "
            f"(model.dtype={dtype}, distributed.mixed_precision="
            f"{cfg.distributed.mixed_precision})"
        )
        return
    mapped = dataclasses.replace(
        cfg, distributed=dataclasses.replace(cfg.distributed, mixed_precision="bf16")
    )
    if not _adopt(result, setting, "distributed.mixed_precision=bf16", mapped):
        return
    how = "FSDP2's bf16 policy" if cfg.distributed.fsdp else "bf16 working weights"
    result.notes.append(
        f"accelerate {setting} -> distributed.mixed_precision=bf16 ({how} over the float32 "
        f"master weights of model.dtype={dtype})"
    )


def _sharding_plugins(result: Resolution) -> None:
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        equivalents = [
            f"{name.lower()}: {os.environ[name]} -> {key}={os.environ[name]}"
            for name, key in FSDP_EQUIVALENTS.items()
            if os.environ.get(name, "").lower() in ("true", "false")
        ]
        if parse_flag_from_env("FSDP_OFFLOAD_PARAMS"):
            equivalents.append(
                "fsdp_offload_params: true -> none (LongStraw offloads the prefix state, "
                "offload.*, not the parameters)"
            )
        also = f" (fsdp_config: {'; '.join(equivalents)})" if equivalents else ""
        result.refusals.append(
            f"distributed_type: FSDP (ACCELERATE_USE_FSDP=true): {SHARD_YOURSELF}{also}"
        )
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        result.refusals.append(
            "distributed_type: DEEPSPEED (ACCELERATE_USE_DEEPSPEED=true): "
            f"{SHARD_YOURSELF}; ZeRO-3 -> distributed.fsdp=true, gradient_clipping -> "
            "optim.max_grad_norm"
        )
    if parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM"):
        result.refusals.append(
            "distributed_type: MEGATRON_LM (ACCELERATE_USE_MEGATRON_LM=true): "
            f"{SHARD_YOURSELF}; pipeline parallelism -> distributed.pipeline_stages"
        )
    if parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG"):
        result.refusals.append(
            "parallelism_config (ACCELERATE_USE_PARALLELISM_CONFIG=true): LongStraw has no "
            "tensor, context or sequence parallelism; a prompt is spread over GPUs by "
            "distributed.pipeline_stages, parameters by distributed.fsdp=true"
        )


def _gradient_accumulation(result: Resolution) -> None:
    """accelerate accumulates N micro-batches per optimizer step; LongStraw's micro-batch is
    one prompt's group on each replica, so N is ``train.prompts_per_step``."""
    raw = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if raw is None or raw.strip() == "1":
        return
    setting = f"gradient_accumulation_steps: {raw} (ACCELERATE_GRADIENT_ACCUMULATION_STEPS={raw})"
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        result.refusals.append(f"{setting}: not a positive integer")
        return
    cfg = result.cfg
    if cfg.train.prompts_per_step not in (1, steps):
        result.refusals.append(
            f"{setting} means train.prompts_per_step={steps} in LongStraw (one prompt's group "
            f"per replica is a micro-batch), but the run config sets train.prompts_per_step="
            f"{cfg.train.prompts_per_step}: make them agree, or drop one"
        )
        return
    mapped = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, prompts_per_step=steps))
    if not _adopt(result, setting, f"train.prompts_per_step={steps}", mapped):
        return
    result.notes.append(
        f"accelerate {setting} -> train.prompts_per_step={steps} (each replica accumulates "
        f"{steps} prompts' groups per optimizer step)"
    )


def _adopt(result: Resolution, setting: str, meaning: str, mapped: RunConfig) -> bool:
    """Take ``mapped`` (the run config with ``meaning``, the setting's LongStraw key, set) as
    the run's when it validates; else refuse ``setting``, naming what the config cannot take."""
    try:
        validate(mapped, check_paths=False)
    except ConfigError as error:
        result.refusals.append(
            f"{setting} means {meaning} in LongStraw, which this run config cannot take: {error}"
        )
        return False
    result.cfg = mapped
    return True


def _dynamo(result: Resolution) -> None:
    backend = parse_choice_from_env("ACCELERATE_DYNAMO_BACKEND", "no").upper()
    if backend == "NO":
        return
    result.refusals.append(
        f"dynamo_backend: {backend} (ACCELERATE_DYNAMO_BACKEND={backend}): accelerate "
        "compiles what accelerator.prepare is given, which the recipe never calls; LongStraw "
        "is not compiled (its passes read and write the prefix state in place, per chunk and "
        "branch lengths); set dynamo_backend: 'no'"
    )


# What accelerate's simple launcher (one process, ``prepare_simple_launcher_cmd_env``) always
# exports, and what it exports only when told of more than one process or machine.
SIMPLE_LAUNCHER = "ACCELERATE_USE_CPU"
MANY_ASKED = "MASTER_ADDR"
# Set by the launchers that do start several processes (torchrun, mpirun): not the trap.
STARTED_MANY = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def one_process_of_many(
    environ: Mapping[str, str] | None = None, launcher_argv: Sequence[str] | None = None
) -> str | None:
    """Why this single process is not the N that ``accelerate launch`` was asked for, and
    how to get N (None: no such launch).

    accelerate's simple launcher runs the script once; it exports ``MASTER_ADDR`` only when
    told of several processes or machines, and no launcher of several processes left its
    world size. ``launcher_argv``: the ``accelerate`` command line (default: this
    process's parent's), read with accelerate's own parser for the N asked for."""
    environ = os.environ if environ is None else environ
    if SIMPLE_LAUNCHER not in environ or MANY_ASKED not in environ:
        return None
    if any(name in environ for name in STARTED_MANY):
        return None
    argv = _parent_argv() if launcher_argv is None else list(launcher_argv)
    asked, where = _processes_asked(argv) or (None, "")
    n = str(asked) if asked else "N"
    flag = f" ({where})" if asked else ""
    return (
        f"accelerate launch was asked for {asked or 'several'} processes{flag} and started "
        "one: without --multi_gpu, or a config file whose distributed_type starts several, "
        f"it runs the script once. For {n} processes: accelerate launch --config_file "
        f"configs/accelerate/cpu_2proc.yaml --num_processes {n} (CPU), accelerate launch "
        f"--multi_gpu --num_processes {n} (GPUs), or torchrun --nproc_per_node {n}"
    )


def _parent_argv() -> list[str]:
    """The command line of the process that started this one ([] where unreadable)."""
    import psutil  # accelerate's own dependency

    try:
        parent = psutil.Process().parent()
        return parent.cmdline() if parent is not None else []
    except psutil.Error:
        return []


def _processes_asked(argv: Sequence[str]) -> tuple[int, str] | None:
    """The processes an ``accelerate launch`` command line asks for, as accelerate reads
    them, and where: ``--num_processes``, else its config file's ``num_processes`` (None:
    neither, or not such a command line)."""
    starts = [i for i, arg in enumerate(argv) if arg in ("launch", "accelerate.commands.launch")]
    if not starts:
        return None
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(list(argv[starts[0] + 1 :]))
    except SystemExit:  # argparse refuses it: not a command line accelerate would run
        return None
    if args.num_processes:
        return args.num_processes, f"--num_processes {args.num_processes}"
    path = args.config_file or (
        default_config_file if os.path.isfile(default_config_file) else None
    )
    if path is None:
        return None
    try:
        asked = load_config_from_file(path).num_processes
    except (OSError, ValueError, TypeError):  # unreadable now: say "several"
        return None
    return (asked, f"num_processes: {asked} in {path}") if asked else None
