"""``RegistryView``: a read-only table built from the registered model families on first use.

The tables other modules used to hold (``DEFAULT_LORA_TARGETS``, ``TINY_CONFIGS``,
``PRESETS``, ``LAYER_TYPES``) keep their names as views of ``model_adapters.registry``. The
registry is imported on first read, not at import time: ``model_adapters`` imports
``longstraw_core``, so the modules that define the views cannot import it back while loading.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any


class RegistryView(Mapping[str, Any]):
    """``model_adapters.registry.<table>()`` as a mapping, rebuilt when a family registers."""

    def __init__(self, table: str) -> None:
        self._table = table
        self._version: int | None = None
        self._data: dict[str, Any] = {}

    def _current(self) -> dict[str, Any]:
        registry = importlib.import_module("model_adapters.registry")
        version = registry.version()
        if version != self._version:
            self._data = getattr(registry, self._table)()
            self._version = registry.version()
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._current()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        return repr(self._current())
