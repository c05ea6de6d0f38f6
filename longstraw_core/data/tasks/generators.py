"""The task families, one draft each (RULER's passkey, multi-key UUID and multi-value
needles, multi-hop key-value chains, variable tracking; a lookup in real documents): each
picks its needles, question and answer from its seed; ``sample.task_generator`` makes it a
generator. A new family is one function here and one entry in ``streams.TASKS``."""

from __future__ import annotations

import functools
import random
import uuid
from collections.abc import Sequence
from itertools import pairwise

from longstraw_core.data.tasks.documents import SPLITS, DocumentFiller
from longstraw_core.data.tasks.sample import (
    Depth,
    Draft,
    needle_depths,
    numbers,
    task_generator,
    two_word_keys,
    var_names,
)


@task_generator
def passkey_retrieval(rng: random.Random, depth: float = 0.5, *, digits: int = 5) -> Draft:
    """RULER's single needle: one pass key in the haystack; the answer is the number."""
    (key,) = numbers(rng, 1, digits)
    return Draft(
        intro=(
            "There is an important piece of information hidden inside a lot of irrelevant "
            "text. Find it and memorize it. I will quiz you about it."
        ),
        question="What is the pass key?",
        needles=[(needle_depths(depth, 1, "passkey_retrieval")[0], _passkey_needle(key))],
        answer=key,
    )


def _passkey_needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


@task_generator
def uuid_retrieval(rng: random.Random, depth: float = 0.5, *, num_distractors: int = 3) -> Draft:
    """RULER's multi-key needle with UUID values: find the UUID of one key among several.

    The queried needle goes at ``depth``; distractors (other keys) at seeded random depths.
    """
    keys = two_word_keys(rng, 1 + num_distractors)
    uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in keys]
    depths = needle_depths(depth, 1, "uuid_retrieval") + [rng.random() for _ in keys[1:]]
    needles = [
        (d, f"The special magic uuid for {k} is: {u}.")
        for d, k, u in zip(depths, keys, uuids, strict=True)
    ]
    return Draft(
        intro=_magic_intro("uuids"),
        question=f"What is the special magic uuid for {keys[0]} mentioned in the text?",
        needles=needles,
        answer=uuids[0],
        meta={"key": keys[0], "distractor_keys": keys[1:]},
    )


def _magic_intro(things: str) -> str:
    """RULER's instruction for its "special magic" needles (uuids, numbers)."""
    return (
        f"Some special magic {things} are hidden within the following text. Make sure to "
        f"memorize them. I will quiz you about the {things} afterwards."
    )


@task_generator
def multi_needle(
    rng: random.Random,
    depth: Depth | None = None,
    *,
    num_needles: int = 4,
    num_distractors: int = 2,
    digits: int = 7,
) -> Draft:
    """RULER's multi-value needle: every number given for one key, in order of appearance.

    ``depth``: one float for all needles, one per needle, or ``None`` to spread them evenly.
    Distractor needles carry other keys. ``meta["answers"]`` lists the values.
    """
    if num_needles < 1:
        raise ValueError(f"multi_needle: num_needles must be >= 1, got {num_needles}")
    key, *others = two_word_keys(rng, 1 + num_distractors)
    values = numbers(rng, num_needles + num_distractors, digits)
    depths = needle_depths(depth, num_needles, "multi_needle")
    depths += [rng.random() for _ in others]
    owners = [key] * num_needles + others
    needles = [
        (d, f"One of the special magic numbers for {k} is: {v}.")
        for d, k, v in zip(depths, owners, values, strict=True)
    ]
    return Draft(
        intro=_magic_intro("numbers"),
        question=(
            f"What are all the special magic numbers for {key} mentioned in the text? List "
            "them in order of appearance, separated by commas."
        ),
        needles=needles,
        items=values[:num_needles],
        meta={"key": key, "distractor_keys": others},
    )


@task_generator
def kv_chain(
    rng: random.Random,
    depth: Depth = 0.5,
    *,
    hops: int = 3,
    num_distractor_chains: int = 2,
    digits: int = 6,
) -> Draft:
    """Multi-hop key-value lookup: start at a key, follow ``hops`` pointers, report the value.

    The chain's ``hops + 1`` facts sit at ``depth`` (one float: together, in shuffled order;
    or one depth per fact in chain order). Distractor chains of the same shape use other
    keys and values, at seeded random depths.
    """
    if hops < 1:
        raise ValueError(f"kv_chain: hops must be >= 1, got {hops}")
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
    return Draft(
        intro=(
            "The following text hides facts about keys: some keys point to other keys, and "
            "some keys hold values. Memorize them. I will quiz you about them afterwards."
        ),
        question=(
            f"Start at the key {keys[0]} and follow the keys it points to, one after "
            "another. What value does the last key hold?"
        ),
        needles=needles,
        answer=values[0],
        meta={"hops": hops, "chain": keys[: hops + 1]},
    )


@task_generator
def variable_tracking(
    rng: random.Random, depth: Depth = 0.5, *, hops: int = 4, num_chains: int = 2, digits: int = 5
) -> Draft:
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
    return Draft(
        intro=(
            "Memorize and track the chain(s) of variable assignments hidden in the following text."
        ),
        question=(
            f"Find all variables that are assigned the value {values[0]} in the text, "
            "directly or through other variables. List them in order of assignment, "
            "separated by commas."
        ),
        needles=needles,
        items=names[: hops + 1],
        meta={"value": values[0]},
    )


# The notes ``doc_lookup`` hides in the documents, per kind of value: the question asking for
# the value and the note's sentence, filled with a subject (the first of the kind's
# ``_DOC_SUBJECTS`` drawn; others for distractors) and then the value.
_DOC_NOTES = {
    "name": (
        "What is the name of the archivist who {} this reference?",
        "The archivist who {} this reference is named {}.",
    ),
    "number": (
        "What is the {} of this reference?",
        "The {} of this reference is {}.",
    ),
    "colour": (
        "What colour is the {} in the reading room?",
        "The {} in the reading room is {}.",
    ),
}
# The question kinds: a note's value, or (``quote``) a note's whole sentence.
DOC_KINDS = (*_DOC_NOTES, "quote")
_DOC_SUBJECTS = {
    "name": ("catalogued", "indexed", "proofread", "translated", "restored", "bound"),
    "number": (
        "catalogue number", "shelf number", "accession number", "box number", "drawer number",
    ),
    "colour": ("umbrella", "kettle", "notebook", "scarf", "teapot", "armchair", "bicycle"),
}  # fmt: skip
_FIRST_NAMES = (
    "Ilse", "Tomas", "Marta", "Oskar", "Ingrid", "Pavel", "Greta", "Anton", "Lena", "Milan",
    "Sofia", "Viktor", "Nadia", "Emil", "Rosa", "Jonas",
)  # fmt: skip
_SURNAMES = (
    "Varga", "Lindqvist", "Novak", "Brennan", "Okafor", "Castell", "Moreau", "Halloran",
    "Petrov", "Sato", "Duarte", "Whitlock", "Kowalski", "Ferreira", "Nakamura", "Albescu",
)  # fmt: skip
_SHADES = ("pale", "deep", "bright", "dark", "light")
_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "grey", "pink")


@task_generator
def doc_lookup(
    rng: random.Random,
    depth: float = 0.5,
    *,
    split: str = "train",
    kinds: Sequence[str] = DOC_KINDS,
    num_distractors: int = 0,
    digits: int = 5,
) -> Draft:
    """A note hidden in real text: the Python standard library's reference
    (``documents``), with one note about the reference at ``depth``. The question asks for
    its value: a person's name (two words), a number, or a colour (two words); or, kind
    ``quote``, for the note's whole sentence (a note of any of the three). The kind is drawn
    from ``kinds`` (a list, or one kind's name).

    ``split``: ``"train"``, or ``"heldout"`` for documents from the modules no training
    sample reads. ``num_distractors`` more notes of the same kind (other subjects, other
    values) go at seeded random depths.
    """
    if split not in SPLITS:
        raise ValueError(f"doc_lookup: split must be one of {', '.join(SPLITS)}, got {split!r}")
    chosen = sorted({kinds} if isinstance(kinds, str) else set(kinds))
    if not chosen or not set(chosen) <= set(DOC_KINDS):
        raise ValueError(f"doc_lookup: kinds must be some of {', '.join(DOC_KINDS)}, got {kinds!r}")
    kind = rng.choice(chosen)
    note = rng.choice(sorted(_DOC_NOTES)) if kind == "quote" else kind
    n = 1 + num_distractors
    if not 0 <= num_distractors < len(_DOC_SUBJECTS[note]):
        raise ValueError(
            f"doc_lookup: num_distractors must be in [0, {len(_DOC_SUBJECTS[note]) - 1}] for "
            f"{note} notes, got {num_distractors}"
        )
    subjects = rng.sample(_DOC_SUBJECTS[note], n)
    if note == "number":
        values = numbers(rng, n, digits)
    else:
        first, second = (_FIRST_NAMES, _SURNAMES) if note == "name" else (_SHADES, _COLOURS)
        values = rng.sample([f"{a} {b}" for a in first for b in second], n)
    question, sentence = _DOC_NOTES[note]
    sentences = [sentence.format(s, v) for s, v in zip(subjects, values, strict=True)]
    if kind == "quote":
        question += " Answer with the sentence of the text that says it, word for word."
    depths = needle_depths(depth, 1, "doc_lookup") + [rng.random() for _ in subjects[1:]]
    notes = "A note about the reference itself is" if n == 1 else "Notes about the reference are"
    return Draft(
        intro=(
            "Below is an excerpt of the Python standard library's reference documentation. "
            f"{notes} hidden in it. Read it carefully: I will ask you about it."
        ),
        question=question.format(subjects[0]),
        needles=list(zip(depths, sentences, strict=True)),
        answer=sentences[0] if kind == "quote" else values[0],
        meta={"kind": kind, "note": note, "split": split, "subject": subjects[0]},
        filler=functools.partial(DocumentFiller, split=split),
    )
