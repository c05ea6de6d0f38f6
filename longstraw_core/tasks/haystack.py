"""The haystack and its length fitting: seeded filler sentences from a fixed word list, needles
placed at sentence boundaries at their depths, and ``fit_prompt``, which grows the filler
until the rendered prompt has the requested number of tokens. Knows nothing of the tasks."""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.tokenizer import Prompt, count_prompt_tokens

MAX_FIT_PASSES = 6


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


def fit_prompt(
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    intro: str,
    question: str,
    needles: Sequence[tuple[float, str]],
    prompt_tokens: int,
    seed: int,
    chat: bool,
    tolerance: float,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Prompt, int, list[float]]:
    """Grow the haystack until the rendered prompt has ``prompt_tokens`` tokens (+-tolerance).

    Each pass tokenizes the full prompt once and corrects the filler budget by the observed
    ratio of real to estimated filler tokens, so a tokenizer whose words do not add up
    exactly (merges across spaces, prefix-space quirks) still converges in a few passes.
    Returns the prompt, its token count and each needle's actual depth. The count is the
    recipe's: chat prompts rendered with ``chat_template_kwargs`` (``data.chat_template_kwargs``).
    """
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be a positive int, got {prompt_tokens!r}")
    hay = _Haystack(tokenizer, seed)

    def build(n_words: int) -> tuple[Prompt, list[float]]:
        body, depths = hay.text(n_words, needles)
        content = f"{intro}\n\n{body}\n\n{question}"
        return ([{"role": "user", "content": content}] if chat else content), depths

    empty, _ = build(0)
    base = count_prompt_tokens(tokenizer, empty, chat_template_kwargs)
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
        got = count_prompt_tokens(tokenizer, prompt, chat_template_kwargs)
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
