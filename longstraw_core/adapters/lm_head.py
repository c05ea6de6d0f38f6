"""``score``'s LM head in row chunks: log-probabilities (and entropy) of the targets, with only
one chunk's logits alive, each chunk recomputed in backward when there are several.

Every distribution is taken at a ``temperature``: ``log_softmax(logits / temperature)``, as
TRL's GRPO scores the policy, the old and the reference policy at its sampling temperature.

``chunked_head_log_probs`` is what the adapters call: its chunks are sized by the budget
``HEAD_CHUNK_ELEMENTS`` (read when called: tests patch it, and the checkpoint and the chunk
function it passes to ``head_log_probs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# ``score`` runs the LM head in row chunks of at most this many logits (``[rows, vocab]``, at
# least one row): about 256 MB in float32, instead of ``[T, vocab]`` for the whole branch
# (2 GB per copy for 2048 tokens of a 248K vocabulary). Read when called (tests patch it).
HEAD_CHUNK_ELEMENTS = 1 << 26
HeadOutput = tuple[torch.Tensor, torch.Tensor | None]
# chunk(head, with_entropy, hidden rows, target rows, temperature) -> (log-probs, entropy)
ChunkFn = Callable[[nn.Module, bool, torch.Tensor, torch.Tensor, float], HeadOutput]


def rows_per_chunk(tokens: int, vocab: int, elements: int) -> int:
    """Rows per chunk of ``tokens`` rows of ``vocab`` logits: as few chunks as ``elements``
    logits a chunk allow (one row at least), of equal size but the last."""
    limit = max(1, elements // max(vocab, 1))
    chunks = max(1, -(-tokens // limit))
    return -(-tokens // chunks)


def head_width(head: nn.Module, hidden: torch.Tensor) -> int:
    """The number of logits ``head`` computes per row (its ``out_features``, or a probe's)."""
    out = getattr(head, "out_features", None)
    if isinstance(out, int):
        return out
    with torch.no_grad():
        return head(hidden[:1]).shape[-1]


def head_log_probs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    rows: int,
    chunk: ChunkFn | None = None,
    run_checkpointed: Callable[..., Any] = checkpoint,
    temperature: float = 1.0,
) -> HeadOutput:
    """``log p(targets[t])`` ``[T]`` from the final normed ``hidden`` ``[T, width]``, and the
    detached entropy of each distribution (``with_entropy``; else ``None``), both of the
    distribution at ``temperature`` (``log_softmax(logits / temperature)``).

    The logits ``[T, vocab]`` are computed ``rows`` rows at a time (``chunk``: ``head_chunk``
    unless given), so only one chunk's are alive. With autograd and more than one chunk, each
    chunk runs under non-reentrant ``run_checkpointed`` (``torch.utils.checkpoint``): its
    graph keeps only its input rows (views of ``hidden``) and backward recomputes its logits,
    one chunk at a time; a single chunk runs plainly (no recompute), as do chunks without
    autograd. The math is the unchunked one, row by row.
    """
    chunk = head_chunk if chunk is None else chunk
    if rows >= len(hidden):
        return chunk(head, with_entropy, hidden, targets, temperature)
    recompute = torch.is_grad_enabled()
    pieces = []
    for rows_hidden, rows_targets in zip(hidden.split(rows), targets.split(rows), strict=True):
        if recompute:
            piece = _checkpointed_chunk(
                chunk, run_checkpointed, head, with_entropy, rows_hidden, rows_targets, temperature
            )
            pieces.append(piece)
        else:
            pieces.append(chunk(head, with_entropy, rows_hidden, rows_targets, temperature))
    logps = torch.cat([logps for logps, _ in pieces])
    entropy = torch.cat([entropy for _, entropy in pieces]) if with_entropy else None
    return logps, entropy


def head_chunk(
    head: nn.Module,
    with_entropy: bool,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> HeadOutput:
    """One chunk of rows: ``log_softmax(logits / temperature)`` in
    ``promote_types(logits, float32)``, gathered at ``targets``; the entropy under
    ``no_grad``. The logits, their promoted copy and its division are temporaries, each freed
    once the next is made (never more than two ``[rows, vocab]`` float32 copies alive)."""
    log_probs = torch.log_softmax(_tempered(head(hidden), temperature), -1)
    logps = log_probs.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return logps, None
    with torch.no_grad():
        product = log_probs.exp()
        entropy = -product.mul_(log_probs).sum(-1)
    return logps, entropy


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in ``promote_types(logits, float32)`` (the division as the
    rollout's sampling makes it, so that on-policy ratios are 1); no copy at temperature 1."""
    promoted = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return promoted if temperature == 1.0 else promoted / temperature


def _checkpointed_chunk(
    chunk: ChunkFn,
    run_checkpointed: Callable[..., Any],
    head: nn.Module,
    with_entropy: bool,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> HeadOutput:
    """``chunk`` under non-reentrant checkpointing: backward recomputes the chunk's logits and
    ``log_softmax`` (not its entropy, which the first run returned)."""
    calls = 0

    def run(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        nonlocal calls
        calls += 1
        return chunk(head, with_entropy and calls == 1, hidden, targets, temperature)

    return run_checkpointed(run, hidden, targets, use_reentrant=False)


def head_rows(tokens: int, vocab: int) -> int:
    """Rows per chunk of ``score``'s LM head: as few chunks as ``HEAD_CHUNK_ELEMENTS``
    allows (one row at least), of equal size but the last."""
    return rows_per_chunk(tokens, vocab, HEAD_CHUNK_ELEMENTS)


def chunked_head_log_probs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``score``'s LM head over ``hidden`` ``[T, width]`` in ``head_rows`` row chunks
    (``head_log_probs``), with this module's chunk and checkpoint, at ``temperature``."""
    rows = head_rows(len(hidden), head_width(head, hidden))
    return head_log_probs(
        head, hidden, targets, with_entropy, rows, head_chunk, checkpoint, temperature
    )
