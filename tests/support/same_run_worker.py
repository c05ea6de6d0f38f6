"""One rank of ``test_same_run``: in a directory of its own (``ARGV[1]/rank<R>``) holding a
``data.jsonl`` (other bytes on each rank when ``ARGV[2]`` is ``differ``, the same otherwise),
it starts the process group as the recipes do and checks a config that reads ``data.jsonl`` by
that relative path: every rank has the same config, and data that may differ, as nodes with
their own copies of a file do. Prints one JSON line: the rank and the error, if any."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator

from longstraw_core import config, distributed
from longstraw_core.launch import same_run

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"


def main() -> None:
    rank = int(os.environ["RANK"])
    home = Path(sys.argv[1]) / f"rank{rank}"
    home.mkdir(parents=True, exist_ok=True)
    answer = str(rank) if sys.argv[2] == "differ" else "0"
    (home / "data.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": answer}) + "\n")
    os.chdir(home)
    cfg = config.load_config(TINY, ["data.task=null", "data.path=data.jsonl"])
    accelerator = Accelerator(cpu=True)
    error = None
    try:
        same_run.require_same_run(cfg)
    except config.ConfigError as caught:
        error = str(caught)
    print(json.dumps({"rank": accelerator.process_index, "error": error}), flush=True)
    dist.destroy_process_group()
    distributed.exit_ranks()


if __name__ == "__main__":
    main()
