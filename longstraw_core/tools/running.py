"""Running a turn's tool calls, as TRL's tool loop does, within a timeout.

``ToolRunner.run(calls, tools)`` runs one assistant turn's ``tool_calls`` against ``tools``
(name -> callable: a branch's standalone functions and its environment's bound methods):

- synchronous tools one after another, in the order called; then the asynchronous ones
  together on one event loop (a daemon thread's, kept for the run, as TRL keeps one), their
  results after the synchronous ones' (TRL's order);
- a tool that raises, an unknown name, arguments the function cannot take, or a call of
  another ``type`` than ``function`` is a failure whose result is ``{"error": "<message>"}``
  (TRL's); so is a call that runs longer than ``timeout`` seconds
  (``rollout.tool_timeout_seconds``, default ``DEFAULT_TIMEOUT_SECONDS``): a synchronous tool
  runs in a daemon thread the runner stops waiting for (a thread cannot be stopped: it runs
  on, and that same tool is not called again while it does), an async one is cancelled.
  ``timeout=None``: no limit, synchronous tools called in the caller's thread (TRL).
- the tool message is ``{"role": "tool", "name": name, "content": str(result)}`` (a list
  result, content blocks, is passed as it is): TRL's.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from longstraw_core.rewards.resolution import is_async_callable
from longstraw_core.rewards.running import EventLoopThread, call_in_daemon

DEFAULT_TIMEOUT_SECONDS = 60.0
# How long past the timeout the caller waits for the event loop itself (a blocked loop).
LOOP_GRACE_SECONDS = 5.0


@dataclass
class ToolResult:
    name: str
    result: Any  # what the tool returned, or {"error": ...}
    failed: bool

    @property
    def message(self) -> dict[str, Any]:
        """The tool message appended to the branch's completion (TRL's)."""
        content = self.result if isinstance(self.result, list) else str(self.result)
        return {"role": "tool", "name": self.name, "content": content}


class _Failure:
    def __init__(self, error: str) -> None:
        self.error = error


class ToolRunner:
    """Runs tool calls (module docstring); one per run (or per rank), ``close`` at the end."""

    def __init__(self, timeout: float | None = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.timeout = timeout
        self._loop: EventLoopThread | None = None
        self._lingering: dict[tuple[int, str], threading.Thread] = {}
        # The rollout runs each branch's turn in its own thread (``ToolTurns``): one lock
        # guards the shared event loop and the lingering calls.
        self._lock = threading.Lock()
        atexit.register(self.close)

    def run(
        self, calls: Sequence[dict[str, Any]], tools: Mapping[str, Callable[..., Any]]
    ) -> list[ToolResult]:
        results: list[ToolResult] = []
        pending: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []
        for call in calls:
            if call.get("type", "function") != "function":
                name = call.get("name", "unknown")
                results.append(_failed(name, f"Unsupported tool call type: {call.get('type')}"))
                continue
            function = call.get("function", call)
            name, arguments = function["name"], function.get("arguments")
            if arguments is None:  # TRL's clean-up; any other non-mapping fails when called
                arguments = {}
            fn = tools.get(name)
            if fn is None:
                results.append(_failed(name, f"Tool {name} not found."))
            elif is_async_callable(fn):
                pending.append((name, fn, arguments))
            else:
                results.append(self._run_sync(name, fn, arguments))
        if pending:
            results += self._run_async(pending)
        return results

    def _run_sync(self, name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> ToolResult:
        if self.timeout is None:
            return _result(name, _outcome(fn, arguments))
        key = (id(getattr(fn, "__self__", None)), name)
        with self._lock:
            lingering = self._lingering.get(key)
        if lingering is not None and lingering.is_alive():
            return _failed(
                name,
                f"its earlier call took longer than the {self.timeout:g} s timeout and is "
                "still running; not called again until it returns",
            )
        thread, box = call_in_daemon(
            lambda: _outcome(fn, arguments), self.timeout, f"LongStraw-Tool-{name}"
        )
        if thread.is_alive():
            with self._lock:
                self._lingering[key] = thread
            return _failed(name, f"Tool {name} took longer than its timeout of {self.timeout:g} s")
        if not box:  # SystemExit in the thread ends only the thread
            return _failed(name, f"Tool {name} exited without a result")
        return _result(name, box[0])

    def _run_async(
        self, pending: list[tuple[str, Callable[..., Any], dict[str, Any]]]
    ) -> list[ToolResult]:
        with self._lock:
            if self._loop is None:
                self._loop = EventLoopThread("LongStraw-ToolLoop")
            loop = self._loop
        timeout = self.timeout

        async def one(name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
            try:
                return await asyncio.wait_for(fn(**arguments), timeout)
            except (TimeoutError, asyncio.TimeoutError):
                return _Failure(f"Tool {name} took longer than its timeout of {timeout:g} s")
            except Exception as exc:
                return _Failure(str(exc))

        async def gather() -> list[Any]:
            return await asyncio.gather(*(one(*p) for p in pending))

        future = asyncio.run_coroutine_threadsafe(gather(), loop.loop)
        limit = None if timeout is None else timeout + LOOP_GRACE_SECONDS
        try:
            outcomes = future.result(limit)
        except concurrent.futures.TimeoutError:  # a tool blocked the loop: leave it behind
            future.cancel()
            with self._lock:
                if self._loop is loop:
                    loop.abandon()
                    self._loop = None
            blocked = _Failure(
                f"the async tools' event loop was blocked past the {timeout:g} s timeout (a "
                "call that never awaits, e.g. time.sleep in an async def)"
            )
            outcomes = [blocked] * len(pending)
        return [_result(name, o) for (name, _, _), o in zip(pending, outcomes, strict=True)]

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()


def _outcome(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    try:
        return fn(**arguments)
    except Exception as exc:
        return _Failure(str(exc))


def _result(name: str, outcome: Any) -> ToolResult:
    if isinstance(outcome, _Failure):
        return _failed(name, outcome.error)
    return ToolResult(name, outcome, failed=False)


def _failed(name: str, error: str) -> ToolResult:
    return ToolResult(name, {"error": error}, failed=True)
