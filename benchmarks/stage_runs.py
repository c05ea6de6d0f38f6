"""What the pipeline benchmarks (``pipeline_speed.py``, ``pipeline_busy.py``) share: their
common flags, one torchrun of S CPU ranks per stage count whose rank 0 writes its figures, a
rank's model placed on the stages, timing between barriers, and the summary file.

A benchmark is a script that runs itself: ``main`` runs ``runs(...)``, which starts
``script --worker --result FILE`` under torchrun for each S; ``on_stages`` builds the
worker's model and places it, ``timed`` measures, ``finish`` writes rank 0's figures and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Forwarded to every worker, from the flags of the same names.
FORWARDED = ("prompt_tokens", "chunk_size", "group", "new_tokens", "repeats")


def parser(
    doc: str, *, prompt_tokens: int, group: int, new_tokens: int, repeats: int, stages: list[int]
) -> argparse.ArgumentParser:
    """The flags every pipeline benchmark takes, with its own defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--group", type=int, default=group, help="G: branches per group")
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--stages", type=int, nargs="+", default=stages)
    parser.add_argument("--output", type=Path, default=HERE / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def runs(
    script: str, name: str, args: argparse.Namespace, extra: Sequence[str] = ()
) -> Iterator[tuple[int, dict[str, Any]]]:
    """For each S of ``args.stages``: run ``script``'s worker on S ranks (one torch thread
    each) and yield ``(S, rank 0's figures)``. ``extra``: more flags for the worker."""
    args.output.mkdir(parents=True, exist_ok=True)
    flags = [f for key in FORWARDED for f in (f"--{key.replace('_', '-')}", str(vars(args)[key]))]
    for stages in args.stages:
        result = args.output / f"{name}_S{stages}.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(stages), script, "--worker", "--result", str(result), *flags, *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        yield stages, json.loads(result.read_text())


def add_speedups(runs: list[dict[str, Any]], phases: Sequence[str]) -> None:
    """Each run's ``PHASE_speedup``: S=1's ``PHASE_seconds`` over its own."""
    base = next(run for run in runs if run["stages"] == 1)
    for run in runs:
        for phase in phases:
            run[f"{phase}_speedup"] = base[f"{phase}_seconds"] / run[f"{phase}_seconds"]


def write_summary(
    name: str, args: argparse.Namespace, model: dict[str, Any], runs: list[dict]
) -> None:
    """``NAME.json`` under ``--output``: the settings, the model and every S's figures."""
    settings = {**vars(args), "output": str(args.output), "model": model, "cores": os.cpu_count()}
    summary = {"settings": settings, "runs": runs}
    (args.output / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))


def on_stages(build: Callable[[], Any]) -> tuple[Any, Any, int, int]:
    """The worker's rank (one torch thread) joins the gloo group, builds its model and adapts
    it, placed on the stages when there are several: ``(model, adapter, world, rank)``."""
    import torch
    import torch.distributed as dist

    import longstraw_core as ls
    from longstraw_core.config import DistributedSection
    from longstraw_core.parallel.topology import RunTopology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build()
    adapter = ls.adapt(model)
    if world > 1:
        section = DistributedSection(pipeline_stages=world)
        RunTopology.from_config(section, world, rank).place(adapter)
    return model, adapter, world, rank


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` on every rank, between barriers."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def finish(args: argparse.Namespace, rank: int, result: dict[str, Any]) -> None:
    """Rank 0 writes ``result`` to ``--result``; every rank leaves the group and exits."""
    import torch.distributed as dist

    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's teardown (tests/support/distributed_worker.py says why)
