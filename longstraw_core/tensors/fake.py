"""Values of tensors that may be fake (``FakeTensorMode``: shapes and dtypes, no data).

Why: ``longstraw_core.scale_check`` runs whole GRPO steps at real dimensions on fake
tensors, and the few places that read a tensor's values (a loss for the metrics, whether
the logits are finite, which branches finished) have none to read there. They call these
helpers, which return the value of a real tensor and the stated stand-in for a fake one;
on real tensors nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``FakeTensor`` (it has a shape and a dtype, no values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


T = TypeVar("T")


def representative(items: Sequence[T], like: torch.Tensor) -> Sequence[T]:
    """``items``, or on fake tensors (``like`` is one) only the first two and the last.

    For a loop over blocks whose iterations make tensors of the same shapes and write into
    buffers made before it: its peak is reached by the second iteration (the first one's
    tensors may still be bound while the second's are made), and the last may be shorter.
    The iterations in between change neither a shape nor the peak, and on fake tensors they
    compute nothing; at a million-token prompt they are most of a dry run's time.
    """
    if not is_fake(like) or len(items) <= 3:
        return items
    return [items[0], items[1], items[-1]]


def known_bool(tensor: torch.Tensor, fake: bool) -> bool:
    """``bool(tensor)``, or ``fake`` when ``tensor`` has no values."""
    return fake if is_fake(tensor) else bool(tensor)


def known_float(tensor: torch.Tensor, fake: float = float("nan")) -> float:
    """``tensor.item()``, or ``fake`` (NaN: unknown) when ``tensor`` has no values."""
    return fake if is_fake(tensor) else float(tensor.item())


def known_list(tensor: torch.Tensor, fake: object) -> list:
    """``tensor.tolist()``, or ``[fake] * len(tensor)`` when ``tensor`` has no values."""
    return [fake] * len(tensor) if is_fake(tensor) else tensor.tolist()


@contextmanager
def real_values() -> Iterator[None]:
    """Compute on real tensors inside a ``FakeTensorMode`` (a no-op outside one): for the
    small values a dry run still knows, such as its rewards and their advantages."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield
