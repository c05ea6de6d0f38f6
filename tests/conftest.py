"""Shared test settings and fixtures (the layout: ``tests/README.md``)."""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Tiny models spend more time synchronising threads than computing; one thread is faster
# and keeps timings steady when the 2-core CI machine is busy.
torch.set_num_threads(1)

# The helpers in tests/support are importable by name in this process (pyproject's
# ``pythonpath``) and in every process the tests start: the ranks torchrun runs (the worker
# scripts, and test files that run themselves) and the recipes, whose rewards they hold.
SUPPORT = Path(__file__).resolve().parent / "support"
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])
)


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank, so FSDP2 and DCP run in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()  # sharded models hold the group: free them while the group still exists
    dist.destroy_process_group()


@pytest.fixture
def float64_default():
    """Float64 as torch's default dtype for one test: TRL builds its rewards, advantages and
    metrics in the default dtype, so comparisons with it are not limited by float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def tokenizer():
    """The built-in byte-level tokenizer."""
    from longstraw_core.tokenizer import load_tokenizer

    return load_tokenizer(None)


def pytest_collection_modifyitems(config, items):
    """Files with multi-process or slow tests run first. Under ``make test`` (pytest-xdist,
    ``--dist loadfile``) a worker takes whole files in collection order: a long file taken
    last leaves the other worker idle for its whole length, so the long ones go first (a
    stable sort: each file's tests keep their order and stay together)."""
    heavy = {
        item.path
        for item in items
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("slow")
    }
    items.sort(key=lambda item: item.path not in heavy)
