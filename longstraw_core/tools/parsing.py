"""A model's turn, as a message: its text and the tool calls it makes.

``parse_turn`` reads a turn the way TRL's ``parse_response`` does: with the tokenizer's own
response parsing when it has one (transformers' ``tokenizer.parse_response`` and the
tokenizer's ``response_template``; older transformers: ``response_schema``), then TRL's
clean-up (an EOS left in the content removed, content always a string, tool calls without
arguments given ``{}``); a turn it cannot parse (a malformed call) is plain text.

Fallback, for a tokenizer without a response template (the built-in byte tokenizer, most
hand-made templates): Hermes/Qwen2.5-style calls, the syntax ``TOOL_CHATML_TEMPLATE`` asks
for, parsed from the decoded text (special tokens dropped)::

    optional <think>reasoning</think>, text, then one or more
    <tool_call>{"name": "lookup", "arguments": {"key": "teal-otter"}}</tool_call>

Each block is a JSON object with a string ``name``; it becomes the call's ``function`` as it
is, as transformers' parser with TRL's Qwen response template (``qwen3_template``) makes it:
``arguments`` missing or null is ``{}`` (TRL's clean-up); an object's string values are typed
by the tool's schema (``"7"`` -> ``7`` for an integer parameter: transformers' own rule, which
its parser applies from 5.15 on, with the ``tools`` it is given); any other value (a JSON
string of an object, a list) is kept as it is, so the call fails when run (``{"error": ...}``),
as in TRL. The message is ``{"role": "assistant", "content": <the text outside the blocks,
stripped>, "tool_calls": [{"type": "function", "function": {"name": ..., "arguments":
{...}}}, ...]}`` (plus ``reasoning_content`` when the think block holds text). A block that
is not such JSON, or a ``<tool_call>`` never closed, makes the whole turn plain text: no call
runs, as with TRL.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

try:  # transformers' rule for typing a tool call's arguments by the tool's schema
    from transformers.utils.chat_parsing.response_parser import _coerce, _schema_types
except ImportError:
    _coerce = _schema_types = None
# Its parser applies it where ``parse_response`` takes ``tools`` (5.15 on); the fallback too.
_TYPES_ARGUMENTS = (
    _coerce is not None
    and "tools" in inspect.signature(PreTrainedTokenizerBase.parse_response).parameters
)

Message = dict[str, Any]

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def has_response_parser(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer parses its own responses (a ``response_template``, or the
    legacy ``response_schema``)."""
    return any(
        getattr(tokenizer, attr, None) is not None
        for attr in ("response_template", "response_schema")
    )


def parse_turn(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    prefix: Sequence[int] = (),
    tools: list[dict[str, Any]] | None = None,
) -> Message:
    """The assistant message of one turn's token ids (``ids``: the model's tokens, its EOS
    included). ``prefix``: tokens before the turn, enough to hold the last assistant header
    (the generation prompt, ``rendering.resume_ids``): the parser reads what the template
    pre-wrote (an opened ``<think>``). ``tools``: the schemas, which type the arguments of
    templates that write them as text."""
    if not has_response_parser(tokenizer):
        return parse_hermes(tokenizer.decode(list(ids), skip_special_tokens=True), tools)
    try:
        parsed = _own_parse(tokenizer, list(ids), list(prefix), tools)
        if parsed is None:
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            parsed["tool_calls"] = _checked_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {
            "role": "assistant",
            "content": tokenizer.decode(list(ids), skip_special_tokens=True),
        }
    return parsed


def _own_parse(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    prefix: list[int],
    tools: list[dict[str, Any]] | None,
) -> Message | None:
    params = inspect.signature(tokenizer.parse_response).parameters
    if getattr(tokenizer, "response_template", None) is not None and "prefix" in params:
        extra = {"tools": tools} if "tools" in params else {}
        return tokenizer.parse_response(ids, prefix=prefix, **extra)
    return tokenizer.parse_response(ids)


def _checked_calls(calls: Any) -> list[dict[str, Any]]:
    """TRL's ``_validate_tool_calls``: a list of dicts with a string name; missing or null
    arguments become ``{}``. Anything else raises ValueError (the turn is then text)."""
    if calls is None:
        return calls
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call must be a dict")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("a tool call must have a string name")
        if fn.get("arguments") is None:
            fn["arguments"] = {}
    return calls


def parse_hermes(text: str, tools: list[dict[str, Any]] | None = None) -> Message:
    """The fallback parser (module docstring) over decoded text; ``tools``: the schemas that
    type the arguments."""
    message: Message = {"role": "assistant"}
    think = _THINK.match(text)
    body = text[think.end() :] if think else text
    if "<tool_call>" not in body:
        message["content"] = body.strip()
        if think and think.group(1).strip():
            message["reasoning_content"] = think.group(1).strip()
        return message
    calls = []
    for block in _CALL.findall(body):
        call = _hermes_call(block, _parameters(tools))
        if call is None:
            return {"role": "assistant", "content": text}
        calls.append({"type": "function", "function": call})
    rest = _CALL.sub("\n", body)
    if "<tool_call>" in rest:  # one opened and never closed (cut): no call runs
        return {"role": "assistant", "content": text}
    message["content"] = rest.strip()
    if think and think.group(1).strip():
        message["reasoning_content"] = think.group(1).strip()
    message["tool_calls"] = calls
    return message


def _parameters(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> its schema's ``properties``, as transformers' parser reads ``tools``."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            out[fn["name"]] = properties if isinstance(properties, dict) else {}
    return out


def _hermes_call(block: str, parameters: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments")
    if arguments is None:
        call["arguments"] = {}
    elif isinstance(arguments, dict) and _TYPES_ARGUMENTS:
        properties = parameters.get(call["name"]) or {}
        for key, value in arguments.items():  # transformers' _coerce_tool_calls
            if key not in properties or not (types := _schema_types(properties[key])):
                continue
            if isinstance(value, str):
                arguments[key] = _coerce(value, types)
            elif isinstance(value, list) and "array" not in types:
                arguments[key] = [_coerce(v, types) if isinstance(v, str) else v for v in value]
    return call
