"""Where a relative path in a run config points: one rule, ``docs/configs.md``, "Relative
paths".

- A path the run *reads* (``model.path``, ``tokenizer.path``, ``data.path``,
  ``eval.data.path``), written in a config file, is relative to that file's directory, as
  its ``defaults:`` bases and its reward and tool modules are: a config and the data beside
  it run from any working directory. ``anchor`` makes those values absolute as each file of
  the ``defaults:`` chain is read, so a base's paths stay relative to the base.
- Everything else is relative to the working directory: every ``key=value`` on the command
  line (typed where the command runs, as a shell's paths are), and the run's own outputs,
  ``train.output_dir`` and ``train.resume_from``: a shipped config's ``outputs/<name>``
  lands under the directory the run is started from, as it always has.

Values that are not file paths stay as written: ``pypi:<package>``, ``builtin:bytes`` and a
Hub id (``Qwen/Qwen3-0.6B``) unless a file of that name is beside the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longstraw_core.config.hub import looks_like_hub_id

# (section, ..., key) of every path a run reads; ``hub`` marks those a Hub id may fill.
READ_PATHS: dict[tuple[str, ...], bool] = {
    ("model", "path"): True,
    ("tokenizer", "path"): True,
    ("data", "path"): False,
    ("eval", "data", "path"): False,
}


def anchor(body: dict[str, Any], directory: Path) -> None:
    """Rewrite, in place, the relative read paths of one config file's ``body`` as absolute
    paths under ``directory`` (the file's own)."""
    for keys, hub in READ_PATHS.items():
        section: Any = body
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if not isinstance(section, dict):
            continue
        value = section.get(keys[-1])
        if isinstance(value, str) and _relative_file(value, directory, hub=hub):
            section[keys[-1]] = str(directory / value)


def _relative_file(value: str, directory: Path, *, hub: bool) -> bool:
    if not value or Path(value).expanduser().is_absolute() or value.startswith("~"):
        return False
    if ":" in value.split("/", 1)[0]:  # pypi:<package>, builtin:bytes, a URL
        return False
    if hub and not (directory / value).exists():  # nothing of that name beside the config
        return not looks_like_hub_id(value)
    return True
