"""The haystack and its length fitting: a filler text (``Filler``: seeded sentences from a
fixed word list, ``WordFiller``, by default; real text such as ``documents.DocumentFiller``),
needles placed at its boundaries (sentences, paragraphs) at their depths, and ``fit_prompt``,
which grows the filler until the rendered prompt has the requested number of tokens. Knows
nothing of the tasks."""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from longstraw_core.data.tokenizer import Prompt, count_prompt_tokens

MAX_FIT_PASSES = 6
# A fit is accepted within ``tolerance`` of the target or this many tokens, the larger: a
# piece of real text (``documents.DocumentFiller``) can be several tokens, and at a few hundred
# tokens 1% is less than one piece (SmolLM2 on a 256-token doc_lookup prompt: 253 at best).
MIN_SLACK_TOKENS = 4


def longest_prompt(prompt_tokens: int, tolerance: float) -> int:
    """The most tokens ``fit_prompt`` may return for ``prompt_tokens`` (what a run's positions
    must hold)."""
    return max(math.ceil(prompt_tokens * (1 + tolerance)), prompt_tokens + MIN_SLACK_TOKENS)


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


class Filler(Protocol):
    """An endless text cut into pieces, which the haystack takes a prefix of.

    Each piece carries the whitespace before it (``" Word"``, ``"\n\nWord"``), so the text
    of pieces ``[i, j)`` is ``"".join(pieces[i:j])``, and a piece's token cost can be
    estimated alone. ``boundaries``: the piece indices where a needle may go (0 included,
    increasing): a needle placed at ``b`` takes the whitespace of piece ``b`` before it (a
    paragraph's blank line, a sentence's space); placed after the last piece, ``separator``.
    ``ensure(n)`` grows the text to at least ``n`` pieces.
    """

    pieces: list[str]
    boundaries: list[int]
    separator: str

    def ensure(self, n_pieces: int) -> None: ...


class WordFiller:
    """An endless, seeded stream of filler words grouped into sentences (``FILLER_WORDS``).

    Words are stored as their final form (capitalised first word, period after the last)
    after a space; a sentence's first word is a boundary.
    """

    separator = " "

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"longstraw-filler:{seed}")
        self.pieces: list[str] = []
        self.boundaries: list[int] = [0]

    def ensure(self, n_pieces: int) -> None:
        rng, pieces = self._rng, self.pieces
        while len(pieces) < n_pieces:
            sentence = rng.choices(FILLER_WORDS, k=rng.randint(6, 14))
            sentence[0] = sentence[0].capitalize()
            sentence[-1] += "."
            pieces.extend(" " + w for w in sentence)
            self.boundaries.append(len(pieces))


class _Haystack:
    """A filler's pieces plus their cumulative estimated token cost, grown on demand.

    A piece's cost is its own token count (one batched call per growth for the pieces not
    seen before): the few hundred forms of the word filler, a few thousand words of text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, filler: Filler) -> None:
        self.filler = filler
        self._tokenizer = tokenizer
        self._costs: dict[str, int] = {}
        self.cum: list[int] = [0]  # cum[i]: estimated tokens of the first i pieces

    def _grow(self) -> None:
        start = len(self.filler.pieces)
        self.filler.ensure(start + 4096)
        new = self.filler.pieces[start:]
        unseen = sorted(set(new) - self._costs.keys())
        if unseen:
            ids = self._tokenizer(unseen, add_special_tokens=False)["input_ids"]
            self._costs.update((p, len(i)) for p, i in zip(unseen, ids, strict=True))
        self.cum.extend(list(accumulate((self._costs[p] for p in new), initial=self.cum[-1]))[1:])

    def pieces_for(self, budget: float) -> int:
        """Piece count whose estimated cost is closest to ``budget``."""
        while self.cum[-1] <= budget:
            self._grow()
        if budget <= 0:
            return 0
        n = bisect.bisect_right(self.cum, budget) - 1  # cum[n] <= budget < cum[n + 1]
        return n if budget - self.cum[n] <= self.cum[n + 1] - budget else n + 1

    def boundary_near(self, n_pieces: int, depth: float) -> int:
        """Boundary (piece index <= n_pieces) whose cost is closest to depth * total."""
        goal = depth * self.cum[n_pieces]
        b = self.filler.boundaries
        hi = bisect.bisect_right(b, n_pieces)
        candidates = [*b[:hi], n_pieces]
        i = bisect.bisect_left(candidates, goal, key=lambda w: self.cum[w])
        near = candidates[max(0, i - 1) : i + 1]
        return min(near, key=lambda w: abs(self.cum[w] - goal))

    def text(self, n_pieces: int, needles: Sequence[tuple[float, str]]) -> tuple[str, list[float]]:
        """Haystack of the first ``n_pieces`` pieces with needles at their depths.

        Returns the text and each needle's actual depth (fraction of filler cost before it).
        """
        placed = sorted(
            ((self.boundary_near(n_pieces, d), k) for k, (d, _) in enumerate(needles)),
        )
        pieces = self.filler.pieces
        parts, pos = [], 0
        for at, k in placed:
            parts.extend(pieces[pos:at])
            parts.append(_space_before(pieces[at]) if at < n_pieces else self.filler.separator)
            parts.append(needles[k][1])
            pos = at
        parts.extend(pieces[pos:n_pieces])
        total = self.cum[n_pieces] or 1
        actual = [0.0] * len(needles)
        for at, k in placed:
            actual[k] = self.cum[at] / total
        return "".join(parts).lstrip(), actual


def _space_before(piece: str) -> str:
    return piece[: len(piece) - len(piece.lstrip())]


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
    filler: Callable[[int], Filler] = WordFiller,
) -> tuple[Prompt, int, list[float]]:
    """Grow the haystack until the rendered prompt has ``prompt_tokens`` tokens (+-tolerance,
    or +-``MIN_SLACK_TOKENS`` where that is more).

    Each pass tokenizes the full prompt once and corrects the filler budget by the observed
    ratio of real to estimated filler tokens, so a tokenizer whose words do not add up
    exactly (merges across spaces, prefix-space quirks) still converges in a few passes.
    Returns the prompt, its token count and each needle's actual depth. The count is the
    recipe's: chat prompts rendered with ``chat_template_kwargs`` (``data.chat_template_kwargs``).
    ``filler(seed)`` makes the text the needles go into: seeded filler words by default.
    """
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be a positive int, got {prompt_tokens!r}")
    hay = _Haystack(tokenizer, filler(seed))

    def build(n_pieces: int) -> tuple[Prompt, list[float]]:
        body, depths = hay.text(n_pieces, needles)
        content = f"{intro}\n\n{body}\n\n{question}"
        return ([{"role": "user", "content": content}] if chat else content), depths

    empty, _ = build(0)
    base = count_prompt_tokens(tokenizer, empty, chat_template_kwargs)
    slack = max(tolerance * prompt_tokens, MIN_SLACK_TOKENS)
    if base > prompt_tokens + slack:
        raise ValueError(
            f"{task}: prompt_tokens={prompt_tokens} is too small; the instruction, needles and "
            f"question alone take {base} tokens with this tokenizer"
        )
    budget, rate = float(prompt_tokens - base), 1.0
    best: tuple[int, Prompt, list[float]] | None = None
    tried: set[int] = set()
    for _ in range(MAX_FIT_PASSES):
        n_pieces = hay.pieces_for(budget)
        if n_pieces in tried:
            break  # the remaining error is below one filler word
        tried.add(n_pieces)
        prompt, depths = build(n_pieces)
        got = count_prompt_tokens(tokenizer, prompt, chat_template_kwargs)
        if best is None or abs(got - prompt_tokens) < abs(best[0] - prompt_tokens):
            best = (got, prompt, depths)
        if got == prompt_tokens:
            break
        if hay.cum[n_pieces] > 0 and got > base:
            rate = (got - base) / hay.cum[n_pieces]
        budget += (prompt_tokens - got) / rate
    assert best is not None
    got, prompt, depths = best
    if abs(got - prompt_tokens) > slack:
        raise RuntimeError(
            f"{task}: could not fit the prompt to {prompt_tokens} tokens (+-{tolerance:.1%} or "
            f"+-{MIN_SLACK_TOKENS} tokens); "
            f"best was {got} tokens with {type(tokenizer).__name__} {tokenizer.name_or_path!r}"
        )
    return prompt, got, depths
