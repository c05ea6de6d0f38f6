"""The README's commands and the package's import surface, run for real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import DEMO

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("first", ["model_adapters", "longstraw_core"])
def test_either_package_imports_first(first: str) -> None:
    code = f"import {first}; import longstraw_core as ls; print(len(ls.supported_model_types()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 5


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in quickstart.splitlines()[1:]]
    commands = [c for c in commands if c]
    assert commands == ["make demo", "make test"]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in [line.strip() for line in ci_lines]


@pytest.mark.parametrize("model_type", probe_types(DEMO))
def test_demo_runs_and_checks_itself(model_type: str) -> None:
    command = [
        sys.executable,
        "-m",
        "longstraw_core.training.state_demo",
        "--model-type",
        model_type,
    ]
    command += ["--prompt-tokens", "600", "--response-tokens", "16", "--chunk-size", "256"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    assert "Prefix state of a 600-token prompt" in out.stdout
    error = float(re.search(r"max \|Δ log-prob\| =\s*([0-9.e+-]+)", out.stdout).group(1))
    assert error < 1e-4
