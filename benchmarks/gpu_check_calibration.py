"""``make gpu-check``'s reading of the machine (``environment``, ``nvidia_present``) and the
planner's calibration from the benchmark phase (``calibration_block``), apart from the
runner (``gpu_check``) to keep each module short."""

from __future__ import annotations

import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from bench_families import prefill_bench_models
from gpu_check_report import Phase

# The packages whose kernels the check exercises (distribution names), versions recorded.
KERNEL_PACKAGES = ("flash-linear-attention", "fla-core", "flash-attn", "triton", "causal-conv1d")


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


def nvidia_present() -> bool:
    """Whether this machine shows an NVIDIA GPU (its device files or ``nvidia-smi``)."""
    devices = Path("/dev/nvidiactl").exists() or any(Path("/dev").glob("nvidia[0-9]*"))
    return devices or shutil.which("nvidia-smi") is not None


def calibration_block(phase: Phase, settings: Any, gpu: str | None) -> dict[str, Any] | None:
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
    for family in prefill_bench_models():
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
