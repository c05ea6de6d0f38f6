"""Launching scripts on several CPU ranks (torchrun, gloo) from the tests.

Every rank runs under ``nccl_rules_run.py``, which enforces NCCL's point-to-point rules on
gloo (``nccl_rules``), so a test hangs, and fails with a report, where NCCL would hang.
``LONGSTRAW_NCCL_RULES=0`` runs the scripts directly (debugging).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The tests' helpers and the scripts their ranks run (``tests/support``).
SUPPORT = Path(__file__).resolve().parent
NCCL_RULES_RUN = SUPPORT / "nccl_rules_run.py"
# The ranks' torch threads: 1 (tiny models; steady timings on a busy machine) unless a test
# sets this in the environment it launches with (a thread count changes where sums split).
RANK_THREADS = "LONGSTRAW_TEST_RANK_THREADS"


def under_nccl_rules(script: Path | str, env: dict[str, str] | None = None) -> list[str]:
    """The arguments that run ``script`` under the NCCL-rules harness (``[runner, script]``),
    or as itself when ``env`` (default: this process's) has ``LONGSTRAW_NCCL_RULES=0``."""
    environ = env or os.environ
    if environ.get("LONGSTRAW_NCCL_RULES", "1") == "0":
        return [str(script)]
    return [str(NCCL_RULES_RUN), str(script)]


def torchrun_command(
    script: Path | str, *args: str, ranks: int = 2, env: dict[str, str] | None = None
) -> list[str]:
    """The torchrun command line for ``script args`` on ``ranks`` CPU ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(ranks), *under_nccl_rules(script, env), *args,
    ]  # fmt: skip


def torchrun(
    script: Path | str,
    *args: str,
    ranks: int = 2,
    timeout: int = 300,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """``script args`` on ``ranks`` CPU ranks; ``(returncode, log)``.

    A hang (ranks out of step in a collective) kills torchrun and its ranks (``kill_tree``).
    ``env``: the ranks' environment (default: this process's).
    """
    command = torchrun_command(script, *args, ranks=ranks, env=env)
    environ = env or os.environ
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**environ, "OMP_NUM_THREADS": environ.get(RANK_THREADS, "1")}, start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)  # torchrun's ranks too: each runs in a session of its own
        log, _ = process.communicate()
        raise AssertionError(f"torchrun timed out (ranks out of step?):\n{log[-5000:]}") from None
    return process.returncode, with_report_last(log)


def with_report_last(log: str) -> str:
    """``log`` with the NCCL-rules harness's hang report, if any, repeated at its end: the
    ranks' tracebacks and torchrun's summary come after it, and tests show a log's tail."""
    report = re.search(r"^=+ NCCL rules: .*?end of the NCCL rules report =+$", log, re.S | re.M)
    if report is None:
        return log
    return f"{log}\n[the NCCL rules report, repeated from above]\n{report.group(0)}\n"


def torchrun_ok(
    script: Path | str, *args: str, ranks: int = 2, env: dict[str, str] | None = None
) -> str:
    """``torchrun`` that must succeed; its log."""
    returncode, log = torchrun(script, *args, ranks=ranks, env=env)
    assert returncode == 0, f"torchrun failed ({returncode}):\n{log[-5000:]}"
    return log


# --------------------------------------------------------------------------- several nodes


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a rendezvous of this test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_node_command(
    script: Path | str, *args: str, node: int, nodes: int, ranks_per_node: int, port: int,
    env: dict[str, str] | None = None,
) -> list[str]:  # fmt: skip
    """Node ``node``'s torchrun of a ``nodes``-node run, rendezvous (c10d) at
    127.0.0.1:``port``; node 0 hosts the rendezvous store (``is_host``), as a cluster's head."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank",
        str(node), "--nproc_per_node", str(ranks_per_node), "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_conf", f"is_host={int(node == 0)}",
        *under_nccl_rules(script, env), *args,
    ]  # fmt: skip


def launch_nodes(
    commands: list[list[str]],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    grace: float = 30,
) -> list[tuple[int, str]]:
    """Run one launcher per "node" at once (``commands``, e.g. ``torchrun_node_command``
    for each node rank); each launcher's ``(returncode, log)``.

    Once one launcher fails, the others get ``grace`` seconds to fail too (their ranks lose
    their peers), then they are killed; at ``timeout`` every launcher is. Killing takes a
    launcher's whole process tree: torchrun starts each rank in a session of its own, so the
    launcher's process group does not hold its ranks.
    """
    environ = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
    # Logs in files, not pipes: nobody reads a pipe while the launchers run, and a full one
    # would stop its writer.
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # noqa: SIM115 (closed below)
    processes, killed = [], []
    try:
        for command, log in zip(commands, logs, strict=True):
            processes.append(subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environ,
                start_new_session=True,
            ))  # fmt: skip
        _wait_for_nodes(processes, timeout, grace)
    finally:
        killed = [kill_tree(process) for process in processes]
    results = []
    for process, log, was_killed in zip(processes, logs, killed, strict=True):
        log.seek(0)
        note = "\n[launch_nodes: killed, still running at the time limit or after another failed]"
        results.append((process.returncode, with_report_last(log.read() + note * was_killed)))
        log.close()
    return results


def _wait_for_nodes(processes: list[subprocess.Popen], timeout: float, grace: float) -> None:
    """Until every launcher exits, ``grace`` seconds after the first failure, or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in processes]  # every one (``any`` would stop at the first)
        if None not in codes:
            return
        now = time.monotonic()
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, now + grace)
        if now >= deadline:
            return
        time.sleep(0.2)


def kill_tree(process: subprocess.Popen) -> bool:
    """SIGKILL ``process`` and every process it started (found through /proc before any dies,
    as orphans leave the tree), then reap it; whether it was still running."""
    if process.poll() is not None:
        return False
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces and parentheses
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # exited while listed
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, queue = [], [process.pid]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue += children.get(pid, [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10  # SIGKILL is asynchronous: until the orphans are gone
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead and not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
