"""A long-horizon agent task: the answer needs a tool call whose argument only the long
history holds.

``agent_lookup``'s prompt is the log of an agent's earlier session (the haystack) in which
tool outputs recorded where records were stored: ``Tool output (store_record): the invoice
record was stored in the vault under the key teal-otter.``, one per record, the queried one at
``depth``, the others at seeded random depths. The question asks for the secret code of one
record. The codes are in no prompt: only ``VaultEnvironment.lookup(key)`` returns them, so a
branch must find the record's key deep in the history, call the tool, read its result and
answer in ``<answer></answer>`` tags. ``final_answer_match`` scores that answer.

The sample's columns (``meta``) carry ``key``, ``subject`` and ``vault`` (every record's key ->
code); TRL's ``reset(**row)`` hands them to each branch's environment. In a run config::

    data: {task: agent_lookup}
    rollout: {environment: longstraw_core.data.tasks.agent:VaultEnvironment}
    rewards: [{name: longstraw_core.data.tasks.agent:final_answer_match}]
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from longstraw_core.data.tasks.sample import (
    Draft,
    needle_depths,
    numbers,
    task_generator,
    two_word_keys,
)

# Record names; none is a filler or key word.
SUBJECTS = (
    "invoice", "payroll", "contract", "manifest", "warranty", "passport", "mortgage",
    "pension", "ledger", "receipt", "license", "audit", "lease", "permit",
)  # fmt: skip


@task_generator
def agent_lookup(
    rng: random.Random, depth: float = 0.5, *, num_distractors: int = 3, digits: int = 6
) -> Draft:
    """The vault lookup (module docstring); the answer is the queried record's code. Tool
    calls are parsed from chat turns only (TRL's rule): ``chat=False`` gives the plain text."""
    if not 0 <= num_distractors < len(SUBJECTS):
        raise ValueError(
            f"agent_lookup: num_distractors must be in [0, {len(SUBJECTS) - 1}], got "
            f"{num_distractors}"
        )
    n = 1 + num_distractors
    subjects = rng.sample(SUBJECTS, n)
    keys = two_word_keys(rng, n)
    codes = numbers(rng, n, digits)
    depths = needle_depths(depth, 1, "agent_lookup") + [rng.random() for _ in keys[1:]]
    needles = [
        (
            d,
            f"Tool output (store_record): the {s} record was stored in the vault under the key {k}.",
        )
        for d, s, k in zip(depths, subjects, keys, strict=True)
    ]
    return Draft(
        intro=(
            "Below is the log of your earlier work session: your notes and the outputs of the "
            "tools you called. Records were stored in a vault; the log gives each record's "
            "vault key, never its secret code."
        ),
        question=(
            f"What is the secret code of the {subjects[0]} record? Find its vault key in the "
            "log, call the lookup tool with that key, and give the code."
        ),
        needles=needles,
        answer=codes[0],
        meta={
            "key": keys[0],
            "subject": subjects[0],
            "vault": dict(zip(keys, codes, strict=True)),
        },
    )


class VaultEnvironment:
    """The vault of one branch (TRL's environment: one instance per branch, ``reset`` with
    the sample's columns). Its tool is ``lookup``; ``get_reward`` gives 1.0 when the branch
    looked up the queried record's key (credit for the right call, whatever the answer)."""

    def __init__(self) -> None:
        self._vault: dict[str, str] = {}
        self._key: str | None = None
        self._looked_up: list[str] = []

    def reset(
        self, vault: Mapping[str, str] | None = None, key: str | None = None, **kwargs: Any
    ) -> None:
        self._vault = dict(vault or {})
        self._key = key
        self._looked_up = []

    def lookup(self, key: str) -> str:
        """Read the secret code stored in the vault under a key.

        Args:
            key: The record's vault key, as the log gives it (e.g. "teal-otter").

        Returns:
            The record's secret code.
        """
        key = key.strip()
        self._looked_up.append(key)
        if key not in self._vault:
            raise KeyError(f"the vault has no record under the key {key!r}")
        return self._vault[key]

    def get_reward(self) -> float:
        return float(self._key is not None and self._key in self._looked_up)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_answer_match(
    completions: list[Any], answer: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 when the last assistant message's last ``<answer>`` equals the code (whitespace
    ignored), else 0.0; None without a reference. Only the model's own final turn counts: a
    tool result (which holds the code) or a turn without tags scores 0."""
    out: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        ref = "".join(str(reference).split())
        if not ref:
            out.append(None)
            continue
        text = _final_text(completion)
        found = _ANSWER.findall(text)
        out.append(float(bool(found) and "".join(found[-1].split()) == ref))
    return out


def _final_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    messages = list(completion or [])
    if not messages or messages[-1].get("role") != "assistant":
        return ""
    content = messages[-1].get("content")
    return content if isinstance(content, str) else ""


def vault_transcript(sample: Any, environment: VaultEnvironment) -> list[dict[str, Any]]:
    """The ideal completion of an ``agent_lookup`` sample as chat messages (what a warm start
    teaches, ``longstraw_core.models.warm_start``): call ``lookup`` with the queried record's key, read
    the result (from ``environment``, reset with the sample's row), answer with it in tags."""
    key = sample.meta["key"]
    code = environment.lookup(key)
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": code},
        {"role": "assistant", "content": f"<answer>{code}</answer>"},
    ]
