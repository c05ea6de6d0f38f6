"""The time estimate's GPU figures: defaults, flags, a calibration file, and where each came
from (printed with the estimate). make gpu-check's own JSON is fed in by
``tests/test_gpu_check.py``, which produces one on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longstraw_core.plan.calibration import (
    Calibration,
    datasheet,
    describe_sources,
    load_calibration,
    resolve_hardware,
)
from longstraw_core.plan.cli import main
from longstraw_core.plan.roofline import Hardware

QWEN = ["--preset", "Qwen3.6-27B", "--prompt-tokens", "100000", "--time"]  # no budget


@pytest.mark.parametrize(
    ("device", "name", "tflops"),
    [
        ("NVIDIA H200", "H200", 989.0),
        ("NVIDIA H20", "H20", 148.0),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312.0),
    ],
)
def test_datasheets_match_whole_names(device: str, name: str, tflops: float) -> None:
    sheet = datasheet(device)
    assert sheet is not None and (sheet.name, sheet.tflops) == (name, tflops)


def test_an_unknown_device_has_no_datasheet() -> None:
    assert datasheet("cpu") is None and datasheet("NVIDIA H2000") is None


def test_flags_win_over_the_file_which_wins_over_the_defaults() -> None:
    calibration = Calibration("c.yaml", {"mfu": 0.25, "tflops": 900.0}, {"mfu": "m", "tflops": "t"})
    hw = resolve_hardware({"tflops": 989.0, "mfu": None}, calibration)
    assert (hw.tflops, hw.mfu, hw.hbm_tbps) == (989.0, 0.25, Hardware().hbm_tbps)
    assert dict(hw.sources) == {"tflops": "--tflops", "mfu": "m"}
    line = describe_sources(hw)
    assert "tflops 989 (--tflops)" in line and "mfu 0.25 (m)" in line
    assert "bandwidth efficiency 0.8 assumed, not measured" in line and "MFU 0.4" not in line
    plain = describe_sources(Hardware())
    assert plain.startswith("H20 defaults") and "MFU 0.4 and bandwidth efficiency 0.8" in plain
    assert "tflops 296 (as given)" in describe_sources(Hardware(tflops=296.0))


def test_a_family_measured_gets_its_own_mfu(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.json"
    block = {
        "values": {"mfu": 0.2, "bandwidth_efficiency": 0.7},
        "notes": {"mfu": "lowest", "bandwidth_efficiency": "copy"},
        "mfu_by_model_type": {
            "qwen3": {"value": 0.3, "note": "qwen3 prefill"},
            "qwen3_5_text": {"value": 0.2, "note": "qwen3_5_text prefill"},
        },
    }
    path.write_text(json.dumps({"phases": {}, "calibration": block}))
    calibration = load_calibration(path)
    hw = resolve_hardware({}, calibration, "qwen3")
    assert (hw.mfu, hw.bandwidth_efficiency) == (0.3, 0.7)
    assert dict(hw.sources)["mfu"] == f"{path}: qwen3 prefill"
    other = resolve_hardware({}, calibration, "glm_moe_dsa")
    assert other.mfu == 0.2 and "no glm_moe_dsa figure measured" in dict(other.sources)["mfu"]


def test_the_cli_prints_where_each_value_came_from(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("mfu: 0.25\nname: H200\nhbm_tbps: 4.8\n")
    assert main([*QWEN, "--calibration", str(path), "--tflops", "989"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "time per step (H200, 1 stage(s))" in out
    assert f"name H200 (from {path}); tflops 989 (--tflops)" in out
    assert f"mfu 0.25 (from {path})" in out and "148 TFLOP/s" not in out
    assert "kernels (all at the one MFU): attention in flash-attn" in out


def test_the_calibration_alone_prints_the_estimate(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mine.json"
    path.write_text('{"mfu": 0.5}')
    assert (
        main(["--preset", "Qwen3.6-27B", "--prompt-tokens", "100000", "--calibration", str(path)])
        == 0
    )
    assert "MFU 0.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        (None, ".json", "no such file (make gpu-check writes outputs/gpu_check/gpu_check.json"),
        ("mfuu: 0.3\n", ".yaml", "unknown key(s) ['mfuu']; known: name, tflops"),
        ("mfu: 1.5\n", ".yaml", "mfu=1.5 is a fraction of a peak, in (0, 1]"),
        ("tflops: -3\n", ".yaml", "tflops=-3 must be a positive number"),
        ("[0.3]\n", ".yaml", "a mapping of name, tflops"),
        ("{mfu: [\n", ".yaml", "unreadable"),
        (
            '{"phases": {"benchmark": {"status": "timeout"}}}',
            ".json",
            "its benchmark phase: timeout",
        ),
    ],
)
def test_a_bad_calibration_is_named_before_any_planning(
    tmp_path: Path, capsys, text: str | None, suffix: str, message: str
) -> None:
    path = tmp_path / f"calibration{suffix}"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match="--calibration") as error:
        load_calibration(path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert main([*QWEN, "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --calibration {path}") and message in err
