"""Threads per process (``longstraw_core.threads``): the node's cores shared by its
processes unless ``OMP_NUM_THREADS`` says otherwise (a run's own is read from its shape
block: ``test_run_output``, and the 2-rank run of ``test_recipes_distributed``)."""

from __future__ import annotations

import torch

from longstraw_core import threads


def test_the_cores_are_shared_by_the_processes_of_the_node_at_least_one_each():
    assert threads.choose({}, cores=16, local_processes=2).threads == 8
    assert threads.choose({}, cores=2, local_processes=2).threads == 1
    assert threads.choose({}, cores=2, local_processes=8).threads == 1
    choice = threads.choose({"OMP_NUM_THREADS": ""}, cores=3, local_processes=1)
    assert choice.describe() == (
        "3 per process (3 cores available / 1 process on this node; OMP_NUM_THREADS overrides)"
    )


def test_omp_num_threads_wins_and_torch_keeps_its_count():
    assert threads.choose({"OMP_NUM_THREADS": "4"}, cores=16, local_processes=1) is None
    before = torch.get_num_threads()
    choice = threads.apply({"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "1"})
    assert torch.get_num_threads() == before == choice.threads
    assert choice.describe() == f"{before} per process (OMP_NUM_THREADS=4)"


def test_without_omp_num_threads_torch_is_set_to_the_choice():
    before = torch.get_num_threads()
    try:
        choice = threads.apply({"LOCAL_WORLD_SIZE": "1"})
        assert choice.threads == threads.available_cores() == torch.get_num_threads()
        many = threads.apply({"LOCAL_WORLD_SIZE": str(threads.available_cores() * 4)})
        assert many.threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
