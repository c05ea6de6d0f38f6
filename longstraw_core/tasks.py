"""Synthetic long-context tasks in the spirit of RULER: verifiable, deterministic, any length.

Each generator builds one ``Sample`` whose prompt, rendered for the given tokenizer (through
its chat template when ``chat=True`` and it has one), is within ``tolerance`` (1%) of
``prompt_tokens`` tokens. The prompt is an instruction, a haystack of seeded filler sentences
from a fixed word list (no downloads, no digits, no capitals but a sentence's first letter,
so needles cannot be confused with filler) with the needle sentences inserted at sentence
boundaries at the requested depth (a fraction of the haystack's tokens, 0 = start, 1 = end),
and a question asking for the answer inside ``<answer></answer>`` tags.

    tok = load_tokenizer(None)
    s = passkey_retrieval(tok, prompt_tokens=16_384, depth=0.25, seed=7)
    stream = make_task_stream("kv_chain", tok, 131_072, seed=0, start=1000, hops=4)

Length fitting is cheap at a million tokens: the filler's token cost is estimated from the
per-word costs of its few hundred distinct word forms, then the whole prompt is tokenized
once per pass and the filler budget corrected; a few passes suffice.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import string
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.tokenizer import Prompt, count_prompt_tokens

ANSWER_INSTRUCTION = "Give only the answer, inside <answer></answer> tags."
MAX_FIT_PASSES = 6
Depth = float | Sequence[float]


@dataclass
class Sample:
    """One prompt with its reference answer.

    ``prompt`` is plain text or chat messages (``[{"role": ..., "content": ...}]``).
    ``answer`` is the canonical answer string; tasks with several required answers (all the
    values of a key, every variable of a chain) also list them in ``meta["answers"]``, which
    the ``contains`` reward scores as the fraction found.
    """

    id: str
    prompt: Prompt
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- filler text

# Lower-case, digit-free, and disjoint from every needle's wording and key words.
_FILLER_TEXT = """
    apple autumn basket beach bench bicycle bird blanket boat bottle branch bread bridge
    brook bucket butter cabin candle canyon carpet castle cattle cellar chair cherry chimney
    cloud clover coast cotton country cottage curtain daisy desert dinner doorway dream
    dust eagle earth evening fabric farmer feather fence field fire flower forest fountain
    garden gate glass grain grass gravel harbor harvest hill honey horizon horse island
    journey kettle kitchen ladder lake lamp lantern leaf letter library lighthouse linen
    market meadow melody mill mirror morning mountain music needle night ocean orchard
    painting palace paper path pebble pepper picture pillow pine planet pond porch quilt
    rabbit rain ribbon river road roof rope saddle sail sand season shadow shelf shore
    silver sky smoke snow song spring stable star stone storm stream street summer sun
    table teapot thunder timber tower town trail train tree tunnel valley village violin
    wagon wall water wave weather well wheat wheel willow wind window winter wool yard
    quietly slowly gently softly often always rarely warmly brightly calmly
    walks sings rests waits drifts glows grows shines falls rises turns wanders sleeps
    near under over beside behind across along through toward around
    the a an and but or of in on with from into upon
    old young green blue golden small tall wide narrow bright dark warm cold soft quiet
"""
FILLER_WORDS = tuple(_FILLER_TEXT.split())


class _Filler:
    """An endless, seeded stream of filler words grouped into sentences.

    Words are stored as their final form (capitalised first word, period after the last),
    so the text of words ``[i, j)`` is ``" ".join(words[i:j])``. ``boundaries`` holds the
    word indices where a sentence starts (0 included): the only places needles go.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"longstraw-filler:{seed}")
        self.words: list[str] = []
        self.boundaries: list[int] = [0]

    def ensure(self, n_words: int) -> None:
        rng, words = self._rng, self.words
        while len(words) < n_words:
            sentence = rng.choices(FILLER_WORDS, k=rng.randint(6, 14))
            sentence[0] = sentence[0].capitalize()
            sentence[-1] += "."
            words.extend(sentence)
            self.boundaries.append(len(words))


def _word_costs(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Tokens of ``" " + form`` for every form a filler word can take (one batched call)."""
    forms = [w for base in FILLER_WORDS for w in (base, base.capitalize())]
    forms += [w + "." for w in forms]
    ids = tokenizer([" " + f for f in forms], add_special_tokens=False)["input_ids"]
    return {f: len(i) for f, i in zip(forms, ids, strict=True)}


class _Haystack:
    """Filler words plus their cumulative estimated token cost, grown on demand."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
        self.filler = _Filler(seed)
        self._costs = _word_costs(tokenizer)
        self.cum: list[int] = [0]  # cum[i]: estimated tokens of the first i words

    def words_for(self, budget: float) -> int:
        """Word count whose estimated cost is closest to ``budget``."""
        while self.cum[-1] <= budget:
            start = len(self.filler.words)
            self.filler.ensure(start + 4096)
            new = (self._costs[w] for w in self.filler.words[start:])
            self.cum.extend(list(accumulate(new, initial=self.cum[-1]))[1:])
        if budget <= 0:
            return 0
        n = bisect.bisect_right(self.cum, budget) - 1  # cum[n] <= budget < cum[n + 1]
        return n if budget - self.cum[n] <= self.cum[n + 1] - budget else n + 1

    def boundary_near(self, n_words: int, depth: float) -> int:
        """Sentence boundary (word index <= n_words) whose cost is closest to depth * total."""
        goal = depth * self.cum[n_words]
        b = self.filler.boundaries
        hi = bisect.bisect_right(b, n_words)
        candidates = [*b[:hi], n_words]
        i = bisect.bisect_left(candidates, goal, key=lambda w: self.cum[w])
        near = candidates[max(0, i - 1) : i + 1]
        return min(near, key=lambda w: abs(self.cum[w] - goal))

    def text(self, n_words: int, needles: Sequence[tuple[float, str]]) -> tuple[str, list[float]]:
        """Haystack of ``n_words`` filler words with needles at their depths.

        Returns the text and each needle's actual depth (fraction of filler cost before it).
        """
        placed = sorted(
            ((self.boundary_near(n_words, d), k) for k, (d, _) in enumerate(needles)),
        )
        parts, pos = [], 0
        for at, k in placed:
            if at > pos:
                parts.append(" ".join(self.filler.words[pos:at]))
            parts.append(needles[k][1])
            pos = at
        if n_words > pos:
            parts.append(" ".join(self.filler.words[pos:n_words]))
        total = self.cum[n_words] or 1
        actual = [0.0] * len(needles)
        for at, k in placed:
            actual[k] = self.cum[at] / total
        return " ".join(parts), actual


# --------------------------------------------------------------------------- length fitting


def _fit_prompt(
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    intro: str,
    question: str,
    needles: Sequence[tuple[float, str]],
    prompt_tokens: int,
    seed: int,
    chat: bool,
    tolerance: float,
) -> tuple[Prompt, int, list[float]]:
    """Grow the haystack until the rendered prompt has ``prompt_tokens`` tokens (+-tolerance).

    Each pass tokenizes the full prompt once and corrects the filler budget by the observed
    ratio of real to estimated filler tokens, so a tokenizer whose words do not add up
    exactly (merges across spaces, prefix-space quirks) still converges in a few passes.
    Returns the prompt, its token count and each needle's actual depth.
    """
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be a positive int, got {prompt_tokens!r}")
    hay = _Haystack(tokenizer, seed)

    def build(n_words: int) -> tuple[Prompt, list[float]]:
        body, depths = hay.text(n_words, needles)
        content = f"{intro}\n\n{body}\n\n{question}"
        return ([{"role": "user", "content": content}] if chat else content), depths

    empty, _ = build(0)
    base = count_prompt_tokens(tokenizer, empty)
    if base > prompt_tokens * (1 + tolerance):
        raise ValueError(
            f"{task}: prompt_tokens={prompt_tokens} is too small; the instruction, needles and "
            f"question alone take {base} tokens with this tokenizer"
        )
    budget, rate = float(prompt_tokens - base), 1.0
    best: tuple[int, Prompt, list[float]] | None = None
    tried: set[int] = set()
    for _ in range(MAX_FIT_PASSES):
        n_words = hay.words_for(budget)
        if n_words in tried:
            break  # the remaining error is below one filler word
        tried.add(n_words)
        prompt, depths = build(n_words)
        got = count_prompt_tokens(tokenizer, prompt)
        if best is None or abs(got - prompt_tokens) < abs(best[0] - prompt_tokens):
            best = (got, prompt, depths)
        if got == prompt_tokens:
            break
        if hay.cum[n_words] > 0 and got > base:
            rate = (got - base) / hay.cum[n_words]
        budget += (prompt_tokens - got) / rate
    assert best is not None
    got, prompt, depths = best
    if abs(got - prompt_tokens) > tolerance * prompt_tokens:
        raise RuntimeError(
            f"{task}: could not fit the prompt to {prompt_tokens} tokens (+-{tolerance:.1%}); "
            f"best was {got} tokens with {type(tokenizer).__name__} {tokenizer.name_or_path!r}"
        )
    return prompt, got, depths


# --------------------------------------------------------------------------- helpers

# Words for keys; none of them occurs in the filler.
_KEY_TEXT = """
    amber azure cobalt coral crimson ebony indigo ivory jade lilac magenta maroon ochre olive
    scarlet sepia teal umber violet fuchsia badger beaver bison falcon ferret gecko heron
    jackal lemur lynx marmot narwhal ocelot otter panda puffin quokka raven salmon tapir
    walrus weasel wombat yak zebra condor dingo ibis koala
"""
KEY_WORDS = tuple(_KEY_TEXT.split())


def _task_rng(task: str, seed: int) -> random.Random:
    return random.Random(f"longstraw-task:{task}:{seed}")


def _depths(depth: Depth | None, n: int, task: str) -> list[float]:
    """One depth per needle: a float repeats, a sequence must have one per needle,
    ``None`` spreads them evenly from 0 to 1."""
    if depth is None:
        out = [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
    elif isinstance(depth, (int, float)):
        out = [float(depth)] * n
    else:
        out = [float(d) for d in depth]
        if len(out) != n:
            raise ValueError(f"{task}: depth has {len(out)} entries, expected {n} (one per needle)")
    for d in out:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"{task}: depth must be in [0, 1], got {d}")
    return out


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct two-word keys such as ``"teal-otter"``."""
    pairs = [f"{a}-{b}" for a in KEY_WORDS for b in KEY_WORDS if a != b]
    return rng.sample(pairs, n)


def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` distinct numbers with exactly ``digits`` digits."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    lo = 10 ** (digits - 1) if digits > 1 else 0
    return [str(v) for v in rng.sample(range(lo, 10**digits), n)]


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    return rng.sample(sorted(names), n)


def _make_sample(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    intro: str,
    question: str,
    needles: Sequence[tuple[float, str]],
    answer: str,
    prompt_tokens: int,
    depth: Depth | None,
    seed: int,
    chat: bool,
    tolerance: float,
    id: str | None,
    meta: dict[str, Any],
) -> Sample:
    prompt, got, actual = _fit_prompt(
        tokenizer, task, intro, question, needles, prompt_tokens, seed, chat, tolerance
    )
    meta = {
        "task": task,
        "seed": seed,
        "depth": depth if depth is None or isinstance(depth, (int, float)) else list(depth),
        "needle_depths": actual,
        "prompt_tokens": got,
        "target_tokens": prompt_tokens,
        **meta,
    }
    return Sample(id=id or f"{task}:{seed}", prompt=prompt, answer=answer, meta=meta)


def _in_order(items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Items in the order their needles appear (ties keep list order, as placement does)."""
    return [items[k] for k in sorted(range(len(items)), key=lambda k: (depths[k], k))]


# --------------------------------------------------------------------------- generators


def passkey_retrieval(
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    digits: int = 5,
    chat: bool = True,
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's single needle: one pass key in the haystack; the answer is the number."""
    rng = _task_rng("passkey_retrieval", seed)
    (key,) = _numbers(rng, 1, digits)
    return _make_sample(
        "passkey_retrieval",
        tokenizer,
        intro=(
            "There is an important piece of information hidden inside a lot of irrelevant "
            "text. Find it and memorize it. I will quiz you about it."
        ),
        question=f"What is the pass key? {ANSWER_INSTRUCTION}",
        needles=[(_depths(depth, 1, "passkey_retrieval")[0], _passkey_needle(key))],
        answer=key,
        prompt_tokens=prompt_tokens,
        depth=depth,
        seed=seed,
        chat=chat,
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
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's multi-key needle with UUID values: find the UUID of one key among several.

    The queried needle goes at ``depth``; distractors (other keys) at seeded random depths.
    """
    rng = _task_rng("uuid_retrieval", seed)
    keys = _keys(rng, 1 + num_distractors)
    uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in keys]
    depths = _depths(depth, 1, "uuid_retrieval") + [rng.random() for _ in keys[1:]]
    needles = [
        (d, f"The special magic uuid for {k} is: {u}.")
        for d, k, u in zip(depths, keys, uuids, strict=True)
    ]
    return _make_sample(
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
    tolerance: float = 0.01,
    id: str | None = None,
) -> Sample:
    """RULER's multi-value needle: every number given for one key, in order of appearance.

    ``depth``: one float for all needles, one per needle, or ``None`` to spread them evenly.
    Distractor needles carry other keys. ``meta["answers"]`` lists the values.
    """
    if num_needles < 1:
        raise ValueError(f"multi_needle: num_needles must be >= 1, got {num_needles}")
    rng = _task_rng("multi_needle", seed)
    key, *others = _keys(rng, 1 + num_distractors)
    values = _numbers(rng, num_needles + num_distractors, digits)
    depths = _depths(depth, num_needles, "multi_needle")
    depths += [rng.random() for _ in others]
    owners = [key] * num_needles + others
    needles = [
        (d, f"One of the special magic numbers for {k} is: {v}.")
        for d, k, v in zip(depths, owners, values, strict=True)
    ]
    return _fit_multi(
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
        tolerance=tolerance,
        id=id,
        meta={"key": key, "distractor_keys": others},
    )


def _fit_multi(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    needles: Sequence[tuple[float, str]],
    items: Sequence[str],
    **kw: Any,
) -> Sample:
    """A sample whose answer is ``items`` (the first needles) joined in order of appearance."""
    sample = _make_sample(task, tokenizer, needles=needles, answer="", **kw)
    answers = _in_order(items, sample.meta["needle_depths"][: len(items)])
    sample.answer = ", ".join(answers)
    sample.meta["answers"] = answers
    return sample


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
    rng = _task_rng("kv_chain", seed)
    n_chains = 1 + num_distractor_chains
    keys = _keys(rng, n_chains * (hops + 1))
    values = _numbers(rng, n_chains, digits)
    needles: list[tuple[float, str]] = []
    for c in range(n_chains):
        chain = keys[c * (hops + 1) : (c + 1) * (hops + 1)]
        facts = [f"The key {a} points to the key {b}." for a, b in pairwise(chain)]
        facts.append(f"The key {chain[-1]} holds the value {values[c]}.")
        mine = c == 0
        depths = _depths(depth, hops + 1, "kv_chain") if mine else [rng.random() for _ in facts]
        rng.shuffle(facts)  # same-depth facts appear in this order: not the chain's
        needles += zip(depths, facts, strict=True)
    return _make_sample(
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
    rng = _task_rng("variable_tracking", seed)
    names = _var_names(rng, num_chains * (hops + 1))
    values = _numbers(rng, num_chains, digits)
    needles: list[tuple[float, str]] = []
    for c in range(num_chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        facts = [f"VAR {chain[0]} = {values[c]}."]
        facts += [f"VAR {b} = VAR {a}." for a, b in pairwise(chain)]
        if c == 0:
            depths = sorted(_depths(depth, hops + 1, "variable_tracking"))
        else:
            depths = sorted(rng.random() for _ in facts)
        needles += zip(depths, facts, strict=True)
    return _fit_multi(
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
        tolerance=tolerance,
        id=id,
        meta={"value": values[0]},
    )


# --------------------------------------------------------------------------- registry, streams

TaskFn = Callable[..., Sample]
TASKS: dict[str, TaskFn] = {
    "passkey_retrieval": passkey_retrieval,
    "uuid_retrieval": uuid_retrieval,
    "multi_needle": multi_needle,
    "kv_chain": kv_chain,
    "variable_tracking": variable_tracking,
}


def _derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts; stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_at(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    seed: int,
    index: int,
    *,
    depth: Depth | None = None,
    **kw: Any,
) -> Sample:
    """Sample ``index`` of the stream ``(name, seed)``: the same whatever came before.

    Without ``depth`` each sample draws its own uniform depth from its seed.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    sample_seed = _derive_seed("stream", name, seed, index)
    if depth is None:
        depth = random.Random(sample_seed).random()
    sample = TASKS[name](
        tokenizer, prompt_tokens, depth=depth, seed=sample_seed, id=f"{name}:{seed}:{index}", **kw
    )
    sample.meta["index"] = index
    return sample


def make_task_stream(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    seed: int = 0,
    *,
    start: int = 0,
    **kw: Any,
) -> Iterator[Sample]:
    """Endless deterministic stream; ``start`` resumes at a data position (see ``sample_at``)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    index = start
    while True:
        yield sample_at(name, tokenizer, prompt_tokens, seed, index, **kw)
        index += 1
