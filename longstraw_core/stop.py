"""Stopping on a scheduler's signal without losing work.

Schedulers and preemption send SIGTERM (a person at the terminal, SIGINT) and kill the job a
while later. ``GracefulStop`` turns the first such signal into a request the training loop
reads between steps: it finishes the step, writes a checkpoint, finishes W&B and exits with
``128 + signal number`` and one line saying how to resume. A second signal exits at once
(the checkpoints on disk are complete or set aside, never half-trusted).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

from longstraw_core.distributed import max_over_ranks

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A context that records the first stop signal and exits at once on the second."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # handlers need it
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            os.write(2, f"\nsecond {sig.name}: exiting now, without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = sig
        os.write(2, f"\n{sig.name}: finishing this step, then a checkpoint and exit\n".encode())

    def requested(self) -> signal.Signals | None:
        """The signal any rank received (a collective when distributed), else None: ranks
        stop after the same step even when the signal reached them at different times."""
        code = max_over_ranks(int(self.received) if self.received else 0)
        return signal.Signals(code) if code else None

    @staticmethod
    def exit_code(sig: signal.Signals) -> int:
        return 128 + int(sig)


def exit_after_stop(sig: signal.Signals, message: str) -> None:
    """End the process after a graceful stop: ``message`` on stderr, status 128 + signal."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(GracefulStop.exit_code(sig))
