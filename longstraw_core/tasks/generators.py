"""The task families, one generator each (RULER's passkey, multi-key UUID and multi-value
needles, multi-hop key-value chains, variable tracking): each picks its needles, question and
answer from its seed and leaves the rest to ``sample``. A new family is one function here and
one entry in ``streams.TASKS``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.tasks.sample import (
    ANSWER_INSTRUCTION,
    Depth,
    Sample,
    fit_multi,
    make_sample,
    needle_depths,
    numbers,
    task_rng,
    two_word_keys,
    var_names,
)


def passkey_retrieval(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    digits: int = 5,
    chat: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's single needle: one pass key in the haystack; the answer is the number."""
    rng = task_rng("passkey_retrieval", seed)
    (key,) = numbers(rng, 1, digits)
    return make_sample(
        "passkey_retrieval",
        tokenizer,
        intro=(
            "There is an important piece of information hidden inside a lot of irrelevant "
            "text. Find it and memorize it. I will quiz you about it."
        ),
        question=f"What is the pass key? {ANSWER_INSTRUCTION}",
        needles=[(needle_depths(depth, 1, "passkey_retrieval")[0], _passkey_needle(key))],
        answer=key,
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
        chat_template_kwargs=chat_template_kwargs,
        tolerance=tolerance,
        id=id,
        meta={},
    )


def _passkey_needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def uuid_retrieval(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    num_distractors: int = 3,
    chat: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's multi-key needle with UUID values: find the UUID of one key among several.

    The queried needle goes at ``depth``; distractors (other keys) at seeded random depths.
    """
    rng = task_rng("uuid_retrieval", seed)
    keys = two_word_keys(rng, 1 + num_distractors)
    uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in keys]
    depths = needle_depths(depth, 1, "uuid_retrieval") + [rng.random() for _ in keys[1:]]
    needles = [
        (d, f"The special magic uuid for {k} is: {u}.")
        for d, k, u in zip(depths, keys, uuids, strict=True)
    ]
    return make_sample(
        "uuid_retrieval",
        tokenizer,
        intro=(
            "Some special magic uuids are hidden within the following text. Make sure to "
            "memorize them. I will quiz you about the uuids afterwards."
        ),
        question=(
            f"What is the special magic uuid for {keys[0]} mentioned in the text? "
            f"{ANSWER_INSTRUCTION}"
        ),
        needles=needles,
        answer=uuids[0],
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
        chat_template_kwargs=chat_template_kwargs,
        tolerance=tolerance,
        id=id,
        meta={"key": keys[0], "distractor_keys": keys[1:]},
    )


def multi_needle(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: Depth | None = None,
    seed: int = 0,
    *,
    num_needles: int = 4,
    num_distractors: int = 2,
    digits: int = 7,
    chat: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's multi-value needle: every number given for one key, in order of appearance.

    ``depth``: one float for all needles, one per needle, or ``None`` to spread them evenly.
    Distractor needles carry other keys. ``meta["answers"]`` lists the values.
    """
    if num_needles < 1:
        raise ValueError(f"multi_needle: num_needles must be >= 1, got {num_needles}")
    rng = task_rng("multi_needle", seed)
    key, *others = two_word_keys(rng, 1 + num_distractors)
    values = numbers(rng, num_needles + num_distractors, digits)
    depths = needle_depths(depth, num_needles, "multi_needle")
    depths += [rng.random() for _ in others]
    owners = [key] * num_needles + others
    needles = [
        (d, f"One of the special magic numbers for {k} is: {v}.")
        for d, k, v in zip(depths, owners, values, strict=True)
    ]
    return fit_multi(
        "multi_needle",
        tokenizer,
        intro=(
            "Some special magic numbers are hidden within the following text. Make sure to "
            "memorize them. I will quiz you about the numbers afterwards."
        ),
        question=(
            f"What are all the special magic numbers for {key} mentioned in the text? List "
            f"them in order of appearance, separated by commas. {ANSWER_INSTRUCTION}"
        ),
        needles=needles,
        items=values[:num_needles],
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
        chat_template_kwargs=chat_template_kwargs,
        tolerance=tolerance,
        id=id,
        meta={"key": key, "distractor_keys": others},
    )


def kv_chain(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: Depth = 0.5,
    seed: int = 0,
    *,
    hops: int = 3,
    num_distractor_chains: int = 2,
    digits: int = 6,
    chat: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """Multi-hop key-value lookup: start at a key, follow ``hops`` pointers, report the value.

    The chain's ``hops + 1`` facts sit at ``depth`` (one float: together, in shuffled order;
    or one depth per fact in chain order). Distractor chains of the same shape use other
    keys and values, at seeded random depths.
    """
    if hops < 1:
        raise ValueError(f"kv_chain: hops must be >= 1, got {hops}")
    rng = task_rng("kv_chain", seed)
    n_chains = 1 + num_distractor_chains
    keys = two_word_keys(rng, n_chains * (hops + 1))
    values = numbers(rng, n_chains, digits)
    needles: list[tuple[float, str]] = []
    for c in range(n_chains):
        chain = keys[c * (hops + 1) : (c + 1) * (hops + 1)]
        facts = [f"The key {a} points to the key {b}." for a, b in pairwise(chain)]
        facts.append(f"The key {chain[-1]} holds the value {values[c]}.")
        mine = c == 0
        depths = (
            needle_depths(depth, hops + 1, "kv_chain") if mine else [rng.random() for _ in facts]
        )
        rng.shuffle(facts)  # same-depth facts appear in this order: not the chain's
        needles += zip(depths, facts, strict=True)
    return make_sample(
        "kv_chain",
        tokenizer,
        intro=(
            "The following text hides facts about keys: some keys point to other keys, and "
            "some keys hold values. Memorize them. I will quiz you about them afterwards."
        ),
        question=(
            f"Start at the key {keys[0]} and follow the keys it points to, one after "
            f"another. What value does the last key hold? {ANSWER_INSTRUCTION}"
        ),
        needles=needles,
        answer=values[0],
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
        chat_template_kwargs=chat_template_kwargs,
        tolerance=tolerance,
        id=id,
        meta={"hops": hops, "chain": keys[: hops + 1]},
    )


def variable_tracking(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: Depth = 0.5,
    seed: int = 0,
    *,
    hops: int = 4,
    num_chains: int = 2,
    digits: int = 5,
    chat: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's variable tracking: ``VAR A = 12345.``, ``VAR B = VAR A.``, ...; name every
    variable that ends up holding the queried value, in order of assignment.

    The queried chain's ``hops + 1`` assignments sit at ``depth`` (one float, or one per
    assignment; sorted so a variable is assigned before it is read); ``num_chains - 1``
    distractor chains hold other values. ``meta["answers"]`` lists the variables.
    """
    if hops < 0 or num_chains < 1:
        raise ValueError(
            f"variable_tracking: need hops >= 0 and num_chains >= 1, got {hops}, {num_chains}"
        )
    rng = task_rng("variable_tracking", seed)
    names = var_names(rng, num_chains * (hops + 1))
    values = numbers(rng, num_chains, digits)
    needles: list[tuple[float, str]] = []
    for c in range(num_chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        facts = [f"VAR {chain[0]} = {values[c]}."]
        facts += [f"VAR {b} = VAR {a}." for a, b in pairwise(chain)]
        if c == 0:
            depths = sorted(needle_depths(depth, hops + 1, "variable_tracking"))
        else:
            depths = sorted(rng.random() for _ in facts)
        needles += zip(depths, facts, strict=True)
    return fit_multi(
        "variable_tracking",
        tokenizer,
        intro=(
            "Memorize and track the chain(s) of variable assignments hidden in the following text."
        ),
        question=(
            f"Find all variables that are assigned the value {values[0]} in the text, "
            f"directly or through other variables. List them in order of assignment, "
            f"separated by commas. {ANSWER_INSTRUCTION}"
        ),
        needles=needles,
        items=names[: hops + 1],
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
        chat_template_kwargs=chat_template_kwargs,
        tolerance=tolerance,
        id=id,
        meta={"value": values[0]},
    )
