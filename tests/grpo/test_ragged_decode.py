"""Ragged decode steps (``decode(..., counts=)``): branches of one batch at their own
positions, some sitting a step out, some taking several tokens at once (an agent's tool
result), give each branch the logits the model's own full-sequence forward gives it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from dispatch_probes import RecordIndexScores, assert_no_ties_at_k
from float64_internals import Float64Internals

import longstraw_core as ls
from longstraw_core.models.tiny import tiny_model

VOCAB = 512
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_5_text": ("qwen3_5_text", {}),
    # Eager experts: the MoE's grouped matmul has no float64 kernel on CPU.
    "glm_dense": ("glm_moe_dsa", {"index_topk": 4096, "experts_implementation": "eager"}),
    "glm_sparse": ("glm_moe_dsa", {"index_topk": 6, "experts_implementation": "eager"}),
    # Queries see 30 to 36 positions: in some steps one row's queries see more than top-k,
    # another's fewer (they attend to all they see), or only a waiting row's padding does.
    "glm_straddling": ("glm_moe_dsa", {"index_topk": 33, "experts_implementation": "eager"}),
}
# transformers computes the gated delta rule and its RMSNorms in float32 whatever the model's
# dtype, with the chunked kernel over the reference's whole sequence and the step kernel for
# decoded tokens: lock-step decoding one token at a time is as far from the full-sequence
# forward as these ragged steps are (both 1.7e-5 here), while ragged and lock-step decoding
# agree to 2e-15 (float32 round-off at worst, tests/families/test_qwen36_adapter.py).
LOGITS_ATOL = {"qwen3_5_text": 3e-5}
# GLM's MoE router computes in float32 even in a float64 model (~1e-7 on both sides, whatever
# the mechanism): both sides run its casts in float64, so 1e-9 shows float64 round-off.
FLOAT32_ISLANDS = {"glm_moe_dsa"}
# Per step, how many tokens each of the three branches takes: 0 sits out (a tool runs),
# several at once is a tool result prefilled in one pass.
SCHEDULE = [[1, 1, 1], [0, 3, 1], [2, 0, 1], [1, 1, 0], [3, 1, 2], [0, 0, 1]]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _step(adapter, state, cache, inputs, counts, narrow: bool) -> torch.Tensor:
    """One ragged step; with ``narrow``, each branch taking several inputs runs alone on
    its narrowed cache (as rollout prefills an answer) and the others in one batch."""
    if not narrow:
        return adapter.decode(state, cache, inputs, counts=counts)
    logits = torch.zeros(*inputs.shape, adapter.vocab_size, dtype=torch.float64)
    alone = [row for row, count in enumerate(counts) if count > 1]
    for row in alone:
        part = cache.narrow(row, row + 1)
        count = counts[row]
        logits[row, :count] = adapter.decode(
            state, part, inputs[row : row + 1, :count], counts=[count]
        )[0]
    rest = [0 if row in alone else count for row, count in enumerate(counts)]
    if any(rest):
        step = adapter.decode(state, cache, inputs[:, :1], counts=rest)
        for row, count in enumerate(rest):
            logits[row, :count] = step[row, :count]
    return logits


@pytest.mark.parametrize("narrow", [False, True], ids=["batched", "narrowed"])
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_steps_equal_the_full_sequence_forward(case: str, narrow: bool) -> None:
    model_type, overrides = CASES[case]
    model = tiny_model(model_type, **overrides).double()
    adapter = ls.adapt(model)
    prompt = _ids(30, 1)
    totals = [sum(step[row] for step in SCHEDULE) for row in range(3)]
    streams = [
        torch.cat([prompt[-1:], _ids(total - 1, 10 + row)]) for row, total in enumerate(totals)
    ]
    internals = Float64Internals() if model_type in FLOAT32_ISLANDS else contextlib.nullcontext()
    with internals, torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=8)
        cache = adapter.new_branch_cache(state, batch=3, capacity=max(totals))
        done, logits_of = [0, 0, 0], [[] for _ in range(3)]
        for counts in SCHEDULE:
            width = max(counts)
            inputs = torch.zeros(3, width, dtype=torch.long)
            for row, count in enumerate(counts):
                inputs[row, :count] = streams[row][done[row] : done[row] + count]
            logits = _step(adapter, state, cache, inputs, counts, narrow)
            for row, count in enumerate(counts):
                logits_of[row].append(logits[row, :count])
                done[row] += count
        topk = overrides.get("index_topk", 0)
        for row in range(3):
            sequence = torch.cat([prompt[:-1], streams[row]])
            recorder = RecordIndexScores(topk)  # a tie at the k-th score would be a coin toss
            with recorder:
                full = model(input_ids=sequence[None]).logits[0]
            if 0 < topk < len(sequence):
                assert_no_ties_at_k(recorder)
            expected = full[len(prompt) - 1 :]
            got = torch.cat(logits_of[row])
            assert got.shape == expected.shape
            atol = LOGITS_ATOL.get(case, 1e-9)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=atol)
    assert cache.lengths == totals


def test_a_ragged_step_past_the_capacity_is_refused() -> None:
    adapter = ls.adapt(tiny_model("qwen3"))
    state = adapter.prefill(_ids(10, 2))
    cache = adapter.new_branch_cache(state, batch=2, capacity=3)
    with torch.no_grad():
        adapter.decode(state, cache, torch.zeros(2, 2, dtype=torch.long), counts=[2, 1])
        with pytest.raises(RuntimeError, match="run branch 0 to 4"):
            adapter.decode(state, cache, torch.zeros(2, 2, dtype=torch.long), counts=[2, 0])


def test_ragged_branch_attention_in_key_blocks_equals_one_softmax(monkeypatch) -> None:
    """The ragged branch segment visits keys in blocks (a long prefilled tool result builds
    no ``[queries, keys]`` matrix); with a tiny block budget it equals one masked softmax."""
    from longstraw_core.attention import blocks, ragged

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4 * 5, 8, generator=gen, dtype=torch.float64)  # 4 heads a kv head
    k = torch.randn(3, 2, 11, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 2, 11, 6, generator=gen, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10], [3, 4, 5, 6, 7]])
    whole = ragged.ragged_branch(q, k, v, 0.3, positions)
    monkeypatch.setattr(blocks, "MAX_SCORE_ELEMENTS", 360)  # one key a block
    out, lse = ragged.ragged_branch(q, k, v, 0.3, positions)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    hidden = torch.arange(11) > positions.repeat(1, 4)[:, None, :, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole[0], out, rtol=1e-12, atol=1e-12)
