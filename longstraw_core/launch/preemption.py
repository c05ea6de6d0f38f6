"""Stopping on a scheduler's signal without losing work.

Schedulers and preemption send SIGTERM (a person at the terminal, SIGINT; a closed terminal or
a dropped ssh session, SIGHUP, which ``torchrun`` passes on too) and kill the job a while later; ``torchrun`` and ``accelerate launch`` pass the signal on to the ranks and kill
them after their own grace period (torchrun's ``--shutdown-timeout``, 30 s by default;
accelerate's single-process launch, 5 s), far shorter than a long-prompt step. So at the first
such signal ``GracefulStop`` has rank 0 write the last finished step's checkpoint at once
(``on_signal``: ``checkpoint.kept.StepCheckpoints.write_kept``, from host memory, no
collective), then lets the step under way finish: when it does in time, the training loop
reads the request between steps, writes that step's checkpoint too, finishes W&B and exits
with ``128 + signal number`` and one line saying how to resume. A second signal exits at
once, or once that write is done (seconds: a launcher may repeat its SIGTERM, which must not
cost the checkpoint; SIGKILL still ends a write that hangs).

The signals are read by a thread (``signal.set_wakeup_fd``), not by a Python signal handler:
a handler runs only when the main thread returns to the interpreter, never while it waits in
a collective that another rank does not join, so a stuck rank would ignore every SIGTERM until
the collective timeout. Under a launcher, a rank also asks Linux for a SIGTERM when the
launcher dies (``PR_SET_PDEATHSIG``): a launcher killed with SIGKILL cannot stop its ranks,
which then write the last finished step and exit instead of outliving it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType

from longstraw_core.distributed import max_over_ranks

# SIGHUP's default action ends the process at once, without a word or a checkpoint: a closed
# terminal must cost no more than a preemption.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Set in the processes torchrun (and accelerate launch through it) or accelerate's
# single-process launch start: the launcher is this process's parent.
LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")
_PR_SET_PDEATHSIG = 1


class GracefulStop:
    """A context that records the first stop signal (and has ``on_signal`` write the last
    finished step's checkpoint) and exits on the next (once that write is done)."""

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
        *,
        on_signal: Callable[[], Path | None] | None = None,
    ) -> None:
        self.signals = signals
        self.on_signal = on_signal
        self.received: signal.Signals | None = None
        self._seen = 0  # signals the watcher took
        self._lock = threading.Lock()  # the watcher takes a signal, the writer ends, atomically
        self._writer: threading.Thread | None = None  # writing the last finished step
        self._writing = False
        self._exit_after_write: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._previous_fd: int | None = None
        self._read: int | None = None
        self._wakeup: int | None = None
        self._launcher: int | None = None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():  # handlers need it
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._read, self._wakeup = os.pipe()
        os.set_blocking(self._wakeup, False)
        self._previous_fd = signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        self._launcher = _follow_launcher()
        watcher = threading.Thread(
            target=self._watch, args=(self._read,), name="LongStraw-StopSignals", daemon=True
        )
        watcher.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        # Whatever ends the block (a collective that fails because another rank stopped at
        # the same signal, in particular), a signal that came is taken and the checkpoint it
        # writes finished first.
        if self._wakeup is not None:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                with self._lock:  # the watcher reads and takes a signal holding it
                    if not self._unread():
                        break
                time.sleep(0.01)
            with self._lock:
                writer = self._writer
            if writer is not None:
                writer.join()
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
            os.close(self._wakeup)  # the watcher reads the end of the pipe and returns
            self._wakeup = self._read = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _unread(self) -> bool:
        """Whether a signal waits in the wakeup pipe for the watcher."""
        return self._read is not None and bool(select.select([self._read], [], [], 0)[0])

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (installed so that the signal does not end the process):
        records it when the main thread gets to it; the watcher thread acts on it."""
        if self.received is None:
            self.received = signal.Signals(signum)

    def _watch(self, fd: int) -> None:
        numbers = {int(sig) for sig in self.signals}
        try:
            while select.select([fd], [], [])[0]:
                with self._lock:
                    data = os.read(fd, 64)
                    if not data:  # the write end closed: the block is over
                        return
                    for number in data:
                        if number in numbers:
                            self._take(signal.Signals(number))
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)

    def _take(self, sig: signal.Signals) -> None:
        """Act on one signal (the watcher, holding the lock)."""
        self._seen += 1
        if self._seen == 1:
            if self.received is None:
                self.received = sig
            gone = self._launcher is not None and os.getppid() != self._launcher
            if not gone:
                _say(
                    f"\n{sig.name}: finishing this step, then a checkpoint and exit (a second "
                    f"{sig.name} exits at once)\n"
                )
            self._writing = True
            self._writer = threading.Thread(
                target=self._write, args=(sig, gone), name="LongStraw-SignalSave", daemon=True
            )
            self._writer.start()
        elif self._writing:  # never abandoned: launchers may repeat their SIGTERM
            if self._exit_after_write is None:
                self._exit_after_write = sig
                _say(f"\nsecond {sig.name}: exiting once the last finished step is written\n")
        else:
            _say(f"\nsecond {sig.name}: exiting now, without a checkpoint of this step\n")
            os._exit(128 + int(sig))

    def _write(self, sig: signal.Signals, launcher_gone: bool) -> None:
        """The writer thread: the last finished step's checkpoint (``on_signal``); then exit
        if the launcher is gone or a second signal asked to."""
        try:
            path = self.on_signal() if self.on_signal is not None else None
        except Exception as error:  # a full disk, ...: the step's own save may still work
            _say(f"{sig.name}: could not write the last finished step: {error}\n")
        else:
            if path is not None:
                _say(f"{sig.name}: saved {path} (the last finished step)\n")
        with self._lock:
            self._writing = False
            second = self._exit_after_write
        if launcher_gone or second is not None:
            why = "the launcher is gone" if launcher_gone else f"second {second.name}"
            _say(f"{why}: exiting now\n")
            os._exit(128 + int(second or sig))

    def requested(self) -> signal.Signals | None:
        """The signal any rank received (a collective when distributed), else None: ranks
        stop after the same step even when the signal reached them at different times."""
        code = max_over_ranks(int(self.received) if self.received else 0)
        return signal.Signals(code) if code else None

    @staticmethod
    def exit_code(sig: signal.Signals) -> int:
        return 128 + int(sig)


def _follow_launcher() -> int | None:
    """Under a launcher on Linux: have the kernel send this process SIGTERM when the
    launcher (its parent) dies; the launcher's pid, or None."""
    if not sys.platform.startswith("linux"):
        return None
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        return None
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return None
    if os.getppid() != launcher:  # it died before the request: as if it had just now
        os.kill(os.getpid(), signal.SIGTERM)
    return launcher


def _say(text: str) -> None:
    """One message on stderr, unbuffered: safe from the watcher thread, whatever the main
    thread is printing. A terminal that hung up (SIGHUP) fails every write with EIO: the
    run's output then goes to /dev/null, so that no later print ends the run or the save."""
    try:
        os.write(2, text.encode())
    except OSError:
        _silence_output()


def _silence_output() -> None:
    """Point stdout and stderr at /dev/null (their terminal is gone)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)


def exit_after_stop(sig: signal.Signals, message: str) -> None:
    """End the process after a graceful stop: ``message`` on stderr, status 128 + signal."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(GracefulStop.exit_code(sig))
