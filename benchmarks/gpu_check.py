"""``make gpu-check``: what a machine with CUDA GPUs checks that no CPU test can, reported
whatever happens.

Four phases, each an entry of one JSON file (``--out``), and a non-zero exit when any fails:

1. ``tests``: the suite's ``gpu``-marked tests (offload streams and pinned arenas, the
   flash-attn / SDPA attention backends against the torch one, flash-linear-attention
   against transformers' torch Gated DeltaNet, the fused recurrent decode kernel included).
   A missing kernel package fails the phase: skipped GPU tests would hide it.
2. ``recipes``: one GRPO step of each family's recipe (qwen3 dense, Qwen3.6 = ``qwen3_5_text``,
   GLM-5.x = ``glm_moe_dsa``) in bfloat16 with GPU-sized head dims (the GPU kernels' minimum
   is above the CPU toys' 8/12), the prefix state offloaded to pinned host memory, exact
   gradients and a checkpoint written; the kernels each run chose are recorded
   (``kernel_trace``) and a torch fallback on CUDA fails it.
3. ``benchmark``: the device's matmul and copy peaks, then per family the adapter's prefill
   against the transformers model's own no-grad forward (tokens/s, TFLOP/s, kernels); from
   these the ``calibration`` block the planner's ``--calibration`` reads (MFU per family
   against the GPU's datasheet peak, HBM bandwidth efficiency).
4. ``multi_gpu``: with two or more GPUs, each recipe on two pipeline stages over NCCL
   (``torchrun --nproc_per_node 2 ... distributed.pipeline_stages=2``); skipped, with the
   reason recorded, on one GPU.

Whatever happens, the record says it (``gpu_check_report``): each step runs in its own
process session under its own limit (``LIMITS_S``: they and the start-up fit inside the outer
limit the shell's ``timeout`` enforces, ``OUTER_LIMIT_S``), the JSON is rewritten when a step
starts and ends, and a phase that fails, crashes, times out or is killed keeps its entry.

Kernels: the library falls back to its torch paths when a fused kernel is missing or refuses
the inputs (on a user's GPU that trains, slower); this check does not accept that on CUDA:
attention must run flash-attn or PyTorch's SDPA flash kernels (except MLA's latent
attention, whose unequal head dims no fused kernel takes: torch by design) and Gated
DeltaNet flash-linear-attention.

``--device cpu --quick`` runs phases 2 and 3 shortened on CPU in float32 (phases 1 and 4 are
recorded as skipped: they need CUDA), what ``tests/test_gpu_check.py`` checks. It was written
without a GPU: it has not run on one yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import kernel_trace
from gpu_check_report import Killed, Phase, Report, Step, run_step, stop_on_signals

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
FAMILIES = ("qwen3", "qwen3_5_text", "glm_moe_dsa")
PHASES = ("tests", "recipes", "benchmark", "multi_gpu")

# --- the time budget: every limit in one place ---------------------------------------------------
# The shell's `timeout` (gpu_check.sh reads it: `gpu_check.py --outer-limit`): under the device
# tool's 600 s a command, with the wheels' install before it.
OUTER_LIMIT_S = 560
# Python's start, imports (torch), the environment's probe and the JSON writes, outside any step.
START_AND_WRITE_S = 30
# Each step's own limit (seconds): what a step may take before its process group is ended.
LIMITS_S: dict[str, dict[str, int]] = {
    "tests": {"pytest": 110},
    "recipes": {"qwen3": 50, "qwen3_5_text": 80, "glm_moe_dsa": 70},
    "benchmark": {"peaks": 20, "qwen3": 40, "qwen3_5_text": 50},
    "multi_gpu": {"qwen36": 55, "glm52": 55},
}
# On CPU (``--device cpu``: the self-test) each step may take this many times its limit: the
# limits are sized for the GPU, a shared 2-core machine runs the same steps slower, and the
# phases a CPU skips (tests, multi_gpu) leave their share of the outer limit, which still
# bounds the whole.
CPU_LIMIT_FACTOR = 2
# A step is not started with less than this left before the outer limit (less the writes).
MIN_STEP_S = 5
# NCCL's watchdog ends a hung collective or point-to-point op after this (the run config's
# distributed.timeout_minutes), inside the step's limit, printing the op that hung.
NCCL_TIMEOUT_MINUTES = 0.5


def inner_total_s() -> int:
    """Every step's limit added up: with ``START_AND_WRITE_S``, within ``OUTER_LIMIT_S``."""
    return sum(sum(steps.values()) for steps in LIMITS_S.values())


# The test files holding ``gpu``-marked tests: collecting only these keeps the packages other
# test files import (wandb, datasets) off the GPU machine. ``test_gpu_check`` keeps it whole.
GPU_TEST_FILES = (
    "tests/attention/test_attention.py",
    "tests/plan/test_gpu_emulation.py",
    "tests/offload/test_offload.py",
    "tests/offload/test_pinned.py",
    "tests/families/test_qwen36_adapter.py",
)
# Head dims the GPU kernels take (fla's Gated DeltaNet kernels want 64 and up; flash/SDPA
# need multiples of 8), on the tiny configs' few layers and small widths.
GPU_DIMS: dict[str, dict[str, int]] = {
    "qwen3": {"head_dim": 64},
    "qwen3_5_text": {"head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
    "glm_moe_dsa": {
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "index_head_dim": 64,
    },
}
_RECIPES = {
    "qwen3": ("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
    "qwen3_5_text": ("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
    "glm_moe_dsa": ("recipes/grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml"),
}
# The two-stage runs: recipe -> the family it trains.
MULTI_GPU = {"qwen36": "qwen3_5_text", "glm52": "glm_moe_dsa"}
BENCH_FAMILIES = ("qwen3", "qwen3_5_text")  # gpu_check_bench.BENCH_MODELS
# The packages whose kernels the check exercises (distribution names), versions recorded.
KERNEL_PACKAGES = ("flash-linear-attention", "fla-core", "flash-attn", "triton", "causal-conv1d")
_OWNED = ".made-by-gpu-check"  # marks the output folders this check may clear and reuse


@dataclass(frozen=True)
class Settings:
    device: str
    quick: bool
    out: Path
    work: Path  # logs, kernel records, the recipes' output folders
    phases: tuple[str, ...]
    families: tuple[str, ...]
    prompt_tokens: int

    @property
    def dtype_name(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="short prompts (CPU self-test)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/gpu_check/gpu_check.json")
    parser.add_argument("--work", type=Path, help="logs and run outputs (default: beside --out)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument(
        "--outer-limit", action="store_true", help="print OUTER_LIMIT_S (for gpu_check.sh)"
    )
    args = parser.parse_args(argv)
    if args.outer_limit:
        print(OUTER_LIMIT_S)
        parser.exit()
    phases = tuple(p for p in args.phases.split(",") if p)
    families = tuple(f for f in args.families.split(",") if f)
    unknown = sorted(set(phases) - set(PHASES)) + sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown phases/families {unknown}: phases {PHASES}, families {FAMILIES}")
    return Settings(
        device=args.device,
        quick=args.quick,
        out=args.out,
        work=args.work or args.out.parent / "work",
        phases=phases,
        families=families,
        prompt_tokens=512 if args.quick else 8192,
    )


def steps_of(phase: str, settings: Settings) -> list[str]:
    """The steps ``phase`` runs for these settings (its limits' keys, filtered)."""
    if phase == "recipes":
        return [f for f in FAMILIES if f in settings.families]
    if phase == "benchmark":
        return ["peaks", *(f for f in BENCH_FAMILIES if f in settings.families)]
    if phase == "multi_gpu":
        return [name for name, family in MULTI_GPU.items() if family in settings.families]
    return list(LIMITS_S[phase])


def skip_reason(phase: str, settings: Settings, environment: dict[str, Any]) -> str | None:
    """Why ``phase`` cannot run here (recorded as its entry), or None."""
    if phase in ("tests", "multi_gpu") and settings.device != "cuda":
        return "needs CUDA (--device cpu)"
    if phase == "multi_gpu" and environment.get("cuda_devices", 0) < 2:
        count = environment.get("cuda_devices", 0)
        return f"{count} CUDA GPU(s) here: the two-stage NCCL runs need 2"
    if phase != "tests" and not steps_of(phase, settings):
        return f"no step for families {list(settings.families)}"
    return None


class Budget:
    """Each step's limit: its own (``LIMITS_S``), cut to what is left of the outer limit."""

    def __init__(self, factor: float = 1) -> None:
        self.start = time.monotonic()
        self.factor = factor  # CPU_LIMIT_FACTOR on CPU

    def limit(self, phase: str, step: str) -> float:
        left = OUTER_LIMIT_S - START_AND_WRITE_S / 2 - (time.monotonic() - self.start)
        return min(LIMITS_S[phase][step] * self.factor, left)


def _run(
    report: Report, phase: Phase, budget: Budget, step: str, command: list[str], check: Any
) -> Step:
    """One step under its limit, or recorded as skipped when too little time is left."""
    limit = budget.limit(phase.name, step)
    if limit < MIN_STEP_S:
        phase.steps[step] = Step(step, status="skipped", error="no time left in the budget")
        report.write()
        return phase.steps[step]
    log = report_log(phase.name, step, report)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return run_step(
        report, phase, step, command, limit=limit, log=log, cwd=ROOT, env=env, check=check
    )


def report_log(phase: str, step: str, report: Report) -> Path:
    return Path(report.header["settings"]["work"]) / "logs" / f"{phase}_{step}.log"


# --- phase 1: the gpu-marked tests ------------------------------------------------------------


def run_gpu_tests(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    missing = [name for name in ("fla", "triton") if not _importable(name)]
    junit = settings.work / "gpu_tests.xml"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", f"--junitxml={junit}"]
    command += [*GPU_TEST_FILES, "-p", "no:cacheprovider"]

    def check(step: Step) -> str | None:
        counts = _junit_counts(junit)
        step.details.update(counts, missing_packages=missing)
        if missing:
            return f"{missing} missing (make gpu-wheels, and carry wheels/)"
        return None if counts.get("passed") else "no gpu test passed"

    _run(report, phase, budget, "pytest", command, check)


def _junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, failures = int(suite.get("tests", 0)), int(suite.get("failures", 0))
    errors, skipped = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
    passed = tests - failures - errors - skipped
    return {"passed": passed, "failed": failures, "errors": errors, "skipped": skipped}


# --- phase 2: one recipe step per family -------------------------------------------------------


def recipe_overrides(family: str, settings: Settings, output_dir: Path) -> list[str]:
    """The recipe's key=value overrides for one bf16 (CPU: float32) GRPO step of ``family``:
    GPU head dims on CUDA, the state offloaded (pinned on CUDA), exact gradients, one save."""
    overrides = [
        f"model.tiny={family}",
        f"model.dtype={settings.dtype_name}",
        f"data.prompt_tokens={settings.prompt_tokens}",
        f"train.chunk_size={max(256, settings.prompt_tokens // 4)}",
        "train.steps=1",
        "train.save_every=1",
        f"train.output_dir={output_dir}",
        "tracking.wandb=false",
        "rollout.num_generations=4",
        "rollout.max_new_tokens=8",
        "grpo.gradient=exact",
        "offload.attention=cpu",
        "offload.recurrent=cpu",
        "offload.latent=cpu",
    ]
    if settings.device == "cuda":
        overrides += [f"model.tiny_overrides.{k}={v}" for k, v in GPU_DIMS[family].items()]
    return overrides


def recipe_command(family: str, settings: Settings, output_dir: Path, kernels: Path) -> list[str]:
    """The recipe run under ``kernel_trace`` (its kernel choices written to ``kernels``)."""
    script, config = _RECIPES[family]
    return [
        sys.executable, str(BENCHMARKS / "kernel_trace.py"), "--record", str(kernels),
        str(ROOT / script), "--config", str(ROOT / config),
        *recipe_overrides(family, settings, output_dir),
    ]  # fmt: skip


def multi_gpu_command(name: str, settings: Settings, output_dir: Path, kernels: Path) -> list[str]:
    """``name``'s recipe on two pipeline stages, one GPU each, under torchrun (NCCL: the
    recipe's Accelerator takes it, and each rank's GPU from LOCAL_RANK); each rank's kernels
    in ``kernels`` with ``{rank}`` filled in."""
    family = MULTI_GPU[name]
    script, config = _RECIPES[family]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(BENCHMARKS / "kernel_trace.py"), "--record", str(kernels),
        str(ROOT / script), "--config", str(ROOT / config),
        *recipe_overrides(family, settings, output_dir),
        "distributed.pipeline_stages=2", f"distributed.timeout_minutes={NCCL_TIMEOUT_MINUTES}",
    ]  # fmt: skip


def fresh_output(path: Path) -> None:
    """An empty output folder for a run: one this check made before is cleared; anything
    else there is left alone and the run refused."""
    if path.exists():
        if not (path / _OWNED).exists():
            raise FileExistsError(
                f"{path} exists and was not made by gpu-check: use another --work"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / _OWNED).touch()


def run_recipes(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    for family in steps_of("recipes", settings):
        output_dir = settings.work / f"recipe_{family}"
        kernels = settings.work / f"kernels_recipe_{family}.json"
        fresh_output(output_dir)
        kernels.unlink(missing_ok=True)
        check = run_check(settings, output_dir, [kernels], family)
        command = recipe_command(family, settings, output_dir, kernels)
        _run(report, phase, budget, family, command, check)


def run_check(settings: Settings, output_dir: Path, records: list[Path], family: str) -> Any:
    """A recipe run's check: a checkpoint written, and (CUDA) no torch fallback among the
    kernels its processes chose (``kernel_trace.failures``)."""

    def check(step: Step) -> str | None:
        saved = (output_dir / "latest").exists()
        record = merged_record(records)
        step.details.update(checkpoint_saved=saved, kernels=record)
        problems = [] if saved else [f"no checkpoint in {output_dir}"]
        problems += kernel_trace.failures(record, settings.device, family)
        return "; ".join(problems) or None

    return check


def merged_record(paths: list[Path]) -> dict[str, dict[str, int]]:
    """The kernel records of a run's processes, added up (a stage sees only its layers)."""
    merged: dict[str, Counter[str]] = {}
    for path in paths:
        if path.exists():
            for kind, counts in json.loads(path.read_text()).items():
                merged.setdefault(kind, Counter()).update(counts)
    return {kind: dict(counts) for kind, counts in merged.items()}


# --- phase 3: the device's peaks, prefill speed, the planner's calibration ---------------------


def bench_command(step: str, settings: Settings, row: Path) -> list[str]:
    what = ["--peaks"] if step == "peaks" else ["--family", step]
    command = [sys.executable, str(BENCHMARKS / "gpu_check_bench.py"), *what]
    command += ["--device", settings.device, "--out", str(row)]
    return [*command, "--quick"] if settings.quick else command


def run_benchmark(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    for name in steps_of("benchmark", settings):
        row = settings.work / f"bench_{name}.json"
        row.unlink(missing_ok=True)

        def check(step: Step, row: Path = row, name: str = name) -> str | None:
            if not row.exists():
                return f"no result written ({row})"
            step.details.update(json.loads(row.read_text()))
            if name == "peaks":
                return None
            kernels = step.details["kernels"]
            problems = kernel_trace.failures(kernels, settings.device, name)
            return "; ".join(problems) or None

        _run(report, phase, budget, name, bench_command(name, settings, row), check)
        gpu = (report.header.get("environment") or {}).get("gpu")
        report.header["calibration"] = calibration_block(phase, settings, gpu)
        report.write()


def calibration_block(phase: Phase, settings: Settings, gpu: str | None) -> dict[str, Any] | None:
    """What the planner's ``--calibration`` reads (``longstraw_core.plan.calibration``): the
    MFU per family, the prefill's TFLOP/s over the GPU's datasheet peak (no datasheet, e.g.
    on CPU: over the matmul peak measured here), the lowest as ``mfu``; the bandwidth
    efficiency, a device copy over the datasheet HBM bandwidth (with a datasheet only)."""
    from longstraw_core.plan.calibration import datasheet

    peaks = phase.steps.get("peaks")
    peaks = peaks.details if peaks is not None and peaks.status == "passed" else {}
    device = peaks.get("device_name") or gpu or settings.device
    sheet = datasheet(device) if settings.device == "cuda" else None
    if sheet is not None:
        basis, reference = sheet.tflops, f"{device}'s datasheet {sheet.tflops:g} TFLOP/s"
    elif peaks.get("matmul_tflop_per_s"):
        basis = peaks["matmul_tflop_per_s"]
        reference = f"the {peaks['matmul_dtype']} matmul peak measured on {device}, {basis:.3g}"
    else:
        return None
    by_type = {}
    for family in BENCH_FAMILIES:
        step = phase.steps.get(family)
        if step is None or step.status != "passed":
            continue
        row, kernels = step.details, step.details["kernels"]
        chosen = sorted({*kernels.get("attention", {}), *kernels.get("deltanet", {})})
        by_type[family] = {
            "value": float(f"{min(row['prefill_tflop_per_s'] / basis, 1.0):.3g}"),
            "note": f"{family} prefill at {row['prefill_tflop_per_s']:.3g} TFLOP/s of "
            f"{reference} ({row['tokens']} tokens, {row['dtype']}; kernels {', '.join(chosen)})",
        }
    if not by_type:
        return None
    lowest = min(by_type, key=lambda family: by_type[family]["value"])
    values: dict[str, float] = {"mfu": by_type[lowest]["value"]}
    notes = {"mfu": f"the lowest family's, {by_type[lowest]['note']}"}
    if sheet is not None and peaks.get("copy_tbps"):
        values["bandwidth_efficiency"] = float(f"{min(peaks['copy_tbps'] / sheet.hbm_tbps, 1):.3g}")
        notes["bandwidth_efficiency"] = (
            f"a device copy at {peaks['copy_tbps']:.3g} TB/s of {device}'s datasheet "
            f"{sheet.hbm_tbps:g} TB/s"
        )
    return {"measured_on": device, "values": values, "notes": notes, "mfu_by_model_type": by_type}


# --- phase 4: each recipe on two pipeline stages over NCCL ----------------------------------------


def run_multi_gpu(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    for name in steps_of("multi_gpu", settings):
        output_dir = settings.work / f"multi_gpu_{name}"
        records = [settings.work / f"kernels_multi_gpu_{name}_{rank}.json" for rank in (0, 1)]
        fresh_output(output_dir)
        for record in records:
            record.unlink(missing_ok=True)
        template = settings.work / f"kernels_multi_gpu_{name}_{{rank}}.json"
        check = run_check(settings, output_dir, records, MULTI_GPU[name])
        command = multi_gpu_command(name, settings, output_dir, template)
        _run(report, phase, budget, name, command, check)


# --- running ------------------------------------------------------------------------------------

RUNNERS = {
    "tests": run_gpu_tests,
    "recipes": run_recipes,
    "benchmark": run_benchmark,
    "multi_gpu": run_multi_gpu,
}


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def environment() -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for name in KERNEL_PACKAGES:  # versions without importing (triton's import probes the GPU)
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    stop_on_signals()
    budget = Budget(CPU_LIMIT_FACTOR if settings.device == "cpu" else 1)
    header: dict[str, Any] = {
        "settings": {**asdict(settings), "out": str(settings.out), "work": str(settings.work)},
        "budget": {
            "outer_s": OUTER_LIMIT_S,
            "start_and_write_s": START_AND_WRITE_S,
            "inner_total_s": inner_total_s(),
            "limits_s": LIMITS_S,
        },
        "environment": None,
        "calibration": None,
    }
    report = Report(settings.out, header)
    report.plan({p: sum(LIMITS_S[p][s] for s in steps_of(p, settings)) for p in settings.phases})
    killed = False
    try:
        header["environment"] = env = environment()
        report.write()
        if settings.device == "cuda" and not env["cuda_available"]:
            header["error"] = "CUDA is not available (--device cpu runs the CPU self-test)"
            print(f"gpu-check: {header['error']}", file=sys.stderr)
            for name in settings.phases:
                report.skip(name, "CUDA is not available")
            report.finish()
            return 2
        for name in settings.phases:
            reason = skip_reason(name, settings, env)
            if reason is not None:
                report.skip(name, reason)
            else:
                with report.phase(name) as phase:
                    RUNNERS[name](settings, report, phase, budget)
            entry = report.phases[name]
            print(f"gpu-check {name}: {entry.status} ({entry.seconds:.0f} s){_why(entry)}")
    except Killed as signal_name:
        killed = True
        print(f"gpu-check: stopped by {signal_name}", file=sys.stderr)
    finally:
        report.finish()
    print(f"gpu-check: {'passed' if report.ok else 'FAILED'}; results in {settings.out}")
    if killed:
        return 124  # as timeout(1) reports a command it stopped
    return 0 if report.ok else 1


def _why(phase: Phase) -> str:
    return f": {phase.error}" if phase.error and (not phase.ok or phase.status == "skipped") else ""


if __name__ == "__main__":
    sys.exit(main())
