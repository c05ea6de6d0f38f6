"""How many intra-op threads each process of a run computes with, and why.

torch's default is one thread per core of the machine, in every process: two ranks on two
cores then run four threads, and any other load on the machine makes them wait on each
other (a tiny step on a busy 2-core machine ran 20-40x slower than with one thread, with the
same results). torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes; a plain
``python recipes/...`` sets nothing. So a run chooses:

- ``OMP_NUM_THREADS`` set: torch already took it, and it stays (the override);
- otherwise: the cores this process may run on (its CPU affinity, which ``taskset``, cgroups
  and schedulers narrow) shared by the processes of this node (``LOCAL_WORLD_SIZE``), at
  least one each.

``ThreadChoice.describe`` is the run shape's ``threads`` line (``run_shape``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

OVERRIDE = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """Threads per process, and where the number came from."""

    threads: int
    source: str  # "OMP_NUM_THREADS=4", or the cores and processes it was divided from

    def describe(self) -> str:
        return f"{self.threads} per process ({self.source})"


def available_cores() -> int:
    """Cores this process may run on (its affinity; all of the machine's where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity call
        return os.cpu_count() or 1


def choose(environ: Mapping[str, str], cores: int, local_processes: int) -> ThreadChoice | None:
    """The run's threads per process; None: ``OMP_NUM_THREADS`` is set, so torch's stay."""
    if environ.get(OVERRIDE, "").strip():
        return None
    local_processes = max(local_processes, 1)
    threads = max(cores // local_processes, 1)
    cores_text = f"{cores} core{'s' if cores != 1 else ''} available"
    processes = f"{local_processes} process{'es' if local_processes != 1 else ''} on this node"
    return ThreadChoice(threads, f"{cores_text} / {processes}; {OVERRIDE} overrides")


def apply(environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """Set torch's intra-op threads as ``choose`` says (``OMP_NUM_THREADS`` unset) and return
    what the process now runs with."""
    environ = os.environ if environ is None else environ
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    choice = choose(environ, available_cores(), local)
    if choice is None:
        return ThreadChoice(torch.get_num_threads(), f"{OVERRIDE}={environ[OVERRIDE].strip()}")
    torch.set_num_threads(choice.threads)
    return choice
