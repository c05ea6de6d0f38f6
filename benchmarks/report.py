"""Every benchmark in one command: run them, then write one report and the plots it shows.

    python benchmarks/report.py              # full run, about 1-1.5 hours on 2 CPU cores
    python benchmarks/report.py --quick      # smoke run, a few minutes (results/quick/)
    python benchmarks/report.py --skip-run   # rebuild the report from the JSON already there

Runs, each in its own process (each script measures in fresh subprocesses of its own):

1. ``grpo_memory_time.py``: a GRPO step in detached and exact mode, and in exact mode with
   the attention outputs kept (``exact_kept``, ``keep_attention_outputs=True``), beside the
   naive TRL-style step: memory against G and against prompt length, time per phase;
2. ``prefix_memory.py`` for a dense and a hybrid model: prefill + score peak against the
   prefix state, by layer type;
3. ``rollout_speed.py``: batched rollout over one shared state against sequential decoding.

Writes ``report.md`` beside the JSON and PNG files under ``--output``
(``benchmarks/results/``, git-ignored). A full run (not ``--quick``) also copies the report
and the plots to ``docs/benchmarks/``, which docs/benchmarks.md shows: its figures are
always those of the latest full run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_families

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PUBLISHED = HERE.parent / "docs" / "benchmarks"
MIB = 2**20
# Exact-gradient modes in grpo_benchmark.json's summary, with how the report names them.
EXACT_MODES = {"exact": "exact", "exact_kept": "exact (attention outputs kept)"}


def benchmark_commands(args: argparse.Namespace) -> list[list[str]]:
    """The scripts and their flags; ``--quick`` shrinks every sweep."""
    out = ["--output", str(args.output)]
    grpo = ["grpo_memory_time.py", "--quick"] if args.quick else ["grpo_memory_time.py"]
    # grpo_memory_time.py --quick writes under <output>/quick itself.
    commands = [grpo + (["--output", str(args.output.parent)] if args.quick else out)]
    lengths = ["--lengths", "2048", "4096"] if args.quick else []
    for model_type in bench_families.prefix_memory_models():
        commands.append(["prefix_memory.py", "--model-type", model_type, *lengths, *out])
    rollout = ["--prompt-tokens", "2048", "--max-new-tokens", "16", "--repeats", "1"]
    commands.append(["rollout_speed.py", *(rollout if args.quick else []), *out])
    return commands


def run_benchmarks(args: argparse.Namespace) -> None:
    for command in benchmark_commands(args):
        print(f"\n=== {' '.join(command)}", flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]], check=True)
        print(f"=== {command[0]}: {(time.perf_counter() - started) / 60:.1f} min", flush=True)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.1f}"


def _verdicts(verdicts: dict[str, bool]) -> list[str]:
    return [f"- {name}: {'met' if ok else '**not met**'}" for name, ok in verdicts.items()]


def grpo_section(report: dict[str, Any]) -> list[str]:
    """Memory against G and prompt length, step time per phase, ratios and verdicts."""
    settings, summary = report["settings"], report["summary"]
    lines = [
        "## GRPO step: detached, exact, exact with attention outputs kept, naive",
        "",
        f"Tiny Qwen3 ({report['model']['num_hidden_layers']} layers, hidden "
        f"{report['model']['hidden_size']}), float32, CPU, {settings['threads']} torch thread; "
        f"{settings['response_tokens']}-token responses, prefill chunk {settings['chunk_size']}. "
        f"Peak = RSS above each method's fixed cost (fresh process per configuration). "
        f"{report['timing_note']}.",
        "",
        f"Memory and time against G at a {settings['prompt_tokens']}-token prompt:",
        "",
        "| G | method | peak above fixed (MiB) | step (s) | prefill | replay | sweep |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(report["by_group_size"], key=lambda r: (r["group_size"], r["method"])):
        phases = [row.get(f"{phase}_seconds") for phase in ("prefill", "replay", "sweep")]
        cells = " | ".join("" if s is None else f"{s:.1f}" for s in phases)
        lines.append(
            f"| {row['group_size']} | {row['method']} | {_mib(row['peak_above_fixed_bytes'])} "
            f"| {row['seconds']:.1f} | {cells} |"
        )
    lines += ["", f"Longest prompt within {settings['budget_gib']} GiB above the fixed cost:", ""]
    for method, info in summary["longest"].items():
        bound = "" if info["crossed_budget"] else " (never crossed: a lower bound)"
        lines.append(f"- {method}: {info['longest_prompt_tokens']:,} tokens{bound}")
    for mode, mine in summary["by_mode"].items():
        if mine.get("longest_prompt_ratio"):
            lines.append(
                f"- {mode} / naive: {mine['longest_prompt_ratio']:.0f}x "
                f"({mine['longest_prompt_ratio_kind']})"
            )
    lines += ["", "Ratios:", ""]
    for mode, mine in summary["by_mode"].items():
        if "speedup" in mine:
            lines.append(f"- {mode} step vs naive: {mine['speedup']:.1f}x faster")
    for mode, name in EXACT_MODES.items():
        exact = summary["by_mode"].get(mode, {})
        if "time_vs_detached" not in exact:
            continue
        lines.append(f"- {name} / detached step time: {exact['time_vs_detached']:.2f}x")
        if "sweep_vs_prompt_graph" in exact:
            lines.append(
                f"- {name}: sweep / transformers' own forward + backward over the prompt: "
                f"{exact['sweep_vs_prompt_graph']:.2f}x (a detached step plus that work: "
                f"{exact['time_vs_detached_with_prompt_graph']:.2f}x detached)"
            )
        worst = max(exact["peak_vs_detached"].values())
        lines.append(f"- {name} / detached peak (worst configuration): {worst:.2f}x")
    lines += ["", "Targets:", "", *_verdicts(summary["verdicts"]), ""]
    lines += [
        "![memory vs G](grpo_memory_vs_g.png)",
        "![memory vs prompt](grpo_memory_vs_prompt.png)",
    ]
    return [*lines, "![time per phase](grpo_time.png)", ""]


def prefix_section(reports: dict[str, dict[str, Any]]) -> list[str]:
    """State and peak against prompt length, by layer type."""
    lines = ["## Prefill + score: peak against the prefix state", ""]
    for model_type, report in reports.items():
        lines += [
            f"Tiny {model_type} (peak growth / state growth, first to last length: "
            f"{report['peak_growth_over_state_growth']:.2f}):",
            "",
            "| prompt | state (MiB) | by layer type (MiB) | peak above fixed (MiB) | transient |",
            "|---|---|---|---|---|",
        ]
        for row in report["rows"]:
            kinds = ", ".join(
                f"{kind} {size / MIB:.3f}"
                for kind, size in row["state_bytes_by_layer_type"].items()
            )
            lines.append(
                f"| {row['prompt_tokens']:,} | {_mib(row['state_bytes'])} | {kinds} | "
                f"{_mib(row['peak_above_fixed_bytes'])} | {_mib(row['transient_bytes'])} |"
            )
        lines += ["", f"![prefix memory {model_type}](prefix_memory_{model_type}.png)", ""]
    return lines


def rollout_section(report: dict[str, Any]) -> list[str]:
    row = report["row"]
    return [
        "## Rollout: G branches over one shared state",
        "",
        f"Tiny {report['model_type']}, {row['prompt_tokens']:,}-token prompt, "
        f"G={report['num_generations']} x {report['max_new_tokens']} tokens: peak above fixed "
        f"{_mib(report['peak_above_fixed_bytes'])} MiB = {report['memory_ratio']:.3f} x "
        f"(state + branch caches); batched {report['speedup']:.1f}x the sequential tokens/s.",
        "",
        *_verdicts(report["verdicts"]),
        "",
        "![rollout](rollout_speed.png)",
        "",
    ]


def write_report(directory: Path) -> Path:
    """``report.md`` from whichever benchmark JSON files ``directory`` holds."""
    lines = ["# LongStraw benchmarks", "", f"Written {time.strftime('%Y-%m-%d %H:%M')}.", ""]
    grpo = _load(directory / "grpo_benchmark.json")
    if grpo:
        lines += grpo_section(grpo)
    models = bench_families.prefix_memory_models()
    prefix = {m: r for m in models if (r := _load(directory / f"prefix_memory_{m}.json"))}
    if prefix:
        lines += prefix_section(prefix)
    rollout = _load(directory / "rollout_speed.json")
    if rollout:
        lines += rollout_section(rollout)
    if not (grpo or prefix or rollout):
        raise SystemExit(f"no benchmark results under {directory}: run without --skip-run first")
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path


def publish(directory: Path, report: Path) -> None:
    """Copy the report and its plots to docs/benchmarks/ for docs/benchmarks.md."""
    PUBLISHED.mkdir(parents=True, exist_ok=True)
    text = report.read_text()
    plots = [path for path in sorted(directory.glob("*.png")) if f"({path.name})" in text]
    for path in [report, *plots]:
        shutil.copy2(path, PUBLISHED / path.name)
    print(f"published {report.name} and the plots to {PUBLISHED}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sweeps: a smoke run")
    parser.add_argument("--skip-run", action="store_true", help="only rebuild the report")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.output = args.output / "quick"
    if not args.skip_run:
        run_benchmarks(args)
    report = write_report(args.output)
    print(f"wrote {report}")
    if not args.quick:
        publish(args.output, report)


if __name__ == "__main__":
    main()
