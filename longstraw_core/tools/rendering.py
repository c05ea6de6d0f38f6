"""The tokens a branch gets after its tool calls, as TRL computes them.

A tool-calling turn ends with the model's EOS. What follows it in the conversation the chat
template would render, the tool messages then the next assistant header, is found TRL's way
(``GRPOTrainer._get_tool_suffix_ids``): render a minimal conversation (a user message, an
assistant turn calling the tool) without and with the tool messages plus the generation
prompt, cut the first at its last EOS (templates such as Qwen's put a newline after
``<|im_end|>``), and take what the second adds. The template must render a conversation's
beginning the same whatever follows (prefix-preserving), or the two do not line up
(ValueError). ``resume_ids`` are the suffix's last tokens, the generation prompt that
reopens the assistant turn (``<|im_start|>assistant\\n``); it also serves as the parse prefix
(``parsing.parse_turn``), since it holds the assistant header the parser looks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ToolSuffix:
    ids: list[int]  # all of it goes into the branch, none of it scored
    resume_ids: list[int]  # its tail: the generation prompt

    @property
    def result_ids(self) -> list[int]:
        """The rendered tool messages alone (``ids`` without ``resume_ids``)."""
        return self.ids[: len(self.ids) - len(self.resume_ids)]


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
) -> list[int]:
    kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}  # TRL renders none
    out = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return list(out)


def _dummy(name: str) -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    return [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def tool_suffix(
    tokenizer: PreTrainedTokenizerBase,
    tool_messages: Sequence[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
) -> ToolSuffix:
    """The tokens after a tool-calling turn's EOS: ``tool_messages`` (the turn's results, in
    order) rendered, and the generation prompt. ``template_kwargs``: the run's
    (``schemas.template_kwargs``)."""
    kwargs = template_kwargs or {}
    dummy = _dummy(tool_messages[0]["name"])
    prefix = _render(tokenizer, dummy, False, kwargs)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    conversation = [*dummy, *tool_messages]
    full = _render(tokenizer, conversation, True, kwargs)
    closed = _render(tokenizer, conversation, False, kwargs)
    if full[: len(prefix)] != prefix or full[: len(closed)] != closed:
        raise ValueError(
            "the chat template is not prefix-preserving: an assistant turn with a tool call "
            "renders differently once a tool result follows it, so the result's tokens cannot "
            "be appended to a branch; use a template that renders earlier messages the same "
            "whatever follows (TRL's training templates do)"
        )
    return ToolSuffix(ids=full[len(prefix) :], resume_ids=full[len(closed) :])


def resume_ids(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The generation prompt's tokens (what ``add_generation_prompt=True`` adds to a
    conversation): the parse prefix of every assistant turn."""
    kwargs = template_kwargs or {}
    messages = [{"role": "user", "content": "dummy"}]
    with_prompt = _render(tokenizer, messages, True, kwargs)
    without = _render(tokenizer, messages, False, kwargs)
    return with_prompt[len(without) :]


def overflows(
    prompt_tokens: int,
    completion_tokens: int,
    suffix_tokens: int,
    max_completion_length: int,
    max_positions: int | None = None,
) -> bool:
    """TRL's test for dropping a turn's tool results: the branch's completion (its tokens so
    far plus the suffix) would pass ``max_completion_length`` (``rollout.max_new_tokens``), or
    prompt, completion and suffix would reach the model's position limit. The branch then
    ends with its completion as it is (the results are not appended, nor shown)."""
    total = completion_tokens + suffix_tokens
    beyond = max_positions is not None and prompt_tokens + total >= max_positions
    return total > max_completion_length or beyond
