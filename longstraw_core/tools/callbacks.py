"""An environment's own callbacks (its class called, ``reset(**row)``) within a timeout,
each failure one ``AgentError`` line naming the callback and the config key.

Tools and rewards fail one call (an ``{"error": ...}`` result, a NaN) and the run goes on;
a group whose environments cannot be built or reset has no prompt to prefill, so its failure
stops the run. Without a limit a ``reset`` that hangs (a sandbox that never comes up) stalls
the run forever, and one SIGTERM cannot end it. The rules are the rewards' and tools': a
call longer than ``rollout.environment_timeout_seconds`` (default
``DEFAULT_ENVIRONMENT_TIMEOUT_SECONDS``) fails; a synchronous call runs in a daemon thread the
caller stops waiting for (a thread cannot be stopped: it runs on, and the run stops anyway);
``null`` is no limit, the call made in the caller's thread (TRL). ``SystemExit`` raised inside
the callback is that callback's failure, as it is a tool's (it must not end one rank alone
with no message).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from longstraw_core.rewards.running import call_in_daemon

DEFAULT_ENVIRONMENT_TIMEOUT_SECONDS = 600.0
TIMEOUT_KEY = "rollout.environment_timeout_seconds"

T = TypeVar("T")


class AgentError(RuntimeError):
    """A tool run that cannot go on (an environment that cannot be reset, or that cannot
    travel between stages): the run stops with its one line."""


def call_environment(call: Callable[[], T], what: str, timeout: float | None) -> T:
    """``call()`` (``what``: the callback as the user wrote it, e.g. ``Sandbox.reset``) within
    ``timeout`` seconds; what it returns, or ``AgentError`` naming what went wrong."""
    if timeout is None:
        outcome = _outcome(call)
    else:
        thread, box = call_in_daemon(lambda: _outcome(call), timeout, f"LongStraw-{what}")
        if thread.is_alive():
            raise AgentError(
                f"rollout.environment: {what} took longer than {TIMEOUT_KEY}={timeout:g} s "
                f"(it runs on in its thread); make it return sooner, or raise {TIMEOUT_KEY} "
                "(null: no limit)"
            )
        (outcome,) = box
    if isinstance(outcome, _Raised):
        error = outcome.error
        detail = f": {error}" if str(error) else ""
        raise AgentError(
            f"rollout.environment: {what} raised {type(error).__name__}{detail}"
        ) from None
    return outcome


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except (Exception, SystemExit) as error:  # the callback's failure, not the run's exit
        return _Raised(error)
