"""``make gpu-check``: what one machine with CUDA GPUs checks that no CPU test can, in one
run of under ten minutes, reported whatever happens.

The phases (``gpu_check_plan.PHASES``, in order; each an entry of one JSON file, ``--out``;
docs/gpu_check.md says what each answers): ``warmup`` (Triton kernels into a persistent
cache), ``tests`` (the ``gpu``-marked tests; a missing kernel package fails it), the probes
(``collectives``, ``pinned``, ``fla``, ``layers`` in ``gpu_check_probes``; ``fsdp``,
``host_syncs``, ``profile`` in ``gpu_check_rollout``), ``recipes`` (one bf16 GRPO step per
family, GPU head dims, offloaded state, a checkpoint), ``benchmark`` (peaks and prefill: the
planner's ``calibration`` block) and ``multi_gpu`` (pipeline stages over NCCL: S=2 on 2+
GPUs, S=3 with G=2 on 3+). A non-zero exit when any fails.

Whatever happens, the record says it (``gpu_check_report``): each step runs in its own
process session under its own limit (``LIMITS_S``: they and the start-up fit inside the
outer limit the shell's ``timeout`` enforces, ``OUTER_LIMIT_S``), the JSON is rewritten when
a step starts and ends, and a phase that fails, crashes, times out or is killed keeps it.
Kernels: on CUDA a torch fallback fails a run (attention must run flash-attn or PyTorch's
flash kernels, except MLA's latent attention; Gated DeltaNet flash-linear-attention).

Without an NVIDIA GPU it prints the plan and exits 0. ``--device cpu --quick`` runs what a
CPU can shortened, in float32 (the CUDA-only phases recorded as skipped), what
``tests/test_gpu_check.py`` checks. Written without a GPU: it has not run on one yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kernel_trace
from bench_families import gpu_check_models, gpu_shapes, prefill_bench_models
from gpu_check_calibration import (
    calibration_block,
    environment,
    nvidia_present,
)
from gpu_check_plan import (
    LIMITS_S,
    OUTER_LIMIT_S,
    PHASES,
    START_AND_WRITE_S,
    STEP_GPUS,
    inner_total_s,
    one_gpu_total_s,
    plan_text,
)
from gpu_check_report import Killed, Phase, Report, Step, run_step, stop_on_signals

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent

# --- the time budget: every limit in one place (gpu_check_plan, which needs no torch) -----------
# On CPU (``--device cpu``: the self-test) each step may take this many times its limit: the
# limits are sized for the GPU, a shared 2-core machine runs the same steps slower, and the
# phases a CPU skips (tests, multi_gpu) leave their share of the outer limit, which still
# bounds the whole.
CPU_LIMIT_FACTOR = 3
# A step is not started with less than this left before the outer limit (less the writes).
MIN_STEP_S = 5
# NCCL's watchdog ends a hung collective or point-to-point op after this (the run config's
# distributed.timeout_minutes), inside the step's limit, printing the op that hung.
NCCL_TIMEOUT_MINUTES = 0.25


# The test files holding ``gpu``-marked tests: collecting only these keeps the packages other
# test files import (wandb, datasets) off the GPU machine. ``test_gpu_check`` keeps it whole.
GPU_TEST_FILES = (
    "tests/attention/test_attention.py",
    "tests/attention/test_attention_sinks.py",
    "tests/plan/test_gpu_emulation.py",
    "tests/offload/test_offload.py",
    "tests/offload/test_pinned.py",
    "tests/families/test_qwen36_adapter.py",
)
# The pipeline runs: step -> the family it trains (its stages: STEP_GPUS, one GPU each).
MULTI_GPU = {"qwen36": "qwen3_5_text", "glm52": "glm_moe_dsa", "qwen36_s3": "qwen3_5_text"}
# A step's extra overrides: S=3 with a group smaller than the stages (issue #34, item 1).
MULTI_GPU_OVERRIDES = {"qwen36_s3": ["rollout.num_generations=2"]}
# The packages whose kernels the check exercises (distribution names), versions recorded.
_OWNED = ".made-by-gpu-check"  # marks the output folders this check may clear and reuse


def __getattr__(name: str) -> object:
    """``FAMILIES``: the families the check runs (the registry's, read when first asked)."""
    if name == "FAMILIES":
        return gpu_check_models()
    raise AttributeError(name)


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
    parser.add_argument(
        "--families", help="model types (default: every family declaring gpu_check)"
    )
    parser.add_argument(
        "--outer-limit", action="store_true", help="print OUTER_LIMIT_S (for gpu_check.sh)"
    )
    args = parser.parse_args(argv)
    if args.outer_limit:
        print(OUTER_LIMIT_S)
        parser.exit()
    phases = tuple(p for p in args.phases.split(",") if p)
    known = gpu_check_models()
    families = tuple(f for f in (args.families or ",".join(known)).split(",") if f)
    unknown = sorted(set(phases) - set(PHASES)) + sorted(set(families) - set(known))
    if unknown:
        parser.error(f"unknown phases/families {unknown}: phases {PHASES}, families {known}")
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
        return [f for f in gpu_check_models() if f in settings.families]
    if phase == "benchmark":
        return ["peaks", *(f for f in prefill_bench_models() if f in settings.families)]
    if phase == "multi_gpu":
        return [name for name, family in MULTI_GPU.items() if family in settings.families]
    if phase == "layers":
        return [f for f in LIMITS_S["layers"] if f in settings.families]
    return list(LIMITS_S[phase])


# Phases with nothing to run on a CPU (the CUDA sync mode, pinned memory, Triton kernels).
CUDA_ONLY = ("warmup", "tests", "host_syncs", "pinned", "fla", "multi_gpu")


def skip_reason(phase: str, settings: Settings, environment: dict[str, Any]) -> str | None:
    """Why ``phase`` cannot run here (recorded as its entry), or None."""
    if phase in CUDA_ONLY and settings.device != "cuda":
        return "needs CUDA (--device cpu)"
    if phase == "multi_gpu" and environment.get("cuda_devices", 0) < 2:
        count = environment.get("cuda_devices", 0)
        return f"{count} CUDA GPU(s) here: the two-stage NCCL runs need 2"
    if not steps_of(phase, settings):
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
        overrides += [
            f"model.tiny_overrides.{k}={v}" for k, v in gpu_shapes(family).recipe_dims.items()
        ]
    return overrides


def recipe_command(family: str, settings: Settings, output_dir: Path, kernels: Path) -> list[str]:
    """The recipe run under ``kernel_trace`` (its kernel choices written to ``kernels``)."""
    script, config = gpu_shapes(family).recipe
    return [
        sys.executable, str(BENCHMARKS / "kernel_trace.py"), "--record", str(kernels),
        str(ROOT / script), "--config", str(ROOT / config),
        *recipe_overrides(family, settings, output_dir),
    ]  # fmt: skip


def multi_gpu_command(name: str, settings: Settings, output_dir: Path, kernels: Path) -> list[str]:
    """``name``'s recipe on ``STEP_GPUS[name]`` pipeline stages, one GPU each, under
    torchrun (NCCL: the recipe's Accelerator takes it, and each rank's GPU from LOCAL_RANK);
    each rank's kernels in ``kernels`` with ``{rank}`` filled in."""
    family = MULTI_GPU[name]
    script, config = gpu_shapes(family).recipe
    stages = STEP_GPUS[name]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(stages), str(BENCHMARKS / "kernel_trace.py"), "--record", str(kernels),
        str(ROOT / script), "--config", str(ROOT / config),
        *recipe_overrides(family, settings, output_dir), *MULTI_GPU_OVERRIDES.get(name, []),
        f"distributed.pipeline_stages={stages}",
        f"distributed.timeout_minutes={NCCL_TIMEOUT_MINUTES}",
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


# --- phase 4: each recipe on two pipeline stages over NCCL ----------------------------------------


def run_multi_gpu(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    """Each pipeline run the GPUs here allow (on CPU, the self-test: the two-rank ones)."""
    environment = report.header.get("environment") or {}
    have = environment.get("cuda_devices", 0) if settings.device == "cuda" else 2
    for name in steps_of("multi_gpu", settings):
        if STEP_GPUS[name] > have:
            reason = f"needs {STEP_GPUS[name]} GPUs (ranks), {have} here"
            phase.steps[name] = Step(name, status="skipped", error=reason)
            report.write()
            continue
        output_dir = settings.work / f"multi_gpu_{name}"
        ranks = range(STEP_GPUS[name])
        records = [settings.work / f"kernels_multi_gpu_{name}_{rank}.json" for rank in ranks]
        fresh_output(output_dir)
        for record in records:
            record.unlink(missing_ok=True)
        template = settings.work / f"kernels_multi_gpu_{name}_{{rank}}.json"
        check = run_check(settings, output_dir, records, MULTI_GPU[name])
        command = multi_gpu_command(name, settings, output_dir, template)
        _run(report, phase, budget, name, command, check)


# --- the probes: warm-up, collectives, FSDP, host syncs, profile, pinned memory, fla, layers ---

# phase -> (its script, the script's --probe); each step one process writing one JSON row.
PROBE_SCRIPTS = {
    "warmup": ("gpu_check_probes.py", "warmup"),
    "collectives": ("gpu_check_probes.py", "collectives"),
    "pinned": ("gpu_check_probes.py", "pinned"),
    "fla": ("gpu_check_probes.py", "fla"),
    "layers": ("gpu_check_probes.py", "layers"),
    "fsdp": ("gpu_check_rollout.py", "fsdp"),
    "host_syncs": ("gpu_check_rollout.py", "host_syncs"),
    "profile": ("gpu_check_rollout.py", "profile"),
}


def probe_command(phase: str, step: str, settings: Settings, row: Path) -> list[str]:
    script, probe = PROBE_SCRIPTS[phase]
    command = [sys.executable, str(BENCHMARKS / script), "--probe", probe, "--step", step]
    command += ["--device", settings.device, "--out", str(row), "--work", str(settings.work)]
    return [*command, "--quick"] if settings.quick else command


def run_probes(settings: Settings, report: Report, phase: Phase, budget: Budget) -> None:
    """A probe phase's steps: the row's ``problems`` fail the step; a row that says
    ``skipped`` (fla absent here) marks it skipped, with the reason."""
    for name in steps_of(phase.name, settings):
        row = settings.work / f"probe_{phase.name}_{name}.json"
        row.unlink(missing_ok=True)

        def check(step: Step, row: Path = row) -> str | None:
            if not row.exists():
                return f"no result written ({row})"
            result = json.loads(row.read_text())
            step.details.update(result)
            return "; ".join(result.get("problems", [])) or None

        command = probe_command(phase.name, name, settings, row)
        step = _run(report, phase, budget, name, command, check)
        if step.status == "passed" and step.details.get("skipped"):
            step.status, step.error = "skipped", step.details["skipped"]
            report.write()


# --- running ------------------------------------------------------------------------------------

RUNNERS = {
    **dict.fromkeys(PROBE_SCRIPTS, run_probes),
    "tests": run_gpu_tests,
    "recipes": run_recipes,
    "benchmark": run_benchmark,
    "multi_gpu": run_multi_gpu,
}


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if settings.device == "cuda" and not nvidia_present():
        print(plan_text())  # what a GPU run would do; nothing to run here
        print("gpu-check: no NVIDIA GPU here: the plan above, nothing run (--device cpu "
              "--quick self-tests on CPU)")  # fmt: skip
        return 0
    # Triton's compiled kernels (and autotuning results) in a cache that persists on this
    # machine, under outputs/ (never under $OUT): the warm-up phase fills it for the rest.
    os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / "outputs" / "triton_cache"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    stop_on_signals()
    budget = Budget(CPU_LIMIT_FACTOR if settings.device == "cpu" else 1)
    header: dict[str, Any] = {
        "settings": {**asdict(settings), "out": str(settings.out), "work": str(settings.work)},
        "budget": {
            "outer_s": OUTER_LIMIT_S,
            "start_and_write_s": START_AND_WRITE_S,
            "inner_total_s": inner_total_s(),
            "one_gpu_total_s": one_gpu_total_s(),
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
