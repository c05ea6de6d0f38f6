"""Command line of the dry runs: which configurations and stages, where the JSON goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longstraw_core.scale_check.runs import PAPER, DryRun, run_config, table, worst_stages


def main(argv: list[str] | None = None) -> None:
    names = [run.name for run in PAPER]
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", action="append", choices=names, help="default: every one")
    parser.add_argument(
        "--stages", default="worst",
        help="'worst' (default: the first stage of each kind, its largest peak), 'all', or "
        "comma-separated stage numbers",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/scale_check.json"))
    args = parser.parse_args(argv)
    results = []
    for run in PAPER:
        if args.run and run.name not in args.run:
            continue
        stages = _stages(args.stages, run)
        result = run_config(run, stages, say=lambda line: print(line, flush=True))
        print(table(result), flush=True)
        results.append(result)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")  # after each run


def _stages(text: str, run: DryRun) -> list[int] | None:
    """``--stages``: None for every stage, the kinds' worst, or the listed ones."""
    if text == "all":
        return None
    if text == "worst":
        return worst_stages(run)
    return [int(stage) for stage in text.split(",")]
