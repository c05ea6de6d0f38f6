"""Every rank runs the same run: its resolved config and its data checked against rank 0's.

Ranks read their settings each for itself, and they can differ: a node with another copy of
the config file or the data, an override or an ``${oc.env:...}`` that differs between nodes.
A rank with another ``optim.lr`` trains silently different weights; another ``train.steps``,
``train.save_every`` or ``grpo.gradient`` leaves the others waiting in a collective until the
timeout (``distributed.timeout_minutes``); another group size, ``data.seed`` or
``lora.enabled`` fails far into the run on tensor sizes. So before anything loads, one
collective (``all_gather_object``) brings every rank's resolved config and data fingerprints
(``data.fingerprint``: size and sha256) to every rank, through the gloo side group
(``distributed.cpu_group``: the records never touch a GPU), and every rank stops with the same
``ConfigError`` naming each key that differs, and the values, when any does.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from longstraw_core.config import ConfigError, RunConfig, to_dict
from longstraw_core.config.validation import eval_data
from longstraw_core.data import samples as data
from longstraw_core.distributed import cpu_group
from longstraw_core.launch.resume import flatten

SHOWN = 6  # differing keys named in the message; the rest are counted


def run_record(cfg: RunConfig) -> dict[str, Any]:
    """What must be equal on every rank: each setting (flattened, resolved) and the bytes of
    each data file the run reads (``<section>.path (bytes)`` entries)."""
    record = flatten(to_dict(cfg))
    sections = {"data": cfg.data}
    if cfg.eval.every and eval_data(cfg).path != cfg.data.path:
        sections["eval.data"] = eval_data(cfg)
    for key, section in sections.items():
        mark = data.fingerprint(section)
        if mark is not None:
            record[f"{key}.path (bytes)"] = f"{mark['bytes']} bytes, sha256 {mark['sha256']}"
    return record


def differences(records: list[dict[str, Any]]) -> list[str]:
    """``rank R: key=value (rank 0: value)`` for every setting where a rank differs from rank
    0, ranks in order."""
    first, found = records[0], []
    for rank, record in enumerate(records[1:], start=1):
        for key in dict.fromkeys([*first, *record]):
            if first.get(key) != record.get(key):
                found.append(f"rank {rank}: {key}={record.get(key)!r} (rank 0: {first.get(key)!r})")
    return found


def require_same_run(cfg: RunConfig) -> None:
    """Stop every rank (``ConfigError``, the differing keys named) unless all run ``cfg``'s
    settings on the same data. A collective: every rank calls it, before any weight loads.
    Nothing to check without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    records: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(records, run_record(cfg), group=cpu_group())  # not via a GPU
    found = differences(records)  # type: ignore[arg-type]
    if not found:
        return
    key = found[0].split(": ", 1)[1].split("=", 1)[0]
    more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    raise ConfigError(
        key,
        f"the ranks run different settings: {'; '.join(found[:SHOWN])}{more}. Every rank "
        "must run the same config and data: look for a config file, data file, override or "
        "environment variable (${oc.env:...}) that differs between nodes",
    )
