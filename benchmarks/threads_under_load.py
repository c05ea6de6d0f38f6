"""A run's default threads on a loaded machine against one thread per process (issue 36).

Starts one busy process per core (another job sharing the machine), then times the same
short run (the embedded tiny demo config, ``train.steps`` steps) with ``OMP_NUM_THREADS``
unset (the run chooses: ``longstraw_core.process.threads``) and with ``OMP_NUM_THREADS=1``, in
alternating pairs so drift in the load falls on both. Reports each wall time and the ratio
default / one thread (the target: at most 1.5x).

    python benchmarks/threads_under_load.py --pairs 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    """Another job's work: a busy loop, until killed."""
    while True:
        sum(range(10_000))


def timed_run(steps: int, threads: str | None) -> float:
    """Wall seconds of one run with ``OMP_NUM_THREADS`` set to ``threads`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, str(ROOT / "recipes/grpo_qwen36.py"), f"train.steps={steps}",
            "train.save_every=0", "tracking.wandb=false", "train.completions_every=0",
            f"train.output_dir={out}/run",
        ]  # fmt: skip
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args(argv)
    load = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for process in load:
        process.start()
    times: dict[str, list[float]] = {"default": [], "one": []}
    try:
        for _ in range(args.pairs):
            times["default"].append(timed_run(args.steps, None))
            times["one"].append(timed_run(args.steps, "1"))
            print(f"default {times['default'][-1]:.1f} s, one thread {times['one'][-1]:.1f} s")
    finally:
        for process in load:
            process.kill()
    ratio = statistics.median(times["default"]) / statistics.median(times["one"])
    record = {"cores": os.cpu_count(), "busy_processes": args.load, "steps": args.steps,
              "seconds": times, "default_over_one_thread": ratio}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads_under_load.json").write_text(json.dumps(record, indent=1))
    print(f"median default / one thread: {ratio:.2f}x ({args.load} busy processes on "
          f"{os.cpu_count()} cores)")  # fmt: skip


if __name__ == "__main__":
    main()
