"""Ragged decoding against the transformers model's own full-sequence forward, for the
families' tests (``families/test_gpt_oss.py``, ``families/test_sliding_window.py``): one
check, so that every family is held to the same schedule and tolerance.

``SCHEDULE`` is ``tests/grpo/test_ragged_decode.py``'s: per step, how many tokens each of
three branches takes (0 sits out, several at once is a tool result); with a short window
the branches outgrow it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import longstraw_core as ls

SCHEDULE = [[1, 1, 1], [0, 3, 1], [2, 0, 1], [1, 1, 0], [3, 1, 2], [0, 0, 1]]


def assert_ragged_decode_matches_forward(
    model: torch.nn.Module, ids: Callable[[int, int], torch.Tensor]
) -> None:
    """Prefill a 30-token prompt (chunks of 8), decode ``SCHEDULE``'s ragged steps on three
    branches, and hold each branch's logits to the model's forward over prompt + branch
    (float64's 1e-9). ``ids(length, seed)``: the test's token ids."""
    adapter = ls.adapt(model)
    prompt = ids(30, 1)
    totals = [sum(step[row] for step in SCHEDULE) for row in range(3)]
    streams = [
        torch.cat([prompt[-1:], ids(total - 1, 10 + row)]) for row, total in enumerate(totals)
    ]
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=8)
        cache = adapter.new_branch_cache(state, batch=3, capacity=max(totals))
        done, logits_of = [0, 0, 0], [[] for _ in range(3)]
        for counts in SCHEDULE:
            inputs = torch.zeros(3, max(counts), dtype=torch.long)
            for row, count in enumerate(counts):
                inputs[row, :count] = streams[row][done[row] : done[row] + count]
            logits = adapter.decode(state, cache, inputs, counts=counts)
            for row, count in enumerate(counts):
                logits_of[row].append(logits[row, :count])
                done[row] += count
        for row in range(3):
            sequence = torch.cat([prompt[:-1], streams[row]])
            expected = model(input_ids=sequence[None]).logits[0][len(prompt) - 1 :]
            torch.testing.assert_close(torch.cat(logits_of[row]), expected, rtol=1e-9, atol=1e-9)
