"""Tools for agent rollouts (issue 27): schemas as transformers builds them, tool calls parsed
as the tokenizer (or the Hermes fallback) reads them, tools run as TRL runs them (errors and
timeouts become ``{"error": ...}`` failures), the tokens a branch gets equal the chat
template's rendering of the whole conversation, and bad tools refused at config load.

Two real tokenizers: the built-in byte tokenizer (no response parser: the fallback; its
ChatML gets ``TOOL_CHATML_TEMPLATE``), and the same vocabulary with TRL's Qwen2.5 tools
template and the response template TRL gives it (``add_response_schema``): the tokenizer's
own ``parse_response``.
"""

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers.utils import get_json_schema
from trl.chat_template_utils import add_response_schema, parse_response, qwen2_5_chat_template

from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.tasks import Sample, VaultEnvironment
from longstraw_core.data.tokenizer import CHATML_TEMPLATE, builtin_tokenizer
from longstraw_core.schema.run_config import RolloutSection
from longstraw_core.tools import (
    TOOL_CHATML_TEMPLATE,
    AgentError,
    Agents,
    ToolBranch,
    ToolRunner,
    ToolSet,
    has_response_parser,
    overflows,
    parse_hermes,
    parse_turn,
    reset_group,
    resume_ids,
    reward_function,
    template_kwargs,
    tool_metrics,
    tool_schema,
    tool_suffix,
    with_observation,
)
from longstraw_core.tools.schemas import ToolSchemaError

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "configs" / "qwen36" / "tiny_agent_cpu.yaml"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: The address.
    """
    await asyncio.sleep(0.01)
    return f"<html>{url}</html>"


def fails(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


def hangs(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def hangs_async(seconds: float) -> str:
    """Sleeps, awaiting.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


class Counter:
    """An environment: ``reset`` and two tools, one of them async; a reward."""

    def __init__(self) -> None:
        self.total = 0

    def reset(self, start: int = 0, **kwargs) -> str:
        self.total = start
        return f" (the counter starts at {start})"

    def add(self, n: int) -> int:
        """Add to the counter.

        Args:
            n: How much.
        """
        self.total += n
        return self.total

    async def peek(self) -> int:
        """The counter's value."""
        return self.total

    def get_reward(self) -> float:
        return float(self.total)

    def _private(self) -> None:
        pass


@pytest.fixture(scope="module")
def byte_tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    tok = builtin_tokenizer()
    tok.chat_template = qwen2_5_chat_template
    return add_response_schema(tok)  # TRL's: the Qwen response template


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _toolset(functions=(), environment=None, **kw) -> ToolSet:
    schemas = [tool_schema(f) for f in functions]
    if environment is not None:
        schemas += [tool_schema(m) for m in (Counter().add, Counter().peek)]  # its tools
    return ToolSet(list(functions), environment, schemas, **kw)


# --------------------------------------------------------------------------- schemas


def test_schemas_are_transformers_own_in_trls_order(tmp_path: Path) -> None:
    cfg = load_config(
        AGENT,
        ["rollout.tools=[tests.tools.test_tools:multiply,tests.tools.test_tools:fetch]",
         "rollout.environment=tests.tools.test_tools:Counter"],
        check_paths=False,
    )  # fmt: skip
    toolset = ToolSet.load(cfg.rollout)
    env = Counter()
    assert toolset.schemas == [get_json_schema(f) for f in (multiply, fetch, env.add, env.peek)]
    assert toolset.names == ["multiply", "fetch", "add", "peek"]
    # (pytest imports this file as test_tools, the config names it tests.tools.test_tools)
    assert toolset.environment.__qualname__ == "Counter" == toolset.environment_name
    assert toolset.max_iterations == 2 and toolset.timeout == 60.0
    assert list(toolset.branch_tools(env)) == toolset.names
    assert toolset.branch_tools(env)["add"].__self__ is env


def test_template_kwargs(byte_tok, qwen_tok) -> None:
    schemas = [tool_schema(multiply)]
    assert template_kwargs(byte_tok, [], {"x": 1}) == {"x": 1}  # no tools: nothing added
    kw = template_kwargs(byte_tok, schemas, {"x": 1})
    assert kw == {"x": 1, "chat_template": TOOL_CHATML_TEMPLATE, "tools": schemas}
    assert template_kwargs(qwen_tok, schemas) == {"tools": schemas}  # its own supports tools
    # Without tools the tool template renders exactly as the built-in ChatML.
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    for gen in (False, True):
        ours = byte_tok.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=gen,
            chat_template=TOOL_CHATML_TEMPLATE,
        )
        assert ours == byte_tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=gen, chat_template=CHATML_TEMPLATE
        )
    text = byte_tok.apply_chat_template(conversation, tokenize=False, **kw)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"multiply"' in text
    plain = builtin_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="cannot render a tool call"):
        template_kwargs(plain, schemas)


# --------------------------------------------------------------------------- parsing

TURNS = [
    'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "fetch", "arguments": {"url": "x"}}\n</tool_call><|im_end|>',
    '<tool_call>{"name": "peek"}</tool_call><|im_end|>',  # no arguments: {}
    "<answer>12</answer><|im_end|>",
    "<think>about it</think>\nThe answer.<|im_end|>",
    '<tool_call>\n{"name": bad json\n</tool_call><|im_end|>',  # malformed: plain text
    # arguments typed by the schema; "x" is no integer: kept; unknown keys and tools untyped
    '<tool_call>\n{"name": "multiply", "arguments": {"a": "3", "b": "x", "c": "1"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "other", "arguments": {"a": "3"}}\n</tool_call><|im_end|>',
    # arguments that are no object are kept (the call then fails when run); extra keys too
    '<tool_call>\n{"name": "multiply", "arguments": "{\\"a\\": 3}"}\n</tool_call>\n'
    '<tool_call>\n{"name": "fetch", "arguments": ["x"], "id": 1}\n</tool_call><|im_end|>',
    "<tool_call>\n[1, 2]\n</tool_call><|im_end|>",  # no object: plain text
]


@pytest.mark.parametrize("text", TURNS)
def test_fallback_parses_as_the_qwen_response_template_does(byte_tok, qwen_tok, text) -> None:
    ids = byte_tok(text, add_special_tokens=False)["input_ids"]
    assert not has_response_parser(byte_tok) and has_response_parser(qwen_tok)
    prefix = byte_tok.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, return_dict=False
    )
    schemas = [tool_schema(multiply), tool_schema(fetch)]
    fallback = parse_turn(byte_tok, ids, prefix, schemas)
    assert fallback == parse_turn(qwen_tok, ids, prefix, schemas)
    # ... and the tokenizer's own path is TRL's parse_response, with the whole prompt as prefix
    assert parse_turn(qwen_tok, ids, resume_ids(qwen_tok), schemas) == parse_response(
        qwen_tok, ids, prefix=prefix, tools=schemas
    )


def test_fallback_round_trips_the_template_it_documents(byte_tok) -> None:
    kw = template_kwargs(byte_tok, [tool_schema(multiply)])
    message = {
        "role": "assistant",
        "content": "Computing.",
        "tool_calls": [_call("multiply", a=6, b=7), _call("multiply", a=1, b=1)],
    }
    user = [{"role": "user", "content": "6 x 7?"}]
    prompt = byte_tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False, **kw)
    full = byte_tok.apply_chat_template([*user, message], return_dict=False, **kw)
    turn = full[len(prompt) : full.index(byte_tok.eos_token_id, len(prompt)) + 1]
    assert parse_turn(byte_tok, turn, resume_ids(byte_tok, kw)) == message
    # a call cut before its closing tag is not a call
    assert parse_hermes('<tool_call>\n{"name": "multiply"') == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "multiply"',
    }
    # arguments are typed by the schema (transformers' rule); a JSON string is kept (TRL's)
    schemas = [tool_schema(multiply)]
    assert parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": "6", "b": 7}}</tool_call>',
                        schemas)["tool_calls"] == [_call("multiply", a=6, b=7)]  # fmt: skip
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[
        "tool_calls"
    ] == [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]


# --------------------------------------------------------------------------- running


def test_errors_become_failures_with_trls_error_result() -> None:
    runner = ToolRunner(timeout=5)
    tools = {"multiply": multiply, "fails": fails, "fetch": fetch}
    calls = [
        _call("fetch", url="a"),  # async: its result comes after the sync ones (TRL's order)
        _call("multiply", a=2, b=3),
        _call("fails", x=1),
        _call("nope"),
        _call("multiply", a=1),  # a missing argument
        {"type": "code", "name": "multiply"},
        {"type": "function", "function": {"name": "multiply", "arguments": ""}},  # no mapping
    ]
    results = runner.run(calls, tools)
    assert [(r.name, r.failed) for r in results] == [
        ("multiply", False), ("fails", True), ("nope", True), ("multiply", True),
        ("multiply", True), ("multiply", True), ("fetch", False),
    ]  # fmt: skip
    assert results[0].message == {"role": "tool", "name": "multiply", "content": "6"}
    assert results[1].result == {"error": "broken on 1"}
    assert results[1].message["content"] == "{'error': 'broken on 1'}"  # TRL's str(result)
    assert results[2].result == {"error": "Tool nope not found."}
    assert "missing 1 required positional argument" in results[3].result["error"]
    assert results[4].result == {"error": "Unsupported tool call type: code"}
    assert "argument after ** must be a mapping, not str" in results[5].result["error"]  # TRL's
    assert results[6].message["content"] == "<html>a</html>"
    runner.close()


def test_a_hanging_tool_is_a_failure_after_its_timeout() -> None:
    runner = ToolRunner(timeout=0.3)
    start = time.monotonic()
    (sync,) = runner.run([_call("hangs", seconds=3)], {"hangs": hangs})
    (async_,) = runner.run([_call("hangs_async", seconds=3)], {"hangs_async": hangs_async})
    assert time.monotonic() - start < 2.0
    assert sync.failed and "timeout of 0.3 s" in sync.result["error"]
    assert async_.failed and "timeout of 0.3 s" in async_.result["error"]
    # the hung thread runs on: the same tool is not called again meanwhile
    (again,) = runner.run([_call("hangs", seconds=0)], {"hangs": hangs})
    assert again.failed and "still running" in again.result["error"]
    (fine,) = runner.run([_call("hangs_async", seconds=0)], {"hangs_async": hangs_async})
    assert fine.result == "woke" and not fine.failed
    untimed = ToolRunner(timeout=None).run([_call("hangs", seconds=0.05)], {"hangs": hangs})
    assert untimed[0].result == "woke"
    runner.close()


# --------------------------------------------------------------------------- environments


def test_environment_reset_tools_and_reward(byte_tok) -> None:
    envs = [Counter(), Counter()]
    observation = reset_group(envs, {"start": 5, "answer": "x"})
    assert observation == " (the counter starts at 5)"
    prompt = [{"role": "user", "content": "Count."}]
    assert with_observation(prompt, observation) == [
        {"role": "user", "content": "Count. (the counter starts at 5)"}
    ]
    assert prompt == [{"role": "user", "content": "Count."}]  # not changed in place
    assert with_observation(prompt, None) is prompt
    toolset = _toolset(environment=Counter)
    runner = ToolRunner()
    results = runner.run([_call("add", n=2), _call("peek")], toolset.branch_tools(envs[0]))
    assert [r.result for r in results] == [7, 7] and envs[1].total == 5  # per-branch state
    reward = reward_function(Counter)
    assert reward.__name__ == "Counter"
    assert reward(environments=[*envs, VaultEnvironment()]) == [7.0, 5.0, None]

    class Moody(Counter):
        def reset(self, **kwargs) -> str:
            return str(id(self))

    with pytest.raises(ValueError, match="same observation"):
        reset_group([Moody(), Moody()], {})
    agents = Agents(_toolset(environment=Moody), byte_tok, max_new_tokens=4)
    with pytest.raises(AgentError, match=r"^rollout.environment: Moody.reset raised ValueError: "):
        agents.group(Sample(id="0", prompt="Count.", answer=""), 2)


class Hangs(Counter):
    def reset(self, seconds: float = 0, **kwargs) -> str:
        time.sleep(seconds)
        return ""


class Raises(Counter):
    def reset(self, **kwargs) -> str:
        raise KeyError("no such sandbox")


class Exits(Counter):
    def reset(self, **kwargs) -> str:
        raise SystemExit(3)


class BreaksAtBirth(Counter):
    def __init__(self) -> None:
        raise OSError("the sandbox image is gone")


@pytest.mark.parametrize(
    ("environment", "line"),
    [
        (Hangs, "rollout.environment: Hangs.reset took longer than "
                "rollout.environment_timeout_seconds=0.3 s (it runs on in its thread); make it "
                "return sooner, or raise rollout.environment_timeout_seconds (null: no limit)"),
        (Raises, "rollout.environment: Raises.reset raised KeyError: 'no such sandbox'"),
        (Exits, "rollout.environment: Exits.reset raised SystemExit: 3"),  # this callback's failure
        (BreaksAtBirth, "rollout.environment: BreaksAtBirth() raised OSError: "
                        "the sandbox image is gone"),
    ],
)  # fmt: skip
def test_an_environment_that_hangs_or_fails_stops_the_run_with_one_line(
    byte_tok, environment, line
) -> None:
    """``reset`` had no timeout: a hung sandbox stalled the run forever (tools and rewards
    time out). Now each environment callback fails within ``rollout.environment_timeout_seconds``
    with one line naming it, whatever it raised."""
    toolset = _toolset(environment=environment, environment_timeout=0.3)
    agents = Agents(toolset, byte_tok, max_new_tokens=4)
    sample = Sample(id="0", prompt="Count.", answer="", columns={"seconds": 30})
    started = time.monotonic()
    with pytest.raises(AgentError) as raised:
        agents.group(sample, 2)
    assert time.monotonic() - started < 5  # not the 30 s reset sleeps
    assert str(raised.value) == line
    sample = Sample(id="0", prompt="Count.", answer="", columns={"seconds": 0})
    if environment is Hangs:  # within the limit, or with none (null): it works
        assert agents.group(sample, 2).sample.prompt == "Count."
        untimed = Agents(_toolset(environment=Hangs, environment_timeout=None), byte_tok,
                         max_new_tokens=4)  # fmt: skip
        assert len(untimed.group(sample, 3).environments) == 3


def test_environment_timeout_seconds_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"rollout.environment_timeout_seconds: 0.0 is invalid"):
        load_config(AGENT, ["rollout.environment_timeout_seconds=0"])
    assert load_config(AGENT, ["rollout.environment_timeout_seconds=null"])


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("which", ["byte_tok", "qwen_tok"])
def test_branch_tokens_equal_the_template_rendering_the_whole_conversation(request, which) -> None:
    tok = request.getfixturevalue(which)
    toolset = _toolset([multiply, fetch], max_iterations=5)
    kw = template_kwargs(tok, toolset.schemas)
    user = [{"role": "user", "content": "What is 6 x 7? Then fetch it."}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False, **kw)
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [_call("multiply", a=6, b=7)]},
        {"role": "assistant", "content": "Now the page.",
         "tool_calls": [_call("multiply", a=1, b=0), _call("fetch", url="42")]},
        {"role": "assistant", "content": "<answer>42</answer>"},
    ]  # fmt: skip
    runner = ToolRunner()
    branch = ToolBranch(
        tok, toolset, runner, prompt_tokens=len(prompt), max_new_tokens=4096, template_kwargs=kw
    )
    conversation = list(user)
    for turn in turns:
        # the model's tokens for this turn: the template's rendering of it, up to its EOS
        before = tok.apply_chat_template(
            conversation, add_generation_prompt=True, return_dict=False, **kw
        )
        after = tok.apply_chat_template([*conversation, turn], return_dict=False, **kw)
        turn_ids = after[len(before) : after.index(tok.eos_token_id, len(before)) + 1]
        assert prompt + branch.completion_ids == before
        suffix = branch.end_turn(turn_ids)
        results = [m for m in branch.messages if m["role"] == "tool"]
        conversation += [turn, *results[sum(m["role"] == "tool" for m in conversation) :]]
        if "tool_calls" in turn:
            # suffix == what the template renders after the turn's EOS for its results
            full = tok.apply_chat_template(
                conversation, add_generation_prompt=True, return_dict=False, **kw
            )
            assert prompt + branch.completion_ids == full
            assert suffix == full[len(full) - len(suffix) :] and suffix[-3:] != []
            assert tool_suffix(tok, conversation[-len(turn["tool_calls"]) :], kw).resume_ids == (
                resume_ids(tok, kw)
            )
        else:
            assert suffix == [] and branch.done
    assert branch.messages == [
        turns[0], {"role": "tool", "name": "multiply", "content": "42"},
        turns[1], {"role": "tool", "name": "multiply", "content": "0"},
        {"role": "tool", "name": "fetch", "content": "<html>42</html>"}, turns[2],
    ]  # fmt: skip
    # the loss mask: 1 on the model's turns, 0 on the results and the reopened header
    model_tokens = sum(branch.loss_mask)
    assert len(branch.loss_mask) == len(branch.completion_ids)
    assert model_tokens == len(branch.completion_ids) - sum(
        len(tool_suffix(tok, conversation[i:j], kw).ids) for i, j in ((2, 3), (4, 6))
    )
    assert (branch.calls, branch.failures, branch.iterations) == (3, 0, 2)
    assert tool_metrics(branch.calls, branch.failures, 2) == {
        "tools/call_frequency": 1.5, "tools/failure_frequency": 0.0,
    }  # fmt: skip
    assert tool_metrics(0, 0, 4)["tools/failure_frequency"] == 0.0


def test_overflow_and_iteration_limits_end_a_branch_as_trl_does(byte_tok) -> None:
    toolset = _toolset([multiply], max_iterations=1)
    kw = template_kwargs(byte_tok, toolset.schemas)
    turn = byte_tok(
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )["input_ids"]
    suffix = tool_suffix(byte_tok, [{"role": "tool", "name": "multiply", "content": "4"}], kw)
    runner = ToolRunner()

    def branch(max_new_tokens: int, max_positions: int | None = None) -> ToolBranch:
        return ToolBranch(
            byte_tok, toolset, runner, prompt_tokens=100, max_new_tokens=max_new_tokens,
            template_kwargs=kw, max_positions=max_positions,
        )  # fmt: skip

    fits = len(turn) + len(suffix.ids)
    b = branch(fits)  # exactly fits (TRL: overflow is > max_completion_length)
    assert b.end_turn(turn) == suffix.ids and b.budget == 0
    assert b.end_turn([]) == [] and b.done  # no room left for a turn
    b = branch(fits - 1)  # the result would overflow: dropped, the branch ends as it is
    assert b.end_turn(turn) == [] and b.done and b.calls == 1
    assert [m["role"] for m in b.messages] == ["assistant"] and b.loss_mask == [1] * len(turn)
    b = branch(4096, max_positions=100 + fits)  # reaching the position limit: dropped too
    assert b.end_turn(turn) == []
    assert not overflows(100, len(turn), len(suffix.ids), 4096, 100 + fits + 1)
    b = branch(4096)  # max_tool_calling_iterations=1: the second round's calls do not run
    assert b.end_turn(turn) and b.end_turn(turn) == [] and b.done
    assert b.calls == 1 and [m["role"] for m in b.messages] == ["assistant", "tool", "assistant"]
    with pytest.raises(RuntimeError, match="finished"):
        b.end_turn(turn)


# --------------------------------------------------------------------------- config


def _tools_module(directory: Path) -> None:
    (directory / "my_tools.py").write_text(
        textwrap.dedent(
            '''
            def good(x: int) -> int:
                """Good.

                Args:
                    x: A number.
                """
                return x

            def undocumented(x: int) -> int:
                return x

            def unhinted(x):
                """No hints.

                Args:
                    x: A number.
                """

            def lookup(key: str) -> str:
                """Clashes with VaultEnvironment.lookup.

                Args:
                    key: A key.
                """

            class NoTools:
                def reset(self, **kwargs):
                    pass

                def get_reward(self):
                    return 0.0

            class NoReset:
                def act(self, x: int) -> int:
                    """Act.

                    Args:
                        x: A number.
                    """
            '''
        )
    )


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["rollout.tools=[my_tools:undocumented]"], "rollout.tools[0]",
         ["undocumented", "no docstring", "Google-style docstring"]),
        (["rollout.tools=[my_tools:good,my_tools:unhinted]"], "rollout.tools[1]",
         ["unhinted", "type hint"]),
        (["rollout.tools=[my_tools:good,my_tools:good]"], "rollout.tools[1]",
         ["two tools are named 'good'", "rename one"]),
        (["rollout.tools=[my_tools:lookup]"], "rollout.environment",
         ["two tools are named 'lookup'", "my_tools:lookup",
          "longstraw_core.data.tasks.agent:VaultEnvironment.lookup"]),
        (["rollout.tools=[my_tools:missing]"], "rollout.tools[0]", ["cannot import", "missing"]),
        (["rollout.tools=[no_such_module:f]"], "rollout.tools[0]", ["no_such_module"]),
        (["rollout.tools=[my_tools:NoTools]"], "rollout.tools[0]", ["not a function"]),
        (["rollout.environment=my_tools:NoTools"], "rollout.environment",
         ["NoTools has no public methods"]),
        (["rollout.environment=my_tools:NoReset"], "rollout.environment",
         ["NoReset has no reset method"]),
        (["rollout.environment=my_tools:good"], "rollout.environment", ["not a class"]),
        (["rollout.max_tool_calling_iterations=-1"], "rollout.max_tool_calling_iterations",
         [">= 0"]),
        (["rollout.tool_timeout_seconds=0"], "rollout.tool_timeout_seconds", ["seconds > 0"]),
        (["rollout.tool_threads=0"], "rollout.tool_threads", ["int >= 1"]),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_at_load_naming_the_function(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    _tools_module(tmp_path)
    config = tmp_path / "agent.yaml"
    config.write_text(AGENT.read_text())  # the tools module sits beside the config
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides, check_paths=False)
    assert info.value.key == key
    for word in words:
        assert word in str(info.value)
    sys.modules.pop("my_tools", None)


def test_the_agent_recipe_config_loads_its_tools() -> None:
    cfg = load_config(AGENT)
    toolset = ToolSet.load(cfg.rollout)
    assert toolset.names == ["lookup"] and toolset.environment is VaultEnvironment
    assert toolset.environment_name == "VaultEnvironment"
    defaults = RolloutSection()  # no tools, TRL's defaults
    assert (defaults.tools, defaults.environment) == ([], None)
    assert (defaults.max_tool_calling_iterations, defaults.tool_timeout_seconds) == (None, 60.0)
    assert defaults.tool_threads is None and toolset.threads is None
    with pytest.raises(ToolSchemaError, match="Google-style"):
        tool_schema(lambda x: x)
