"""One CPU rank (gloo) of ``test_loading``: load a saved checkpoint the way the recipes do.

``loading_worker.py OUT CHECKPOINT STAGES FSDP [QUANTIZATION]`` loads the policy twice:
first without LoRA, measuring how much the rank's resident memory grows while loading, then
with LoRA (seeded as the recipes seed it); each rank writes ``rank{r}.pt``: both state dicts
(a sharded parameter as its local shard; a 4-bit weight as its packed bytes, its
quantization state as its own entries), the growth, and the stage's layers.
"""

from __future__ import annotations

import os
import resource
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longstraw_core.config import DistributedSection, LoraSection, ModelSection, TrainSection
from longstraw_core.models import sharded_loading as loading
from longstraw_core.parallel.topology import RunTopology

SEED = 7


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain tensors: a DTensor's local shard, a bitsandbytes ``Params4bit`` as its bytes."""
    state = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    return {k: v.detach().as_subclass(torch.Tensor).clone() for k, v in state.items()}


def main(out: str, checkpoint: str, stages: int, fsdp: bool, quantization: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    cfg = SimpleNamespace(
        model=ModelSection(path=checkpoint, quantization=quantization),
        lora=LoraSection(),
        distributed=DistributedSection(fsdp=fsdp, pipeline_stages=stages),
        train=TrainSection(seed=SEED),
    )
    topology = RunTopology.from_config(cfg.distributed, dist.get_world_size(), rank)
    device = torch.device("cpu")
    before = _rss_bytes()
    adapter = loading.load_policy(cfg, topology, device)
    # ru_maxrss (KiB) is the largest resident size so far: at least the peak while loading.
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    plain = _local(adapter.model.state_dict())
    layers = list(adapter.owned_layers())
    del adapter
    cfg.lora = LoraSection(enabled=True, r=4)
    torch.manual_seed(SEED)
    adapter = loading.load_policy(cfg, topology, device)
    assert adapter.device == device, adapter.device
    lora = _local(adapter.model.state_dict())
    torch.save(
        {"plain": plain, "lora": lora, "growth": growth, "layers": layers},
        Path(out) / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    quantization = sys.argv[5] if len(sys.argv) > 5 else None
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "fsdp", quantization)
