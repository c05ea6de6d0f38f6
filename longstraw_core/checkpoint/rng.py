"""The random number generators a resumed run restores: python, numpy, torch CPU and CUDA,
one file per rank, stored so that they load with ``weights_only=True``."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import torch

from longstraw_core.checkpoint.ranks import this_rank


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional; nothing to restore without it
        return state
    # As plain numbers and a tensor, so the file loads with weights_only=True.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    return state


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def own_rng_file(directory: Path) -> Path:
    """This rank's RNG file; rank 0's for a rank the saving run did not have (with a
    warning: its random streams then repeat rank 0's)."""
    path = directory / rng_file(this_rank())
    if path.is_file():
        return path
    warnings.warn(
        f"{directory} holds no RNG states for rank {this_rank()} (saved by fewer ranks); "
        "restoring rank 0's",
        stacklevel=3,
    )
    return directory / rng_file(0)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
