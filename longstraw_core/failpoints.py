"""Named points where a fault-injection test kills the process (failpoints).

A kill can land at any instant of a checkpoint save; polling for a directory and sending
SIGKILL hits a given instant only by luck. Code that must survive such kills marks its
stages with ``failpoint("checkpoint.after_rename", step)``; a test run sets

    LONGSTRAW_FAILPOINTS=checkpoint.after_rename@2

and the process sends itself SIGKILL there, while saving step 2, exactly as a preemption or
the OOM killer would. Without the variable a failpoint is one dictionary lookup.
Several points are separated by commas; ``name`` without ``@step`` fires at every step.
"""

from __future__ import annotations

import os
import signal

ENV = "LONGSTRAW_FAILPOINTS"


def failpoint(name: str, step: int | None = None) -> None:
    """SIGKILL this process if ``LONGSTRAW_FAILPOINTS`` names ``name`` (at ``step``)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        point, _, at = item.strip().partition("@")
        if point == name and (not at or step is None or int(at) == step):
            os.kill(os.getpid(), signal.SIGKILL)
