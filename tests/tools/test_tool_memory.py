"""Replay memory of agent branches (issue 27): flat in the number of tool calls.

A branch that called tools is its model turns and the tools' results, one token sequence;
the results are scored (the next turn reads them) but masked out of the loss. So replay's
peak memory (``LiveTensorMemory``: every live tensor storage) depends on the branch's length
alone: a G-branch group of a given length has the same peak whether its branches made 0, 1,
3 or 6 tool calls (loss masks with that many 0-spans), while 32 tokens more (what a tool
result adds) raise it, which shows the measure sees such differences. Exact gradients
through the prompt (the sweep) included, on the hybrid DeltaNet family and the dense one.
"""

from __future__ import annotations

import pytest
import torch

import longstraw_core as ls
from longstraw_core.models.tiny import tiny_model
from longstraw_core.tensors.memory import LiveTensorMemory

G, PROMPT, BRANCH, RESULT = 4, 64, 192, 24  # branch tokens, a tool result's tokens


def _ids(length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def tool_masks(calls: int, length: int) -> list[torch.Tensor]:
    """Each branch's loss mask with ``calls`` tool results (0-spans of ``RESULT`` tokens)
    spread over it, the model's turns (1) between them."""
    mask = torch.ones(length, dtype=torch.long)
    for i in range(calls):
        start = (i + 1) * length // (calls + 1) - RESULT // 2
        mask[start : start + RESULT] = 0
    return [mask.clone() for _ in range(G)]


def replay_peak(adapter, prompt, length: int, calls: int) -> int:
    """grpo_step's peak above what was live before (the prefix state included)."""
    vocab = adapter.model.config.vocab_size
    responses = [_ids(length, 10 + i, vocab) for i in range(G)]
    config = ls.GRPOConfig(loss_type="dapo", gradient="exact")
    with LiveTensorMemory() as memory:
        state = adapter.prefill(prompt, chunk_size=32, **config.prefill_options())
        before = memory.current
        ls.grpo_step(
            adapter, prompt, responses, [1.0, 0.0, 0.5, 0.25], config=config, state=state,
            chunk_size=32, loss_masks=tool_masks(calls, length),
        )  # fmt: skip
        peak = memory.peak - before
        del state
    adapter.model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_replay_peak_is_flat_in_tool_calls_beyond_their_tokens(model_type):
    torch.manual_seed(0)
    model = tiny_model(model_type, seed=1)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT, 0, model.config.vocab_size)
    peaks = {calls: replay_peak(adapter, prompt, BRANCH, calls) for calls in (0, 1, 3, 6)}
    longer = replay_peak(adapter, prompt, BRANCH + 32, 0)
    mask_bytes = G * BRANCH * 8  # the masks themselves (int64), all a tool call may add
    assert max(peaks.values()) - min(peaks.values()) <= mask_bytes, peaks
    assert longer - peaks[0] > 4 * mask_bytes, (longer, peaks)  # tokens do cost memory
