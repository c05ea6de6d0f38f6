"""Reading an offline W&B run file back: what the run really recorded (metrics, config)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2


def wandb_records(run_file: Path, wait_s: float = 60.0) -> list[wandb_internal_pb2.Record]:
    """The records of a finished run's ``run-*.wandb`` file, up to its ``exit`` record.

    W&B's service process writes the file, and may still be writing its last records (the
    last step's history, the exit) when ``finish()`` has returned on a loaded machine: read
    again until the exit record is there, for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        records = _read_records(run_file)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_records(run_file: Path) -> list[wandb_internal_pb2.Record]:
    """W&B's 7-byte header, then LevelDB-log blocks of 32 KiB whose chunks (7-byte header:
    crc, length, type) hold protobuf Records; a chunk not yet whole ends the list."""
    data, block, position = run_file.read_bytes(), 32768, 7
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # block trailer padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if position + 7 + length > len(data):
            break
        if kind == 0:  # zero padding up to the next block
            position += block - position % block
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_config(records: list[wandb_internal_pb2.Record]) -> dict[str, Any]:
    """The run config the records hold (later updates win)."""
    config: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            updates = record.config.update
            config |= {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}
    return config


def wandb_history(records: list[wandb_internal_pb2.Record]) -> dict[int, dict[str, Any]]:
    """The logged metrics by step (items carry a flat key, or a nested key path for a table)."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.setdefault(int(row["_step"]), {}).update(row)
    return rows
