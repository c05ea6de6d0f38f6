"""Launching scripts on several CPU ranks (torchrun, gloo) from the tests.

Every rank runs under ``nccl_rules_run.py``, which enforces NCCL's point-to-point rules on
gloo (``nccl_rules``), so a test hangs, and fails with a report, where NCCL would hang.
``LONGSTRAW_NCCL_RULES=0`` runs the scripts directly (debugging).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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

    The launch gets its own process session, so that a hang (ranks out of step in a
    collective) kills the ranks too, not only torchrun. ``env``: the ranks' environment
    (default: this process's).
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
        os.killpg(process.pid, signal.SIGKILL)
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
