"""How many intra-op threads each process of a run computes with, and why.

torch's default is one thread per core of the machine, in every process: two ranks on two
cores then run four threads, and any other load on the machine makes them wait on each
other (a tiny step on a busy 2-core machine ran 20-40x slower than with one thread, with the
same results). torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes; a plain
``python recipes/...`` sets nothing. So a run chooses:

- ``OMP_NUM_THREADS`` set: torch already took it, and it stays (the override);
- otherwise: the cores this process may run on (its CPU affinity, which ``taskset``, cgroups
  and schedulers narrow), less those other work keeps busy at the start (``/proc/stat``
  sampled for a quarter second: a shared machine's other jobs), shared by the processes of
  this node (``LOCAL_WORLD_SIZE``), at least one each. torch's default counts busy cores
  too, and its threads then wait on each other.

``ThreadChoice.describe`` is the run shape's ``threads`` line (``run_shape``).
"""

from __future__ import annotations

import os
import time
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


def allowed_cores() -> set[int]:
    """The cores this process may run on (its affinity; all of the machine's where unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity call
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores this process may run on."""
    return len(allowed_cores())


def _core_times(cores: set[int]) -> dict[int, tuple[int, int]]:
    """(all, idle) clock ticks so far of each of ``cores``, from ``/proc/stat``."""
    times: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
                continue
            ticks = [int(value) for value in fields[:8]]  # user .. steal (guest is in user)
            times[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])  # idle + iowait
    return times


def busy_cores(cores: set[int], seconds: float = 0.25) -> float | None:
    """How many of ``cores`` other work keeps busy now (this process sleeps meanwhile):
    the cores' non-idle share over ``seconds``; None where ``/proc/stat`` is not there."""
    try:
        before = _core_times(cores)
        time.sleep(seconds)
        after = _core_times(cores)
    except OSError:
        return None
    busy = 0.0
    for core, (total, idle) in after.items():
        total_before, idle_before = before.get(core, (total, idle))
        if total > total_before:
            busy += 1.0 - (idle - idle_before) / (total - total_before)
    return busy


def choose(
    environ: Mapping[str, str], cores: int, local_processes: int, busy: float | None = None
) -> ThreadChoice | None:
    """The run's threads per process: the ``cores`` not ``busy`` with other work, shared by
    the node's processes; None: ``OMP_NUM_THREADS`` is set, so torch's stay."""
    if environ.get(OVERRIDE, "").strip():
        return None
    local_processes = max(local_processes, 1)
    free = cores if busy is None else min(cores, max(round(cores - busy), 0))
    threads = max(free // local_processes, 1)
    cores_text = f"{cores} core{'s' if cores != 1 else ''} available"
    if busy is not None:
        cores_text += f", {busy:.1f} busy with other work"
    processes = f"{local_processes} process{'es' if local_processes != 1 else ''} on this node"
    return ThreadChoice(threads, f"{cores_text} / {processes}; {OVERRIDE} overrides")


def apply(environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """Set torch's intra-op threads as ``choose`` says (``OMP_NUM_THREADS`` unset) and return
    what the process now runs with."""
    environ = os.environ if environ is None else environ
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if environ.get(OVERRIDE, "").strip():  # torch took it; no need to sample the cores
        return ThreadChoice(torch.get_num_threads(), f"{OVERRIDE}={environ[OVERRIDE].strip()}")
    cores = allowed_cores()
    choice = choose(environ, len(cores), local, busy_cores(cores))
    assert choice is not None  # OMP_NUM_THREADS is unset here
    torch.set_num_threads(choice.threads)
    return choice
