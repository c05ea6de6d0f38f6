"""An agent's rollout against TRL 1.16's own tool loop (issue 27), end to end on one model.

A tiny qwen3 is overfit (a few dozen Adam steps, CPU) on two scripted agent conversations,
rendered by the chat template with the tool's schema (the built-in byte tokenizer's
``TOOL_CHATML_TEMPLATE``), the loss on the assistant turns only, so that greedy decoding
replays them:

- ``found``: the model calls ``lookup`` with one key, reads the code and answers;
- ``missing``: it calls ``lookup`` twice in one turn, for a key the vault lacks (the tool
  raises: an ``{"error": ...}`` result and a failure) and for one it holds, and answers.

The same model then runs twice from the same prompt: LongStraw as a run makes it
(``tools.Agents``, ``PromptGroup``: the observed prompt, ``adapter.prefill``,
``ls.rollout(..., temperature=0, turns=group.tool_turns())``, ``group.completions``) and a real
``trl.GRPOTrainer`` (``tools=[lookup]``, or ``environment_factory``) whose
``_generate_and_score_completions`` runs ``_generate`` and ``_tool_call_loop`` with
``generate(do_sample=False)``; its return values are read as they pass (the methods are
wrapped, not replaced). Equal, branch by branch: the prompt's ids, the completion's ids
(model turns and tool results), ``out.loss_masks`` == TRL's ``tool_mask``, the completion's
messages (what reward functions get) == ``ToolTurns.messages``, truncation, and the call and
failure counts (``tool_metrics`` == TRL's logged ``tools/*`` metrics). Cases: no limit; no
tool round allowed (``max_tool_calling_iterations=0``); the results overflowing
``max_completion_length`` (dropped, the call still counted); the results filling it exactly
(appended, no token left for the answer); the answer, or the first turn, cut by it; the tool
``async``; the tool as an environment's method (``rollout.environment`` vs
``environment_factory``, ``reset``'s observation appended to the prompt).

Parsers: TRL parses with the tokenizer's ``response_template``; ``add_response_schema`` knows
only the templates TRL ships, so TRL's tokenizer (the byte tokenizer with
``TOOL_CHATML_TEMPLATE`` as its own template) is given TRL's ``qwen3_template``, its parser
for Hermes ``<tool_call>`` JSON blocks (what ``add_response_schema`` gives Qwen2.5/Qwen3).
LongStraw runs with the built-in tokenizer as a run gets it (no response template: the
Hermes fallback of ``parse_turn``, ``TOOL_CHATML_TEMPLATE`` from ``template_kwargs``) and, in
the unlimited case, also with TRL's tokenizer (the tokenizer's own parser): both equal TRL.
About 60 s on a loaded 2-core machine, most of it the training (one thread).
"""

from __future__ import annotations

import asyncio
import copy
import warnings
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer
from trl.chat_template_utils import qwen3_template

import longstraw_core as ls
from longstraw_core.data.tasks import Sample
from longstraw_core.data.tokenizer import load_tokenizer
from longstraw_core.models.tiny import tiny_model
from longstraw_core.schema.run_config import RolloutSection
from longstraw_core.tools import (
    TOOL_CHATML_TEMPLATE,
    Agents,
    ToolSet,
    has_response_parser,
    template_kwargs,
    tool_metrics,
)
from longstraw_core.training.prompt_group import PromptGroup

G = 2
VAULT = {"teal-otter": "4411"}


def lookup(key: str) -> str:
    """Read the code stored under a key.

    Args:
        key: The record's key.
    """
    if key not in VAULT:
        raise KeyError(f"the vault has no record under the key {key!r}")
    return VAULT[key]


async def async_lookup(key: str) -> str:
    """Read the code stored under a key.

    Args:
        key: The record's key.
    """
    await asyncio.sleep(0)
    return lookup(key)


async_lookup.__name__ = async_lookup.__qualname__ = "lookup"  # the trained prompt's tool


class Vault:
    """The same tool as an environment's method (TRL's ``environment_factory``): the same
    schema, so the prompt renders the same; the vault comes with the row, and ``reset``
    returns the row's ``mark``, which TRL appends to the last user message."""

    def __init__(self) -> None:
        self.vault: dict[str, str] = {}

    def reset(self, vault: dict[str, str] | None = None, mark: str = "", **kwargs: Any) -> str:
        self.vault = dict(vault or {})
        return mark

    def lookup(self, key: str) -> str:
        """Read the code stored under a key.

        Args:
            key: The record's key.
        """
        if key not in self.vault:
            raise KeyError(f"the vault has no record under the key {key!r}")
        return self.vault[key]


# TRL's error result: {"error": str(exc)}, the tool message's content its str().
MISSING = str({"error": str(KeyError("the vault has no record under the key 'red-fox'"))})
# name -> (prompt, the keys of the one tool-calling turn, the results, the final answer)
SCRIPTS = {
    "found": (
        [{"role": "user", "content": "Code of teal-otter?"}],
        ["teal-otter"], ["4411"], "<answer>4411</answer>",
    ),
    "missing": (
        [{"role": "user", "content": "Which of red-fox, teal-otter has a code?"}],
        ["red-fox", "teal-otter"], [MISSING, "4411"], "<answer>teal-otter</answer>",
    ),
}  # fmt: skip
ROWS = [{"prompt": SCRIPTS[name][0]} for name in SCRIPTS]
# The environment's rows: the question's last character comes back from reset.
ENV_ROWS = [
    {"prompt": [{"role": "user", "content": SCRIPTS[name][0][0]["content"][:-1]}],
     "vault": VAULT, "mark": SCRIPTS[name][0][0]["content"][-1]}
    for name in SCRIPTS
]  # fmt: skip
FULL = 384  # room for every turn of both scripts (missing: 157 + 155 + 28 tokens)


def _call(key: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def script_messages(name: str) -> list[dict[str, Any]]:
    """The completion the model was trained to produce, as TRL's messages."""
    _, keys, results, answer = SCRIPTS[name]
    return [
        {"role": "assistant", "content": "", "tool_calls": [_call(k) for k in keys]},
        *({"role": "tool", "name": "lookup", "content": r} for r in results),
        {"role": "assistant", "content": answer},
    ]


@pytest.fixture(scope="module")
def byte_tok():
    """The built-in tokenizer as a run loads it (no response parser)."""
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def trl_tok():
    """TRL's: the same vocabulary, ``TOOL_CHATML_TEMPLATE`` as its template and TRL's Hermes
    response template (module docstring)."""
    tok = load_tokenizer(None)
    tok.chat_template = TOOL_CHATML_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def _render(tok, messages, generation_prompt: bool, kw) -> list[int]:
    options = {"add_generation_prompt": generation_prompt, "tokenize": True, "return_dict": False}
    return list(tok.apply_chat_template(messages, **options, **kw))


def training_sequence(tok, name: str) -> tuple[list[int], list[int]]:
    """The whole scripted conversation's tokens as the chat template renders it, and its loss
    mask (1 on each assistant turn, up to and including its EOS)."""
    kw = template_kwargs(tok, _toolset().schemas, {})
    prompt = SCRIPTS[name][0]
    conversation = list(prompt)
    tokens = _render(tok, prompt, True, kw)
    mask = [0] * len(tokens)
    for message in script_messages(name):
        if message["role"] != "assistant":
            conversation.append(message)
            continue
        before = _render(tok, conversation, True, kw)
        assert before[: len(tokens)] == tokens  # the template is prefix-preserving
        conversation.append(message)
        after = _render(tok, conversation, False, kw)
        end = after.index(tok.eos_token_id, len(before)) + 1
        mask += [0] * (len(before) - len(tokens)) + [1] * (end - len(before))
        tokens = after[:end]
    return tokens, mask


@pytest.fixture(scope="module")
def agent(byte_tok):
    """A tiny qwen3 that greedily replays both scripts (every assistant token the argmax,
    by a margin of at least 1 logit, far beyond float32 round-off). Three layers: enough for
    the agents' ring on three pipeline stages (``test_agent_run.py``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded machine: one thread is the fastest
    try:
        model = tiny_model("qwen3", vocab_size=len(byte_tok), seed=0, num_hidden_layers=3)
        sequences = [training_sequence(byte_tok, name) for name in SCRIPTS]
        width = max(len(s) for s, _ in sequences)
        pad = byte_tok.pad_token_id
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in sequences])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in sequences])[:, 1:].bool()
        inputs, targets = ids[:, :-1], ids[:, 1:][mask]
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model.train()
        for _ in range(300):
            logits = model(inputs).logits[mask]
            with torch.no_grad():
                right = logits.gather(-1, targets[:, None])[:, 0]
                rival = logits.scatter(-1, targets[:, None], float("-inf")).amax(-1)
                if (right - rival).min() > 1.0:
                    break
            loss = torch.nn.functional.cross_entropy(logits, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            pytest.fail("the tiny model did not learn the scripts in 300 steps")
        model.eval()
        model.requires_grad_(False)
    finally:
        torch.set_num_threads(threads)
    return model


def _toolset(tool: str = "lookup", iterations: int | None = None) -> ToolSet:
    """The config's tools: ``lookup``, ``async_lookup`` or the ``Vault`` environment."""
    environment = tool == "Vault"
    section = RolloutSection(
        tools=[] if environment else [f"tests.tools.test_tool_rollout:{tool}"],
        environment="tests.tools.test_tool_rollout:Vault" if environment else None,
        max_tool_calling_iterations=iterations,
    )
    return ToolSet.load(section)


def run_longstraw(model, tok, row, *, max_new_tokens, tool="lookup", iterations=None):
    """LongStraw's agent rollout of one row's group, as a run makes it (``tools.Agents`` and
    ``PromptGroup``: environments reset, the observed prompt rendered with the tools, each
    branch's tool loop, the outcome after ``close``): the prompt's ids, the rollout's output
    and the group's ``ToolOutcome``."""
    agents = Agents(
        _toolset(tool, iterations), tok, {}, max_new_tokens=max_new_tokens,
        max_positions=model.config.max_position_embeddings,
    )  # fmt: skip
    sample = Sample(id="row", prompt=row["prompt"], answer="", columns=dict(row))
    group = PromptGroup.build(sample, G, tok, agents.template_kwargs, agents)
    adapter = ls.adapt(model)
    state = adapter.prefill(group.prompt_ids)
    turns = group.tool_turns()
    out = ls.rollout(
        adapter, state, num_generations=G, max_new_tokens=max_new_tokens, temperature=0,
        eos_token_ids=[tok.eos_token_id], turns=turns, progress=False,
    )  # fmt: skip
    assert group.completions(out, turns, adapter) == group.outcomes[0].messages
    agents.close()
    return group.prompt_ids.tolist(), out, group.outcomes[0]


def run_trl(model, tok, tmp_path, rows, *, max_new_tokens, tool="lookup", iterations=None):
    """TRL's own generation of the rows' groups (G each, greedy): what ``_generate`` and
    ``_tool_call_loop`` returned, the completions its reward function got, its metrics."""
    seen: list[Any] = []

    def reward(completions, **_):
        seen.extend(copy.deepcopy(completions))
        return [0.0] * len(completions)

    config = TRLConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, seed=0,
        num_generations=G, per_device_train_batch_size=G * len(rows),
        max_completion_length=max_new_tokens, max_tool_calling_iterations=iterations,
        generation_kwargs={"do_sample": False},
    )  # fmt: skip
    tools = {"Vault": {"environment_factory": Vault}, "async_lookup": {"tools": [async_lookup]}}
    tools = tools.get(tool, {"tools": [lookup]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=copy.deepcopy(model), reward_funcs=reward, args=config, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": [r["prompt"] for r in rows]}), **tools,
        )  # fmt: skip
    assert trainer.chat_template is None  # TOOL_CHATML_TEMPLATE is prefix-preserving: kept
    returned: dict[str, Any] = {}
    for method in ("_generate", "_tool_call_loop"):
        original = getattr(trainer, method)

        def wrapped(*args, _original=original, _name=method, **kwargs):
            returned[_name] = result = _original(*args, **kwargs)
            return result

        setattr(trainer, method, wrapped)
    trainer.model.train()
    inputs = [copy.deepcopy(row) for row in rows for _ in range(G)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer._generate_and_score_completions(inputs)
    prompt_ids, completion_ids, tool_mask, completions = returned["_generate"][:4]
    calls, failures = returned["_tool_call_loop"][4:6]
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("tools/")}
    eos_and_pad = [*trainer.eos_token_ids, tok.pad_token_id]
    return {
        "prompt_ids": prompt_ids, "completion_ids": completion_ids, "tool_mask": tool_mask,
        "completions": completions, "rewarded": seen, "calls": calls, "failures": failures,
        "metrics": metrics, "truncated": [ids[-1] not in eos_and_pad for ids in completion_ids],
    }  # fmt: skip


CASES = {
    # id: (max_new_tokens, max_tool_calling_iterations, tool)
    "unlimited": (FULL, None, "lookup"),
    "no_tool_rounds": (FULL, 0, "lookup"),
    "results_overflow": (120, None, "lookup"),  # found: 80-token call + 57-token result > 120
    "results_fill": (137, None, "lookup"),  # found: the result fills the budget, no answer
    "answer_cut": (150, None, "lookup"),  # found: the answer cut; missing: its call turn cut
    "async": (FULL, None, "async_lookup"),
    "environment": (FULL, None, "Vault"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_agent_rollout_equals_trls_tool_loop(agent, byte_tok, trl_tok, tmp_path, case):
    max_new_tokens, iterations, tool = CASES[case]
    limits = {"max_new_tokens": max_new_tokens, "iterations": iterations, "tool": tool}
    rows = ENV_ROWS if tool == "Vault" else ROWS
    trl = run_trl(agent, trl_tok, tmp_path, rows, **limits)
    tokenizers = [byte_tok, trl_tok] if case == "unlimited" else [byte_tok]
    assert not has_response_parser(byte_tok) and has_response_parser(trl_tok)
    for tok in tokenizers:
        calls = failures = 0
        for p, row in enumerate(rows):
            prompt_ids, out, outcome = run_longstraw(agent, tok, row, **limits)
            calls, failures = calls + outcome.calls, failures + outcome.failures
            for i in range(G):
                r = p * G + i  # TRL's row: the prompt's G completions are consecutive
                assert prompt_ids == trl["prompt_ids"][r]
                assert out.responses[i].tolist() == trl["completion_ids"][r]
                assert out.loss_masks[i].tolist() == trl["tool_mask"][r]
                assert outcome.messages[i] == trl["completions"][r] == trl["rewarded"][r]
                assert out.truncated[i] == trl["truncated"][r]
        assert (calls, failures) == (trl["calls"], trl["failures"])
        assert tool_metrics(calls, failures, G * len(ROWS)) == pytest.approx(trl["metrics"])
    # Not equal by both doing nothing: what each case makes of the scripts.
    found, missing = trl["completions"][0], trl["completions"][G]
    if case in ("unlimited", "async", "environment"):
        assert found == script_messages("found") and missing == script_messages("missing")
        assert (trl["calls"], trl["failures"]) == (3 * G, G)
        assert missing[1]["content"] == MISSING  # the raising tool's result, TRL's and ours
    elif case == "no_tool_rounds":
        assert [found, missing] == [script_messages(n)[:1] for n in SCRIPTS]
        assert trl["calls"] == 0 and set(trl["tool_mask"][0]) == {1}
    elif case == "results_overflow":
        # found's results would pass max_completion_length: dropped, its call still counted;
        # missing's calling turn is cut inside its second call: plain text, nothing runs.
        assert found == script_messages("found")[:1] and 0 not in trl["tool_mask"][0]
        assert "tool_calls" not in missing[0] and trl["truncated"][G]
        assert (trl["calls"], trl["failures"]) == (G, 0)
    elif case == "results_fill":
        # found's result fits exactly: appended, the next turn gets no token (no message)
        assert found == script_messages("found")[:2] and trl["truncated"][0]
        assert trl["tool_mask"][0][-1] == 0 and len(trl["completion_ids"][0]) == max_new_tokens
    else:  # answer_cut
        assert found[:2] == script_messages("found")[:2] and trl["truncated"][0]
        assert found[2]["content"] == "<answer>4411</answer>"[: len(found[2]["content"])]
        assert len(trl["completion_ids"][0]) == max_new_tokens
