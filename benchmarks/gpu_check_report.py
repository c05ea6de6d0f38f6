"""``make gpu-check``'s record: one JSON entry per phase whatever happens, written as it goes.

Why: a GPU lease is short, and a check can fail, crash, hang or be killed by its outer time
limit. Every step (one subprocess: the tests, a recipe run, a benchmark) runs in its own
process session under its own time limit, its output in a log file; the JSON is rewritten
(atomically) when a step starts and when it ends, so a kill at any moment loses nothing
measured, and a step that failed, crashed or timed out keeps its entry: status, seconds,
return code, error and the end of its log. SIGTERM (the outer ``timeout``) and SIGINT end
the running step's process group, mark it and its phase ``killed`` and the phases not yet
run ``skipped``, and write the record before the process exits.

Statuses: ``pending`` -> ``running`` -> ``passed``, ``failed`` (ran, wrong result),
``timeout`` (its limit ended it), ``crashed`` (died by a signal, or the check itself raised),
``killed`` (the whole check was stopped) or ``skipped`` (with the reason).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Worst first: a phase takes the worst status of its steps.
SEVERITY = ("killed", "crashed", "timeout", "failed", "running", "pending", "passed", "skipped")
TAIL_CHARS = 3000
# After SIGTERM, how long a step's processes get to stop before SIGKILL (a recipe saves a
# checkpoint on SIGTERM; torchrun forwards it to its ranks).
GRACE_S = 5


class Killed(BaseException):
    """SIGTERM or SIGINT reached the check: stop, record, exit."""


@dataclass
class Step:
    """One subprocess of a phase, as the JSON records it."""

    name: str
    status: str = "pending"
    seconds: float = 0.0
    limit_s: float | None = None
    returncode: int | None = None
    error: str | None = None
    log: str | None = None
    tail: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Phase:
    """One phase: its steps and their combined status."""

    name: str
    status: str = "pending"
    seconds: float = 0.0
    limit_s: float = 0.0
    error: str | None = None
    steps: dict[str, Step] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped")

    def settle(self) -> None:
        """The phase's status from its steps' (the worst), and their errors."""
        if self.status in ("skipped", "killed", "crashed"):
            return
        statuses = [step.status for step in self.steps.values()] or ["passed"]
        self.status = min(statuses, key=SEVERITY.index)
        errors = [f"{s.name}: {s.error}" for s in self.steps.values() if s.error]
        self.error = "; ".join(errors) or self.error


class Report:
    """The check's JSON at ``path``, rewritten after every change that matters."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header = path, header
        self.phases: dict[str, Phase] = {}
        self.started = time.monotonic()
        self.finished = False

    def plan(self, phases: dict[str, float]) -> None:
        """Every phase to run, pending, with its limit: the entries exist from the start."""
        self.phases = {name: Phase(name, limit_s=limit) for name, limit in phases.items()}
        self.write()

    @property
    def ok(self) -> bool:
        return all(phase.ok for phase in self.phases.values())

    def as_dict(self) -> dict[str, Any]:
        status = "passed" if self.ok else "failed"
        if not self.finished:
            status = "running"
        elif any(p.status == "killed" for p in self.phases.values()):
            status = "killed"
        phases = {name: {**asdict(p), "ok": p.ok} for name, p in self.phases.items()}
        return {
            "ok": self.ok and self.finished,
            "status": status,
            "seconds": round(time.monotonic() - self.started, 1),
            **self.header,
            "phases": phases,
        }

    def write(self) -> None:
        """Replace the JSON in one step (a reader never sees half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.as_dict(), indent=2, default=str))
        os.replace(temporary, self.path)

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Run a phase's body: ``running`` while it does, then settled and written; an
        exception in the body is recorded (``crashed``) and the check goes on."""
        phase = self.phases[name]
        phase.status = "running"
        start = time.monotonic()
        try:  # from the first write on, as run_step's steps
            self.write()
            yield phase
            phase.settle()
        except Killed:
            phase.status, phase.error = "killed", "the check was stopped (SIGTERM/SIGINT)"
            raise
        except Exception as error:
            phase.status = "crashed"
            phase.error = f"{type(error).__name__}: {error}"
            phase.details["traceback"] = traceback.format_exc()[-TAIL_CHARS:]
        finally:
            phase.seconds = round(time.monotonic() - start, 1)
            self.write()

    def skip(self, name: str, reason: str) -> None:
        self.phases[name].status, self.phases[name].error = "skipped", reason
        self.write()

    def finish(self) -> None:
        """The end, normal or not: phases never started are marked skipped."""
        for phase in self.phases.values():
            if phase.status == "pending":
                phase.status, phase.error = "skipped", "not run: the check was stopped"
            for step in phase.steps.values():  # cut short before its own record was made
                if step.status == "running":
                    step.status = "killed" if phase.status == "killed" else "crashed"
                    step.error = step.error or phase.error
        self.finished = True
        self.write()


def run_step(
    report: Report,
    phase: Phase,
    name: str,
    command: Sequence[str],
    *,
    limit: float,
    log: Path,
    cwd: Path,
    env: dict[str, str] | None = None,
    check: Callable[[Step], str | None] | None = None,
) -> Step:
    """Run ``command`` as ``phase``'s step ``name`` under ``limit`` seconds, its output in
    ``log``; ``check`` (once it exited) records what it left in the step's details and
    returns an error or None. Recorded whatever happens."""
    step = Step(name, status="running", limit_s=limit, log=str(log))
    phase.steps[name] = step
    start = time.monotonic()
    try:  # from the first write on: a signal that lands mid-write still marks the step
        report.write()
        step.returncode, timed_out = run_limited(command, limit=limit, log=log, cwd=cwd, env=env)
        step.tail = read_tail(log)
        if timed_out:
            step.status, step.error = "timeout", f"killed at its limit of {limit:g} s"
        elif step.returncode < 0:
            signal_name = signal.Signals(-step.returncode).name
            step.status, step.error = "crashed", f"died by {signal_name}"
        else:  # it exited: the check reads what it left (details) whatever the status
            problems = [f"exit status {step.returncode}"] if step.returncode else []
            found = check(step) if check else None
            problems += [found] if found else []
            step.status = "failed" if problems else "passed"
            step.error = "; ".join(problems) or None
    except Killed:
        step.status, step.error = "killed", "the check was stopped (SIGTERM/SIGINT)"
        step.tail = read_tail(log)
        raise
    finally:
        step.seconds = round(time.monotonic() - start, 1)
        report.write()
        _print_step(phase.name, step)
    return step


def _print_step(phase: str, step: Step) -> None:
    """One line per step; a failure's log tail under it (what a remote run's output shows)."""
    error = f": {step.error}" if step.error else ""
    print(f"gpu-check {phase}/{step.name}: {step.status} ({step.seconds:.0f} s){error}", flush=True)
    if step.status not in ("passed", "skipped"):
        lines = step.tail.rstrip().splitlines()[-15:]
        print("\n".join(f"    {line}" for line in lines), flush=True)


def run_limited(
    command: Sequence[str],
    *,
    limit: float,
    log: Path,
    cwd: Path,
    env: dict[str, str] | None = None,
) -> tuple[int, bool]:
    """``(returncode, timed_out)`` of ``command`` with stdout and stderr in ``log``.

    Its own process session, so that at the limit (or when this process is stopped) the
    whole group ends, torchrun's ranks included: SIGTERM, then SIGKILL after ``GRACE_S``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        process = subprocess.Popen(
            list(command), cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            return process.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            _end_group(process)
            return process.returncode, True
        finally:
            if process.poll() is None:  # stopped from outside (Killed), or an error here
                _end_group(process)
            else:  # anything it left running in its session
                _signal_group(process, signal.SIGKILL)


def _end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL ``GRACE_S`` later: to whatever of the
    group lingers even when its leader is gone (torchrun's ranks)."""
    _signal_group(process, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=GRACE_S)
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def read_tail(path: Path, chars: int = TAIL_CHARS) -> str:
    """The end of a log (what a failure's cause is usually in)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - chars))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise ``Killed`` in the main thread (so the record is written)."""

    def stop(signum: int, frame: Any) -> None:
        raise Killed(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
