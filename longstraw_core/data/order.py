"""Which kept row a run's sample ``index`` reads: the data in order, or shuffled as TRL does.

TRL's ``GRPOTrainer`` (``shuffle_dataset=True``, its default) draws its prompts through
``RepeatSampler``: a ``torch.Generator`` seeded once with the run's seed, and one
``torch.randperm`` of the dataset per pass over it (epoch). ``DataOrder`` gives the same
permutations, but as a pure function of ``index``: epoch ``index // size``, position
``index % size`` in that epoch's permutation. So the sample at a data position is the same
whatever came before, and a resumed run (``data_position`` from its checkpoint) reads the
rows an uninterrupted run would have.

    order = DataOrder(size=5, shuffle=True, seed=0)
    [order(i) for i in range(10)]   # two passes, each a permutation of 0..4
"""

from __future__ import annotations

import torch


class DataOrder:
    """``index -> row`` in ``[0, size)``: each epoch a permutation (``shuffle``) or in order.

    Only the current epoch's permutation is kept (``size`` int64s); going to a later epoch
    draws on from the generator, going back replays it from the seed.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._generator: torch.Generator | None = None
        self._epoch = -1
        self._permutation: torch.Tensor | None = None

    def __call__(self, index: int) -> int:
        if index < 0:
            raise IndexError(f"data index must be >= 0, got {index}")
        epoch, offset = divmod(index, self.size)
        if not self.shuffle:
            return offset
        return int(self._epoch_permutation(epoch)[offset])

    def _epoch_permutation(self, epoch: int) -> torch.Tensor:
        if self._generator is None or epoch < self._epoch:
            # As RepeatSampler seeds its generator: a CPU generator, manual_seed(seed).
            self._generator = torch.Generator().manual_seed(self.seed)
            self._epoch = -1
        while self._epoch < epoch:
            self._permutation = torch.randperm(self.size, generator=self._generator)
            self._epoch += 1
        assert self._permutation is not None
        return self._permutation
