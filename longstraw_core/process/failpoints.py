"""Named points where a fault-injection test kills the process (failpoints).

A kill can land at any instant of a checkpoint save; polling for a directory and sending
SIGKILL hits a given instant only by luck. Code that must survive such kills marks its
stages with ``failpoint("checkpoint.after_rename", step)``; a test run sets

    LONGSTRAW_FAILPOINTS=checkpoint.after_rename@2

and the process sends itself SIGKILL there, while saving step 2, exactly as a preemption or
the OOM killer would. Without the variable a failpoint is one dictionary lookup.
Several points are separated by commas; ``name`` without ``@step`` fires at every step.
``name@step:enospc`` raises the ``OSError`` a write to a full disk raises instead of killing
(``ENOSPC``), for the tests of what a full disk leaves behind; ``:eacces`` the
``PermissionError`` of a directory no longer writable (a test running as root cannot take the
permission away); ``:oom`` asks torch's allocator for more memory than any machine has, so
the run meets the allocator's own out-of-memory error.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "LONGSTRAW_FAILPOINTS"
FAULTS = ("kill", "enospc", "eacces", "oom")


def failpoint(name: str, step: int | None = None) -> None:
    """SIGKILL this process (or raise the fault named) if ``LONGSTRAW_FAILPOINTS`` names
    ``name`` (at ``step``)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        where, _, fault = item.strip().partition(":")
        point, _, at = where.partition("@")
        if point == name and (not at or step is None or int(at) == step):
            if fault == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"failpoint {name}")
            if fault == "eacces":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), f"failpoint {name}")
            if fault == "oom":
                import torch  # only here: the module is imported where torch is not needed

                torch.empty(2**62, dtype=torch.uint8)  # the allocator's own error
            if fault not in ("", "kill"):
                raise ValueError(f"{ENV}: unknown fault {fault!r} in {item!r}; one of {FAULTS}")
            os.kill(os.getpid(), signal.SIGKILL)
