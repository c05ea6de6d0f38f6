"""Rollout with an environment whose answers take time (issue 27): a branch waiting on its
tools holds up no other branch, and when the answers come does not change what is sampled.

The handlers here follow ``TurnHandler`` with no threads: they decide by themselves when an
answer is ready, so the tests are exact about the order of events. ``ToolTurns``' threads are
tested in ``tests/tools/test_tool_threads.py``.
"""

from __future__ import annotations

import pytest
import torch

import longstraw_core as ls
from longstraw_core.models.tiny import tiny_model

VOCAB = 512
EOS = list(range(40))  # many end tokens: turns end every few tokens
# Half the vocabulary ends a turn: every branch ends its second turn long before the budget
# (the seed is fixed, so this is checked, not hoped: a cut branch fails the test).
HALF = list(range(256))
REPLY = [300, 301, 302, 5]  # 5 is an end token: fed, it ends nothing
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_5_text": ("qwen3_5_text", {}),
    "glm_sparse": ("glm_moe_dsa", {"index_topk": 6}),
}
LOGP_ATOL = {"qwen3_5_text": 2e-5}
_MODELS: dict[str, torch.nn.Module] = {}


def _model(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        model_type, overrides = CASES[case]
        _MODELS[case] = tiny_model(model_type, **overrides)
    return _MODELS[case]


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(seed))


class HeldTurns:
    """Answers each branch's first ended turn with ``REPLY`` and its next with ``[]`` (the
    branch ends). Branch ``held``'s first answer is ready only once every other branch has
    ended for good; the rollout asking to wait while another branch could still decode
    is a failure (a lock-step rollout would)."""

    def __init__(self, size: int, held: int) -> None:
        self.size, self.held = size, held
        self.turns: dict[int, int] = {}
        self.ready: dict[int, list[int]] = {}
        self.waiting: dict[int, list[int]] = {}
        self.ended: set[int] = set()
        self.order: list[int] = []  # rows in the order their answers were given

    def begin_turns(self, turns: dict[int, list[int]]) -> None:
        for row in turns:
            count = self.turns.get(row, 0)
            self.turns[row] = count + 1
            answer = REPLY if count == 0 else []
            if not answer:
                self.ended.add(row)
            (self.waiting if row == self.held and count == 0 else self.ready)[row] = answer

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        others_done = self.ended >= set(range(self.size)) - {self.held}
        if self.waiting and others_done:
            self.ready.update(self.waiting)
            self.waiting.clear()
        if wait and not self.ready:
            raise AssertionError("the rollout waited on a held branch while others could go on")
        ready, self.ready = self.ready, {}
        self.order += list(ready)
        return ready


@pytest.mark.parametrize("case", list(CASES))
def test_a_branch_waiting_on_its_tools_holds_up_no_other(case: str) -> None:
    adapter = ls.adapt(_model(case))
    state = adapter.prefill(_prompt(3), chunk_size=16)
    handler = HeldTurns(size=4, held=0)
    out = ls.rollout(
        adapter, state, num_generations=4, max_new_tokens=40, eos_token_ids=HALF, seed=11,
        turns=handler,
    )  # fmt: skip
    # Every other branch ended for good before branch 0 got its first answer; then it went
    # on to its own second turn.
    assert handler.order[-2:] == [0, 0] and handler.order.count(0) == 2
    assert all(handler.turns[row] == 2 for row in range(4)) and not any(out.truncated)
    for response, logps, mask in zip(out.responses, out.logps, out.loss_masks, strict=True):
        tokens = response.tolist()
        first_end = next(i for i, t in enumerate(tokens) if t in HALF)
        fed = tokens[first_end + 1 : first_end + 1 + len(REPLY)]
        assert fed == REPLY[: len(fed)]
        expected = torch.ones_like(mask)
        expected[first_end + 1 : first_end + 1 + len(fed)] = 0
        assert torch.equal(mask, expected)
        with torch.no_grad():  # the prefilled answer extended the branch's own state exactly
            scored = adapter.score(state, response)
        assert (logps - scored).abs().max() <= LOGP_ATOL.get(case, 1e-5)


class DelayedTurns:
    """Answers like ``HeldTurns`` without holding, but each answer becomes ready only after
    ``delays[row]`` further calls of ``ended_turns`` (0: at once)."""

    def __init__(self, delays: list[int]) -> None:
        self.delays = delays
        self.turns: dict[int, int] = {}
        self.due: dict[int, tuple[int, list[int]]] = {}
        self.calls = 0

    def begin_turns(self, turns: dict[int, list[int]]) -> None:
        for row in turns:
            count = self.turns.get(row, 0)
            self.turns[row] = count + 1
            self.due[row] = (self.calls + self.delays[row], REPLY if count == 0 else [])

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        self.calls += 1
        if wait:  # nothing else to do: the soonest answer is ready now
            soonest = min(due for due, _ in self.due.values())
            self.calls = max(self.calls, soonest)
        ready = {row: answer for row, (due, answer) in self.due.items() if due <= self.calls}
        for row in ready:
            del self.due[row]
        return ready


def test_when_answers_come_does_not_change_what_is_sampled() -> None:
    """Each branch draws its token at each position from the same noise however far the
    others have got (``NoiseBlocks``): answers that come at once and answers that come many
    steps late give the same responses and log-probs for the same seed."""
    adapter = ls.adapt(_model("qwen3"))
    state = adapter.prefill(_prompt(4), chunk_size=16)
    options = {"num_generations": 4, "max_new_tokens": 24, "eos_token_ids": EOS, "seed": 5}
    at_once = ls.rollout(adapter, state, turns=DelayedTurns([0, 0, 0, 0]), **options)
    late = ls.rollout(adapter, state, turns=DelayedTurns([9, 0, 3, 17]), **options)
    assert at_once.stats["steps"] != late.stats["steps"]  # the branches really drifted apart
    for a, b in zip(at_once.responses, late.responses, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(at_once.logps, late.logps, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert [m.tolist() for m in at_once.loss_masks] == [m.tolist() for m in late.loss_masks]


def test_noise_blocks_asked_in_any_order_are_the_blocks_drawn_in_order() -> None:
    """Block ``k`` is the ``k``-th ``[G, vocab]`` Exp(1) draw of the seeded generator, as
    ``generate`` draws it, also when asked for after later blocks (a branch that fell
    behind) or again."""
    from longstraw_core.rollout.sampled_group import NoiseBlocks

    generator = torch.Generator().manual_seed(9)
    in_order = [torch.empty(3, 7).exponential_(1, generator=generator) for _ in range(5)]
    blocks = NoiseBlocks(torch.Generator().manual_seed(9), 3, torch.float32, keep_states=True)
    for k in [2, 0, 4, 1, 1, 3, 0]:
        assert torch.equal(blocks.block(k, 7), in_order[k]), k
    blocks.forget_before(3)
    assert sorted(blocks.states) == [3, 4]
