"""Command line of the dry runs: which configurations and stages, where the JSON goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longstraw_core.scale_check.runs import PAPER, run_config, table


def main(argv: list[str] | None = None) -> None:
    names = [run.name for run in PAPER]
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", action="append", choices=names, help="default: every one")
    parser.add_argument(
        "--stages", type=lambda text: [int(s) for s in text.split(",")], default=None,
        help="comma-separated stages to report (the stages before them run too); default all",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/scale_check.json"))
    args = parser.parse_args(argv)
    results = []
    for run in PAPER:
        if args.run and run.name not in args.run:
            continue
        result = run_config(run, args.stages, say=lambda line: print(line, flush=True))
        print(table(result), flush=True)
        results.append(result)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")  # after each run
