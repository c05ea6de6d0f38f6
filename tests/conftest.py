"""Shared test settings and fixtures (the layout: ``tests/README.md``)."""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Tiny models spend more time synchronising threads than computing; one thread is faster
# and keeps timings steady when the 2-core CI machine is busy. OMP_NUM_THREADS too: a run
# takes it over its own choice (longstraw_core.process.threads), in this process (recipes run
# in-process) and in every process the tests start; a test of that choice unsets it.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The helpers in tests/support are importable by name in this process (pyproject's
# ``pythonpath``) and in every process the tests start: the ranks torchrun runs (the worker
# scripts, and test files that run themselves) and the recipes, whose rewards they hold.
SUPPORT = Path(__file__).resolve().parent / "support"
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])
)


def pytest_generate_tests(metafunc):
    """``@pytest.mark.threads``: the test twice, at 1 and 2 torch threads (``torch_threads``).
    Thread counts change where float32 and float64 sums split, so a tolerance tuned to one
    machine's rounding fails at the other count: a cheap sample of the numeric tests carries
    the mark (the suite itself runs at one thread, above)."""
    if metafunc.definition.get_closest_marker("threads"):
        metafunc.fixturenames.append("torch_threads")
        metafunc.parametrize("torch_threads", [1, 2], indirect=True, ids=lambda n: f"threads{n}")


@pytest.fixture
def torch_threads(request):
    """``torch.set_num_threads(request.param)`` for one test (``@pytest.mark.threads``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    assert torch.get_num_threads() == request.param
    yield request.param
    torch.set_num_threads(previous)


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
    from longstraw_core.data.tokenizer import load_tokenizer

    return load_tokenizer(None)


# Test files by their measured time on a 2-core machine like CI's, longest first (seconds summed
# from `pytest -n 2 --dist loadfile --durations=0`, 2026-12-03): the files with most of the
# suite's subprocess runs. Refresh when a file's weight changes a lot; files not listed go
# after these, in their own order.
LONGEST_FIRST = (
    "training/test_recipes.py",  # 575 s
    "training/test_faults.py",  # 538 s
    "training/test_recipes_distributed.py",  # 450 s
    "models/test_loading.py",  # 355 s
    "plan/test_plan.py",  # 331 s
    "training/test_recipes_pipeline.py",  # 280 s
    "training/test_faults_distributed.py",  # 274 s
    "tools/test_agent_run.py",  # 204 s
    "pipeline/test_pipeline.py",  # 183 s
    "test_gpu_check.py",  # 161 s
    "checkpoint/test_output_dir.py",  # 105 s
    "families/test_real_model.py",  # ~110 s (measured alone: 103-130 s)
    "plan/test_scale_check.py",  # 99 s
    "distributed/test_distributed.py",  # 98 s
    "pipeline/test_schedule_grid.py",  # ~75 s
    "adapters/test_activation_checkpointing.py",  # 71 s
    "distributed/test_same_run.py",  # 69 s
    "test_entry_points.py",  # 64 s
    "models/test_qlora.py",  # 63 s
    "plan/test_plan_stages.py",  # 60 s
    "plan/test_plan_chunking.py",  # ~50 s
    "distributed/test_nccl_rules.py",  # 56 s
    "training/test_two_nodes.py",  # ~56 s
    "families/test_glm52_adapter.py",  # 54 s
    "distributed/test_fsdp_lora.py",  # ~48 s
    "training/test_learn_real.py",  # ~40 s (the real model)
)


def pytest_collection_modifyitems(config, items):
    """The longest files first. Under ``make test`` (pytest-xdist, ``--dist loadfile
    --no-loadscope-reorder``) a worker takes whole files in collection order: a long file
    taken last leaves the other worker idle for its whole length (a stable sort: each
    file's tests keep their order and stay together). xdist's own reordering (by the number
    of tests a file has) would put the few-test, many-process files last."""
    tests = Path(__file__).resolve().parent
    rank = {tests / name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(LONGEST_FIRST)))
