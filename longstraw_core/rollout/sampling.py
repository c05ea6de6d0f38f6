"""``rollout``'s sampling options: their checks, and transformers' logits processors in
``generate``'s order (the rollout module docstring says how a token is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter


def check_arguments(
    adapter: ModelAdapter,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_token_ids: Sequence[int] | int | None,
) -> list[int]:
    """Validate the sampling arguments; return the EOS ids as a list."""
    for name, value in (("num_generations", num_generations), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0: off), got {top_k!r}")
    if eos_token_ids is None:
        return []
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else [int(t) for t in eos_token_ids]
    bad = [t for t in eos if not 0 <= t < adapter.vocab_size]
    if bad:
        raise ValueError(
            f"eos_token_ids holds {bad[0]}, outside the model's vocabulary "
            f"[0, {adapter.vocab_size})"
        )
    return eos


def check_options(
    min_p: float,
    repetition_penalty: float,
    stop_strings: Sequence[str],
    tokenizer: PreTrainedTokenizerBase | None,
) -> None:
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0: off), got {min_p!r}")
    if not repetition_penalty > 0:  # also refuses NaN
        raise ValueError(f"repetition_penalty must be > 0 (1: off), got {repetition_penalty!r}")
    if isinstance(stop_strings, str):
        raise ValueError(f"stop_strings must be a list of strings, got the string {stop_strings!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=")
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)!r}")


def processors(
    temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float
) -> list[LogitsProcessor]:
    """transformers' logits processors in ``generate``'s order: the repetition penalty, then
    (only when sampling) the warpers."""
    processors: list[LogitsProcessor] = []
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    if temperature == 0:
        return processors
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        processors.append(MinPLogitsWarper(float(min_p)))
    return processors
