"""How a reward function's call runs: its timeout's default, the errors a call ends in, what
it returned or raised (``call_outcome``, ``async_call_outcome``), a call in a daemon thread
within a timeout (``call_in_daemon``) and the event loop in a daemon thread that runs the async
functions. The tool runner (``tools.running``) runs its tools' calls with the same two."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Callable
from typing import Any

from longstraw_core.rewards.inputs import RewardFn

# The longest a reward function's call may take (seconds) before it counts as failed:
# ``rewards[i].timeout_seconds``' default. Generous for a remote judge scoring a group; a
# hang costs this much per step, not the run.
DEFAULT_TIMEOUT_SECONDS = 600.0


class RewardError(RuntimeError):
    """A reward function failed and ``raise_errors=True``, cannot be called at all, or was
    interrupted (``KeyboardInterrupt``: a person's Ctrl-C reaching its thread)."""


class RewardTimeout(TimeoutError):
    """A reward function's call took longer than its timeout (a failure of that call)."""


class Stop:
    """A reward function raised ``KeyboardInterrupt``: carried back to the calling thread,
    which raises ``RewardError``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def stop_error(name: str, error: BaseException) -> RewardError:
    """The one-line ``RewardError`` for a reward function that raised ``KeyboardInterrupt``."""
    return RewardError(
        f"reward function {name!r} raised {error!r}, which ends the run; a reward function "
        "returns None for a completion it cannot score, or raises an Exception to count as a "
        "failure"
    )


class EventLoopThread:
    """An asyncio loop running in a daemon thread, as TRL keeps one for its async rewards:
    one loop for the run, so clients a reward function keeps (an HTTP session to a judge)
    stay bound to a live loop from step to step."""

    def __init__(self, name: str = "LongStraw-RewardLoop") -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        ready.wait()
        atexit.register(self.close)

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def abandon(self) -> None:
        """When the loop next gets control (it may never): cancel its tasks, then stop it a
        second later (their cancellation runs first). Not waited for at exit."""
        atexit.unregister(self.close)

        def wind_down() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(1.0, self.loop.stop)

        self.loop.call_soon_threadsafe(wind_down)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


def call_in_daemon(
    call: Callable[[], Any], timeout: float, name: str
) -> tuple[threading.Thread, list[Any]]:
    """Run ``call()`` in a daemon thread named ``name`` and wait at most ``timeout`` seconds:
    ``(thread, box)``, ``box`` holding its value once it returned. A thread cannot be
    stopped: one still alive is past its timeout and runs on, abandoned by the caller."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(call()), name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, box


def call_outcome(fn: RewardFn, kwargs: dict[str, Any]) -> Any:
    """The function's values, or the exception it raised (judged by ``RewardSet._column``). A
    ``SystemExit`` is the function's failure, as a tool's is (a judge's client library calling
    ``sys.exit`` on an error must not end the run); a ``KeyboardInterrupt`` is wrapped in
    ``Stop``, to end the run."""
    try:
        return fn(**kwargs)
    except (Exception, SystemExit) as exc:
        return exc
    except BaseException as exc:  # KeyboardInterrupt: stop the run
        return Stop(exc)


async def async_call_outcome(fn: RewardFn, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """``call_outcome`` of an async function, cancelled after ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(_guarded(fn, kwargs), timeout)
    except (TimeoutError, asyncio.TimeoutError):  # the function's own errors are returned
        return RewardTimeout(f"took longer than its timeout of {timeout:g} s")
    except asyncio.CancelledError as exc:
        return RuntimeError(f"cancelled ({exc!r})")


async def _guarded(fn: RewardFn, kwargs: dict[str, Any]) -> Any:
    """Await the function inside the task ``wait_for`` makes, so that what it raises never
    reaches the event loop (a ``SystemExit`` escaping a task stops the loop's thread)."""
    try:
        return await fn(**kwargs)
    except (Exception, SystemExit) as exc:  # SystemExit: a failure (``call_outcome``)
        return exc
    except asyncio.CancelledError:
        raise  # the timeout's cancellation
    except BaseException as exc:  # KeyboardInterrupt: stop the run
        return Stop(exc)
