"""The time estimate's GPU figures, from defaults, flags or a calibration file, and where each
came from.

Why: the estimate is only as good as its MFU and bandwidth efficiencies, which are
assumptions until something measures them. ``make gpu-check`` measures them on the GPU it
runs on (prefill TFLOP/s per model family against the GPU's datasheet peak, a device copy
against its datasheet HBM bandwidth) and writes them into its JSON's ``calibration`` block;
``python -m longstraw_core.plan ... --time --calibration outputs/gpu_check/gpu_check.json``
takes them, and the estimate prints which value came from where.

A calibration file is either that JSON, or a small YAML/JSON mapping of the figures to use
(any of ``FIELDS``), e.g. ``{mfu: 0.3, bandwidth_efficiency: 0.75}``. A flag given on the
command line wins over the file, the file over the defaults (an H20's datasheet, MFU 0.4 and
bandwidth efficiency 0.8 assumed).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longstraw_core.plan.roofline import Hardware

# Hardware field -> the planner flag that sets it.
FIELDS = {
    "name": "--gpu-name",
    "tflops": "--tflops",
    "hbm_tbps": "--hbm-tbps",
    "link_gbps": "--link-gbps",
    "pcie_gbps": "--pcie-gbps",
    "mfu": "--mfu",
    "bandwidth_efficiency": "--bandwidth-efficiency",
    "latency_us": "--link-latency-us",
}
FRACTIONS = ("mfu", "bandwidth_efficiency")
DEFAULT_GPU_CHECK_JSON = "outputs/gpu_check/gpu_check.json"


@dataclass(frozen=True)
class Datasheet:
    """A GPU's published dense bf16 peak and HBM bandwidth (no sparsity)."""

    name: str
    tflops: float
    hbm_tbps: float


# (name tokens that must all appear in torch.cuda.get_device_name(), datasheet); first match.
DATASHEETS: tuple[tuple[tuple[str, ...], Datasheet], ...] = (
    (("H100", "PCIe"), Datasheet("H100 PCIe", 756.0, 2.0)),
    (("H100", "NVL"), Datasheet("H100 NVL", 835.0, 3.9)),
    (("H100",), Datasheet("H100 SXM", 989.0, 3.35)),
    (("H200",), Datasheet("H200", 989.0, 4.8)),
    (("H20",), Datasheet("H20", 148.0, 4.0)),
    (("A100", "80GB"), Datasheet("A100 80GB", 312.0, 2.039)),
    (("A100",), Datasheet("A100 40GB", 312.0, 1.555)),
)


def datasheet(device_name: str) -> Datasheet | None:
    """The datasheet of the GPU ``device_name`` names (as CUDA reports it), or None.

    Matched on whole tokens, so an "H200" is not taken for an "H20"."""
    tokens = set(re.split(r"[^A-Za-z0-9]+", device_name))
    return next((sheet for need, sheet in DATASHEETS if set(need) <= tokens), None)


@dataclass(frozen=True)
class Calibration:
    """Figures read from a calibration file: ``values`` (Hardware fields) with a note each
    saying where it was measured, and for a gpu-check JSON the MFU per model family."""

    path: str
    values: dict[str, Any]
    notes: dict[str, str]
    mfu_by_model_type: dict[str, tuple[float, str]] = field(default_factory=dict)

    def for_model(self, model_type: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The values for a model of ``model_type``: its family's measured MFU when the
        check measured that family, else the file's (the lowest it measured)."""
        values, notes = dict(self.values), dict(self.notes)
        if model_type in self.mfu_by_model_type:
            values["mfu"], notes["mfu"] = self.mfu_by_model_type[model_type]
        elif "mfu" in values and self.mfu_by_model_type:
            notes["mfu"] += f" (no {model_type} figure measured: the lowest family's)"
        return values, notes


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file (see the module); ``ValueError`` naming the
    problem and the fix when it cannot serve."""
    where = Path(path)
    if not where.is_file():
        raise ValueError(
            f"--calibration {path}: no such file (make gpu-check writes "
            f"{DEFAULT_GPU_CHECK_JSON}; or give a YAML/JSON of {', '.join(FIELDS)})"
        )
    try:
        text = where.read_text()
        raw = json.loads(text) if where.suffix == ".json" else _yaml(text)
    except (OSError, ValueError) as error:
        raise ValueError(f"--calibration {path}: unreadable ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--calibration {path}: a mapping of {', '.join(FIELDS)} expected")
    if "phases" in raw:  # make gpu-check's JSON
        return _from_gpu_check(raw, str(path))
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"--calibration {path}: unknown key(s) {unknown}; known: {', '.join(FIELDS)}"
        )
    values = {key: _checked(key, value, path) for key, value in raw.items()}
    return Calibration(str(path), values, {key: f"from {path}" for key in values})


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(str(error).replace("\n", " ")) from None


def _from_gpu_check(raw: dict[str, Any], path: str) -> Calibration:
    block = raw.get("calibration") or {}
    values = block.get("values") or {}
    if not values:
        status = (raw.get("phases", {}).get("benchmark") or {}).get("status", "not run")
        raise ValueError(
            f"--calibration {path}: no measured figures (its benchmark phase: {status}); "
            "run make gpu-check again with the benchmark phase"
        )
    checked = {key: _checked(key, value, path) for key, value in values.items()}
    notes = {key: f"{path}: {block.get('notes', {}).get(key, 'measured')}" for key in checked}
    by_type = {
        model_type: (_checked("mfu", entry["value"], path), f"{path}: {entry['note']}")
        for model_type, entry in (block.get("mfu_by_model_type") or {}).items()
    }
    return Calibration(path, checked, notes, by_type)


def _checked(key: str, value: Any, path: str | Path) -> Any:
    if key not in FIELDS:
        raise ValueError(
            f"--calibration {path}: unknown figure {key!r}; known: {', '.join(FIELDS)}"
        )
    if key == "name":
        return str(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"--calibration {path}: {key}={value!r} must be a positive number")
    if key in FRACTIONS and value > 1:
        raise ValueError(
            f"--calibration {path}: {key}={value!r} is a fraction of a peak, in (0, 1]"
        )
    return float(value)


def resolve_hardware(
    given: dict[str, Any],
    calibration: Calibration | None = None,
    model_type: str | None = None,
) -> Hardware:
    """The estimate's GPU: each field from ``given`` (flags; None: not given), else the
    calibration, else ``Hardware``'s default; ``Hardware.sources`` records which."""
    values, notes = calibration.for_model(model_type) if calibration else ({}, {})
    chosen: dict[str, Any] = {}
    sources: list[tuple[str, str]] = []
    for name, flag in FIELDS.items():
        if given.get(name) is not None:
            chosen[name] = given[name]
            sources.append((name, flag))
        elif name in values:
            chosen[name] = values[name]
            sources.append((name, notes[name]))
    return dataclasses.replace(Hardware(), **chosen, sources=tuple(sources))


def describe_sources(hw: Hardware) -> str:
    """Which of ``hw``'s figures came from where, in one line."""
    default = Hardware()
    given = dict(hw.sources)
    parts = [f"{name} {_show(getattr(hw, name))} ({given[name]})" for name in given]
    parts += [
        f"{name} {_show(getattr(hw, name))} (as given)"
        for name in FIELDS
        if name not in given and getattr(hw, name) != getattr(default, name)
    ]
    assumed = [
        f"{label} {getattr(default, name):g}"
        for name, label in (("mfu", "MFU"), ("bandwidth_efficiency", "bandwidth efficiency"))
        if name not in given and getattr(hw, name) == getattr(default, name)
    ]
    rest = f"{default.name} defaults (datasheet peaks"
    if assumed:
        rest += (
            f"; {' and '.join(assumed)} assumed, not measured: --calibration "
            f"{DEFAULT_GPU_CHECK_JSON} from make gpu-check measures them"
        )
    rest += ")"
    if not parts:
        return rest
    return "; ".join(parts) + f"; the rest: {rest}"


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
