"""Tool schemas and the chat template that shows them to the model.

A tool's schema is what transformers makes of it (``transformers.utils.get_json_schema``:
its name, type hints and Google-style docstring), the form ``apply_chat_template(...,
tools=[...])`` renders; TRL passes the callables there, which is the same thing.

``template_kwargs`` gives the keyword arguments every ``apply_chat_template`` call of a run
with tools takes (prompt rendering and length fitting, the tool results' suffix): the data's
``chat_template_kwargs`` plus ``tools``, and, for the built-in byte tokenizer, whose ChatML
template has no tool syntax, ``chat_template=TOOL_CHATML_TEMPLATE``: Qwen2.5's tools template
(Hermes ``<tool_call>`` JSON blocks) without its default system prompt, so a conversation
without tools renders exactly as the built-in ``CHATML_TEMPLATE`` does.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from longstraw_core.data.tokenizer import CHATML_TEMPLATE

Schema = dict[str, Any]

TOOL_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    '<|im_end|>\\n" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{{- tool_call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ToolSchemaError(ValueError):
    """A tool whose schema transformers cannot build; the message names it and the fix."""


def tool_schema(fn: Callable[..., Any]) -> Schema:
    """``get_json_schema(fn)``, with an error that names the tool and what to add."""
    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' TypeHintParsingException, DocstringParsingException
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        raise ToolSchemaError(
            f"tool {name} has no schema the chat template can show ({exc}); give every argument "
            "a type hint and the function a Google-style docstring: a summary line, then "
            "'Args:' with one 'name: description' line per argument"
        ) from None


def method_schema(cls: type, name: str) -> Schema:
    """The schema of ``cls``'s method ``name`` as an instance's bound method has it (no
    ``self``), without building an instance (that may be costly: a sandbox, a client)."""
    return tool_schema(types.MethodType(getattr(cls, name), object()))


def renders_tool_calls(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> bool:
    """Whether the template renders a whole tool exchange (user -> assistant with
    ``tool_calls`` -> tool): the call's name, argument and the result all appear, as TRL's
    ``supports_tool_calling`` checks."""
    name, key, value, content = "tool_a8f3", "arg_b9d4", "val_d6e7", "result_c4f9"
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": {key: value}}}
            ],
        },
        {"role": "tool", "name": name, "content": content},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template)
    except Exception:  # jinja's TemplateError and the like: the template refuses the roles
        return False
    return all(s in text for s in (name, key, value, content))


def template_kwargs(
    tokenizer: PreTrainedTokenizerBase,
    schemas: list[Schema],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``apply_chat_template`` keyword arguments of a run with these tools: the data's
    ``chat_template_kwargs``, ``tools`` (none when there are no tools: TRL's ``tools or
    None``) and, for the built-in ChatML template, ``TOOL_CHATML_TEMPLATE``. A template that
    cannot render a tool exchange is refused (ValueError)."""
    out = dict(chat_template_kwargs or {})
    if not schemas:
        return out
    if getattr(tokenizer, "chat_template", None) == CHATML_TEMPLATE:
        out["chat_template"] = TOOL_CHATML_TEMPLATE
    if not renders_tool_calls(tokenizer, out.get("chat_template")):
        raise ValueError(
            f"the chat template of {tokenizer.name_or_path!r} cannot render a tool call and its "
            "result (user -> assistant with tool_calls -> tool); use a tokenizer whose template "
            "supports tools, or pass chat_template in data.chat_template_kwargs"
        )
    out["tools"] = schemas
    return out
