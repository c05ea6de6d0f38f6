"""How a test's rank script ends: every rank leaves the process group together, then exits
without the interpreter's teardown.

Gloo's worker threads may still be dropping finished work (which holds tensors, so needs
the GIL) while Python finalizes, and that aborts the process now and then (torch 2.13).
Call it once everything is written.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave_process_group_and_exit() -> None:
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
