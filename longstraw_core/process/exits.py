"""Ending a run on an error a person must fix: one line, printed once, and recorded where the
launcher reports it.

Under ``torchrun`` or ``accelerate launch`` every rank reads the same config and data, so
every rank meets the same error; printed by each, the line repeats once per process among
the launcher's own report. ``fail`` prints it on rank 0 only and writes it, on every rank,
into the error file torchelastic gives each process (``TORCHELASTIC_ERROR_FILE``), through
torch's own ``ErrorHandler``: the launcher's failure summary then quotes that line as each
rank's error (its "Root Cause") instead of a link to its documentation. The launcher still prints its own summary: that is
its output, not the run's.

A caller in Python (``longstraw_core.training.trainer.train``) wants an exception, not an exit with
the line on stderr: inside ``raising()``, ``fail`` raises ``RunError`` with the same line
(still recorded for the launcher) and prints nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

_RAISING: ContextVar[bool] = ContextVar("longstraw_exits_raising", default=False)


class RunError(RuntimeError):
    """A run ended on an error a person must fix: the message is the one line the command
    line prints (``config error: train.stepz: unknown key ...``), ``code`` the exit status
    it ends with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def raising() -> Iterator[None]:
    """Within it, ``fail`` raises ``RunError`` instead of printing and exiting."""
    token = _RAISING.set(True)
    try:
        yield
    finally:
        _RAISING.reset(token)


def launch_rank() -> int:
    """This process's rank: the process group's, or the launcher's ``RANK`` before there is
    one (config errors come before the group is made); 0 for a plain ``python`` run."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def fail(message: str, code: int = 1, *, local: bool = False) -> NoReturn:
    """Print ``message`` on rank 0, record it for the launcher, exit with ``code``.

    ``local``: the error is this rank's alone (the others did not meet it), so this rank
    prints it whatever its rank. Inside ``raising()``: ``RunError(message, code)`` instead.
    """
    if _RAISING.get():
        record_for_launcher(message)
        raise RunError(message, code) from None  # the line says it all; __context__ keeps more
    if local or launch_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    record_for_launcher(message)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        os._exit(code)  # skip gloo's teardown, which can abort (distributed.exit_ranks)
    sys.exit(code)


def record_for_launcher(message: str) -> None:
    """Write ``message`` as this rank's error in torchelastic's error file (if launched so)."""
    _LineErrorHandler().record_exception(RunError(message))


class _LineErrorHandler(ErrorHandler):
    """torchelastic's error handler (its error file, from ``TORCHELASTIC_ERROR_FILE``; its
    layout), recording a ``RunError`` with its one line where torch puts the Python traceback:
    the launcher's summary shows ``py_callstack``, and a traceback would bury the line."""

    def record_exception(self, e: BaseException) -> None:
        if not isinstance(e, RunError):
            super().record_exception(e)
            return
        path = self._get_error_file_path()
        if not path:
            return  # not launched by torchelastic
        info = {"py_callstack": str(e), "timestamp": str(int(time.time()))}
        with warnings.catch_warnings():  # the line was printed; the launcher falls back to
            warnings.simplefilter("ignore")  # its own wording if the file cannot be written
            self._write_error_file(
                path, json.dumps({"message": {"message": str(e), "extraInfo": info}})
            )
