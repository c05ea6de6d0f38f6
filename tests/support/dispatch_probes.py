"""What the tests watch a pass with, op by op (``TorchDispatchMode``): the DSA indexer's
rankings, and the largest tensor any op makes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordIndexScores(TorchDispatchMode):
    """Keeps the input of every ``topk`` with ``k == index_topk`` (the indexer's ranking)."""

    def __init__(self, topk: int) -> None:
        super().__init__()
        self.topk, self.scores = topk, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.topk.default and args[1] == self.topk:
            self.scores.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


def assert_no_ties_at_k(recorder: RecordIndexScores) -> None:
    """In every row that sees more than k positions, the k-th and (k+1)-th scores differ."""
    k, rows = recorder.topk, 0
    assert recorder.scores, "the reference never ranked index scores"
    for scores in recorder.scores:
        ranked = scores.reshape(-1, scores.shape[-1]).sort(dim=-1, descending=True).values
        ranked = ranked[torch.isfinite(ranked[:, k])]  # rows with more than k visible keys
        gap = ranked[:, k - 1] - ranked[:, k]
        assert (gap > 1e-6 * ranked[:, k - 1].abs().clamp_min(1.0)).all(), "tie at the k-th score"
        rows += len(ranked)
    assert rows > 0, "no query saw more than index_topk positions: the case is not sparse"


class RecordLargestOutput(TorchDispatchMode):
    """The largest numel among the outputs of all ops while active; ``views=False``: of the
    ops that allocate (not views)."""

    def __init__(self, views: bool = True) -> None:
        super().__init__()
        self.views = views
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.is_view and not self.views:
            return result
        for output in result if isinstance(result, tuple | list) else (result,):
            if isinstance(output, torch.Tensor):
                self.largest = max(self.largest, output.numel())
        return result
