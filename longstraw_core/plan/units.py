"""Sizes in bytes, and how the planner writes bytes, counts and dtypes."""

from __future__ import annotations

import torch

GIB = 2**30
FP32 = 4  # bytes of a float32
INT64 = 8  # bytes of an int64


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


def dtype_name(size: int) -> str:
    """A floating dtype's short name from its size in bytes (``bf16``, ``fp32``...)."""
    return {2: "bf16", 4: "fp32", 8: "fp64"}.get(size, f"{size} B")


def human_bytes(value: int | None) -> str:
    """Human-readable bytes (``format_bytes``), ``-`` for an unknown budget."""
    from longstraw_core.state.prefix import format_bytes

    return "-" if value is None else format_bytes(value)


def human_count(value: int) -> str:
    """A parameter count with its unit: ``26.90B``, ``217.58M``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(value)
