"""``ToolTurns`` runs each branch's turn in its own thread (issue 27: branches that wait on
tools do not hold up the others): ``begin_turns`` returns while a tool still runs, and one
branch's tool can wait on another branch's.

Two real ``ToolBranch`` loops over the built-in tokenizer's tool template: branch 0 calls
``hold``, which blocks until branch 1's ``release`` has run. Run one after another (TRL's
order, or a rollout that waits for each answer before going on), ``hold`` would time out
and count a failure; here both return, with no failure, well inside the timeout.
"""

from __future__ import annotations

import threading
import time

from longstraw_core.data.tokenizer import builtin_tokenizer
from longstraw_core.tools import ToolRunner, ToolSet, template_kwargs, tool_schema
from longstraw_core.tools.branch import ToolBranch
from longstraw_core.tools.turns import ToolTurns

TIMEOUT = 20.0
_released = threading.Event()


def hold() -> str:
    """Wait until another branch releases the gate."""
    if not _released.wait(TIMEOUT * 2):
        return "still shut"
    return "open"


def release() -> str:
    """Open the gate another branch waits at."""
    _released.set()
    return "released"


def _turn(tok, name: str) -> list[int]:
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call><|im_end|>'
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_tool_waiting_on_another_branch_does_not_block_it() -> None:
    _released.clear()
    tok = builtin_tokenizer()
    toolset = ToolSet([hold, release], None, [tool_schema(hold), tool_schema(release)])
    kw = template_kwargs(tok, toolset.schemas)
    runner = ToolRunner(timeout=TIMEOUT)
    branches = [
        ToolBranch(tok, toolset, runner, prompt_tokens=50, max_new_tokens=4096, template_kwargs=kw)
        for _ in range(2)
    ]
    turns = ToolTurns(branches)
    started = time.monotonic()
    turns.begin_turns({0: _turn(tok, "hold")})
    assert turns.ended_turns(wait=False) == {}  # hold runs on, in its thread
    turns.begin_turns({1: _turn(tok, "release")})
    answers: dict[int, list[int]] = {}
    while len(answers) < 2:
        answers.update(turns.ended_turns(wait=True))
    assert time.monotonic() - started < TIMEOUT
    assert [b.messages[-1]["content"] for b in branches] == ["open", "released"]
    assert (turns.calls, turns.failures) == (2, 0)
    assert all(answers[row] == branches[row].completion_ids[-len(answers[row]) :] for row in (0, 1))
    runner.close()


def test_one_tool_thread_runs_the_branches_turns_one_after_another() -> None:
    """``rollout.tool_threads: 1`` (TRL's order, for tools that are not thread-safe): branch
    1's ``release`` waits for branch 0's ``hold`` to finish, so ``hold`` runs into the
    timeout and counts a failure; the rollout still takes each answer when it is ready."""
    _released.clear()
    tok = builtin_tokenizer()
    toolset = ToolSet([hold, release], None, [tool_schema(hold), tool_schema(release)])
    kw = template_kwargs(tok, toolset.schemas)
    runner = ToolRunner(timeout=1.0)
    branches = [
        ToolBranch(tok, toolset, runner, prompt_tokens=50, max_new_tokens=4096, template_kwargs=kw)
        for _ in range(2)
    ]
    turns = ToolTurns(branches, threads=1)
    turns.begin_turns({0: _turn(tok, "hold")})
    turns.begin_turns({1: _turn(tok, "release")})
    answers: dict[int, list[int]] = {}
    while len(answers) < 2:
        answers.update(turns.ended_turns(wait=True))
    assert (turns.calls, turns.failures) == (2, 1)
    assert "longer than its timeout" in branches[0].messages[-1]["content"]
    assert branches[1].messages[-1]["content"] == "released"
    runner.close()
