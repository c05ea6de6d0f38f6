"""One branch's tool loop: TRL's ``_tool_call_loop`` for a single completion, without the
model. The rollout loop decodes, and at each end of a model turn hands the turn's tokens to
``ToolBranch.end_turn``, which answers with the tokens to append (prefill, no grad, not
scored) before decoding resumes, or ``[]``: the branch is finished.

    branch = ToolBranch(tokenizer, toolset, runner, template_kwargs=kw,
                        prompt_tokens=len(prompt_ids), max_new_tokens=cfg.rollout.max_new_tokens,
                        max_positions=model_max_positions, environment=env)
    turn = decode(budget=branch.budget)           # up to and including EOS, or cut
    while (suffix := branch.end_turn(turn)):
        prefill(suffix); turn = decode(budget=branch.budget)
    branch.completion_ids, branch.loss_mask, branch.messages   # TRL's completion_ids, tool_mask, completions
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.tools.parsing import parse_turn
from longstraw_core.tools.rendering import overflows, resume_ids, tool_suffix
from longstraw_core.tools.running import ToolRunner
from longstraw_core.tools.tool_set import ToolSet

# Branches end their turns in worker threads (``ToolTurns``) and share one tokenizer; a fast
# tokenizer is not safe to call from several threads at once ("Already borrowed"), so its
# calls (parsing a turn, rendering the results) take turns; the tools themselves do not.
_TOKENIZER_LOCK = threading.Lock()


class ToolBranch:
    """The state of one branch: ``completion_ids`` (the model's turns and the tool results'
    tokens), ``loss_mask`` (1 for the model's tokens, 0 for the tools': TRL's ``tool_mask``),
    ``messages`` (the completion as TRL passes it to reward functions: assistant turns and
    tool messages), ``calls``/``failures`` (for ``tool_metrics``), ``iterations`` (tool
    rounds run) and ``done``.

    ``end_turn(turn_ids)`` follows TRL: the turn is parsed (``parse_turn``); without tool
    calls, or after ``max_tool_calling_iterations`` rounds, the branch ends. Otherwise the
    calls run (``ToolRunner``), and their results' tokens (``tool_suffix``) are returned,
    unless they would overflow (``overflows``): then the branch ends as it is, the results
    dropped (still counted as calls). An empty turn (no budget left) ends the branch too.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        toolset: ToolSet,
        runner: ToolRunner,
        *,
        prompt_tokens: int,
        max_new_tokens: int,
        template_kwargs: Mapping[str, Any] | None = None,
        max_positions: int | None = None,
        environment: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.toolset = toolset
        self.runner = runner
        self.tools = toolset.branch_tools(environment)
        self.environment = environment
        self.template_kwargs = dict(template_kwargs or {})
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.max_positions = max_positions
        self.parse_prefix = resume_ids(tokenizer, self.template_kwargs)
        self.completion_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.messages: list[dict[str, Any]] = []
        self.calls = self.failures = self.iterations = 0
        self.done = False

    @property
    def budget(self) -> int:
        """Tokens the model may still generate in this branch."""
        return max(0, self.max_new_tokens - len(self.completion_ids))

    def end_turn(self, turn_ids: Sequence[int]) -> list[int]:
        if self.done:
            raise RuntimeError("end_turn on a finished branch")
        turn = list(turn_ids)
        self.completion_ids += turn
        self.loss_mask += [1] * len(turn)
        if not turn:
            return self._finish()
        with _TOKENIZER_LOCK:
            message = parse_turn(self.tokenizer, turn, self.parse_prefix, self.toolset.schemas)
        self.messages.append(message)
        calls = message.get("tool_calls")
        if not calls or self.iterations >= self.toolset.max_iterations:
            return self._finish()
        results = self.runner.run(calls, self.tools)
        self.calls += len(calls)
        self.failures += sum(r.failed for r in results)
        tool_messages = [r.message for r in results]
        with _TOKENIZER_LOCK:
            suffix = tool_suffix(self.tokenizer, tool_messages, self.template_kwargs).ids
        if overflows(
            self.prompt_tokens, len(self.completion_ids), len(suffix), self.max_new_tokens,
            self.max_positions,
        ):  # fmt: skip
            return self._finish()
        self.messages += tool_messages
        self.completion_ids += suffix
        self.loss_mask += [0] * len(suffix)
        self.iterations += 1
        return suffix

    def _finish(self) -> list[int]:
        self.done = True
        return []
